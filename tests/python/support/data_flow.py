"""Cases of kept calls matched by data flow: a layer that fills a cache in its first forward only,
a layer that writes its kept output through `.data`, and the steps that train them with and
without checkpointing, which must agree bitwise. CASES reports each case's audit counts, in
whichever engine this interpreter runs."""

import copy

import sac_plugin
import torch
from sac_plugin import Policy, recompute_unit
from torch import nn


class LazyCacheLayer(nn.Module):
    """Fills a cache with the same op, the same weight and the same shapes as its real call, in
    the first forward only (so the recompute of step 1 and every later pass skip it)."""

    def __init__(self, unit: str | None = None, cache_shape=(4, 8)):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.w2 = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.unit = unit
        self.cache_shape = cache_shape
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            with torch.no_grad():
                if self.cache_shape == "other":
                    self.cache = torch.ones(2, 3) @ torch.ones(3, 5)
                else:
                    self.cache = torch.ones(*self.cache_shape) @ self.w1
        if self.unit is None:
            return self._body(x)
        with recompute_unit(self.unit):
            return self._body(x)

    def _body(self, x):
        h = torch.tanh(x @ self.w1)
        return torch.sin(h @ self.w2)


def train_pair(policy, steps=3, **layer_kwargs):
    torch.manual_seed(0)
    model = LazyCacheLayer(**layer_kwargs)
    reference = copy.deepcopy(model)
    sac_plugin.apply_selective_checkpointing(model, policy)
    audits = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m in (model, reference):
            m.zero_grad()
        with sac_plugin.audit() as audit:
            loss = model(x).pow(2).sum()
            loss.backward()
        audits.append(audit)
        ref_loss = reference(x).pow(2).sum()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), f"step {step}: loss differs"
        for name in ("w1", "w2"):
            got, expected = getattr(model, name).grad, getattr(reference, name).grad
            assert torch.equal(got, expected), (
                f"step {step}: gradient of {name} differs by {(got - expected).abs().max().item()}"
            )
    return audits


# The ops whose counts the cases report: [forward, recompute, hits] each.
OPS = ("aten::mm", "aten::mul_.Tensor", "aten::copy_", "aten::tanh")


def audit_counts(audit) -> dict:
    return {op: [audit.count(op, phase="forward"), audit.count(op, phase="recompute"), audit.hits(op)] for op in OPS}


def lazy_cache_steps(policy: Policy) -> list:
    return [audit_counts(audit) for audit in train_pair(policy, steps=2)]


class DataWrite(nn.Module):
    """Writes its kept matmul's output through `.data` in the forward."""

    def __init__(self, write: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.write = write

    def forward(self, x):
        y = x @ self.w
        if self.write == "mul_":
            y.data.mul_(2)
        else:
            y.data.copy_(torch.full_like(y, 0.5))
        return torch.tanh(y)


def data_write_steps(write: str) -> list:
    torch.manual_seed(0)
    model = DataWrite(write)
    reference = DataWrite(write)
    reference.load_state_dict(model.state_dict())
    sac_plugin.apply_selective_checkpointing(model, Policy(kept_ops=["aten::mm"]))
    x = torch.randn(4, 8)
    with sac_plugin.audit() as audit:
        loss = model(x).pow(2).sum()
        loss.backward()
    expected = reference(x).pow(2).sum()
    expected.backward()
    assert torch.equal(loss, expected), "loss differs"
    difference = (model.w.grad - reference.w.grad).abs().max().item()
    assert torch.equal(model.w.grad, reference.w.grad), f"gradient of w differs by {difference}"
    return [audit_counts(audit)]


CASES = {
    "kept_calls": lambda: lazy_cache_steps(Policy(kept_calls={"aten::mm.default": [1]})),
    "every_nth_op": lambda: lazy_cache_steps(Policy(every_nth_op={"aten::mm": 2})),
    "data_mul_": lambda: data_write_steps("mul_"),
    "data_copy_": lambda: data_write_steps("copy_"),
}
