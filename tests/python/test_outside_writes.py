"""The recompute writes nothing outside its region (NOTE: [The recompute writes nothing outside
its region] in csrc/dispatch/outside_writes.cpp): BatchNorm's running statistics, a load counter
and a buffer the forward writes and then reads end two steps bitwise as in the unmodified model,
in either engine, with a selective policy and with full recompute."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sac_plugin

POLICIES = {
    "selective": lambda: sac_plugin.Policy(kept_ops=["aten::addmm"]),
    "full recompute": lambda: sac_plugin.Policy(),
}


class WritesOutside(nn.Module):
    """A layer whose forward writes its buffers: BatchNorm's statistics, a load counter, and a
    moving average it then reads (so the recompute must read what the forward read)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.register_buffer("load", torch.zeros(width))
        self.register_buffer("average", torch.zeros(width))

    def forward(self, x):
        h = self.lin(x)
        self.load.add_(h.detach().abs().sum(0))
        self.average.mul_(0.5).add_(h.detach().mean(0))
        return torch.tanh(self.bn(h)) * self.average


class ReadsBeforeWriting(nn.Module):
    """Reads a buffer, then writes it: the recompute must read the value from before the write (the
    add saves nothing, so the unmodified model's backward does not mind the write; sin saves what the
    add made of it)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        y = torch.sin(self.lin(x) + self.scale)
        self.scale.add_(1.0)
        return y


def _steps(model, checkpointed: bool, policy, steps: int = 2):
    context = sac_plugin.context_fn(policy, name=type(model).__name__) if checkpointed else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        out = checkpoint(model, x, use_reentrant=False, context_fn=context) if checkpointed else model(x)
        out.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads, context


def _assert_same_state(expected: nn.Module, actual: nn.Module):
    for (name, want), (_, got) in zip(expected.state_dict().items(), actual.state_dict().items(), strict=True):
        assert torch.equal(want, got), f"{name}: {want.flatten()[:4].tolist()} != {got.flatten()[:4].tolist()}"


@pytest.mark.parametrize("layer", [WritesOutside, ReadsBeforeWriting])
@pytest.mark.parametrize("policy", POLICIES)
def test_two_steps_leave_buffers_and_gradients_as_without_checkpointing(layer, policy):
    torch.manual_seed(0)
    base = layer()
    unmodified, checkpointed = copy.deepcopy(base), copy.deepcopy(base)
    want, _ = _steps(unmodified, False, None)
    got, _ = _steps(checkpointed, True, POLICIES[policy]())
    for step, (want_grads, got_grads) in enumerate(zip(want, got, strict=True)):
        for i, (a, b) in enumerate(zip(want_grads, got_grads, strict=True)):
            assert torch.equal(a, b), f"step {step}, parameter {i}"
    _assert_same_state(unmodified, checkpointed)


def test_full_recompute_intercepts_only_a_layer_that_writes_outside_itself():
    torch.manual_seed(0)
    _, writes = _steps(WritesOutside(), True, sac_plugin.Policy(), steps=1)
    _, pure = _steps(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), True, sac_plugin.Policy(), steps=1)
    assert writes.args[0].outside_writes_possible() is True
    assert pure.args[0].outside_writes_possible() is False


class WritesUncopyable(nn.Module):
    """A buffer whose storage holds no whole number of its elements: the region cannot copy it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        storage = torch.empty(10, dtype=torch.uint8).untyped_storage()
        self.register_buffer("odd", torch.tensor([], dtype=torch.float32).set_(storage, 0, (2,), (1,)).zero_())

    def forward(self, x):
        self.odd.add_(1.0)
        return torch.sin(self.lin(x)) * self.odd


def test_a_write_the_region_cannot_preserve_stops_the_recompute_naming_it():
    model = WritesUncopyable()
    context = sac_plugin.context_fn(sac_plugin.Policy(kept_ops=["aten::addmm"]), name="WritesUncopyable")
    out = checkpoint(model, torch.randn(3, 2), use_reentrant=False, context_fn=context)
    with pytest.raises(RuntimeError) as raised:
        out.sum().backward()
    message = str(raised.value).splitlines()[0]
    assert message == (
        "sac: the forward of WritesUncopyable writes 'self' of aten::add_.Tensor, a tensor the region did not "
        "produce (a buffer, a parameter, an input or a global), which the region cannot copy to keep the "
        "recompute from writing it again (a tensor subclass, or a storage that does not hold a whole number of "
        "its elements); the recompute would read and write it as the forward left it. Make the write outside "
        "the checkpointed function, or do not checkpoint WritesUncopyable"
    )
