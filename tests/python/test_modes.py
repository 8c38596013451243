"""TorchDispatchModes around a checkpointed step (NOTE: [A value is served from the level it was
kept at] in sac_plugin/checkpointing.py, NOTE: [The plugin's own calls] in csrc/dispatch/sac_key.h):
a mode that changes values gives the unmodified model's gradients bitwise, and a mode sees the
calls the model made, never a served call or one of the plugin's own."""

import collections

import pytest
import torch
from support.accelerator import SKIP_REASON, runner_with_models
from torch.utils._python_dispatch import TorchDispatchMode

import sac_plugin
from sac_plugin import Policy

ADDMM = torch.ops.aten.addmm.default
# Bodies on the test accelerator, over the offload tests' two layers.
_on_accelerator = runner_with_models("offloaded_outputs")


class FakeQuantize(TorchDispatchMode):
    """Rounds every matmul's output to multiples of 1/8, as fake quantization does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (ADDMM, torch.ops.aten.mm.default):
            out = torch.round(out * 8) / 8
        return out


class CastThroughBfloat16(TorchDispatchMode):
    """Casts every matmul's output to bfloat16 and back, as a mixed-precision emulation does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (ADDMM, torch.ops.aten.mm.default):
            out = out.to(torch.bfloat16).to(out.dtype)
        return out


class Calls(TorchDispatchMode):
    """Counts the calls that reach it, by op ("aten::addmm", "sac::op_traits")."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func._name] += 1
        return func(*args, **(kwargs or {}))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x))).sin()


class WritingLayer(Layer):
    """Writes its kept projection's output in place (NOTE: [Kept outputs written in the forward])."""

    def forward(self, x):
        h = self.up(x)
        h.mul_(0.5)
        return x + self.down(torch.tanh(h)).sin()


def _model(policy=None, layer=Layer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(layer(), layer(), layer())
    if policy is not None:
        for layer in model:
            sac_plugin.apply_selective_checkpointing(layer, policy)
    return model


def _gradients(model, *, whole_step=(), backward_only=(), autocast=False):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    modes = [mode() if isinstance(mode, type) else mode for mode in whole_step]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for mode in modes:
            mode.__enter__()
        try:
            loss = model(x).float().square().mean()
            later = [mode() if isinstance(mode, type) else mode for mode in backward_only]
            for mode in later:
                mode.__enter__()
            try:
                loss.backward()
            finally:
                for mode in reversed(later):
                    mode.__exit__(None, None, None)
        finally:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
    return [p.grad for p in model.parameters()] + [x.grad]


def _assert_bitwise(ours, reference):
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "policy",
    [
        Policy(kept_ops=["aten::addmm"]),
        Policy(kept_ops=["aten::addmm", "aten::tanh"]),
        Policy(offloaded_ops=["aten::addmm"], offload_min_bytes=0),
    ],
)
@pytest.mark.parametrize("mode", [FakeQuantize, CastThroughBfloat16])
@pytest.mark.parametrize("layer", [Layer, WritingLayer])
def test_a_value_changing_mode_gives_the_unmodified_models_gradients(policy, mode, layer):
    reference = _gradients(_model(layer=layer), whole_step=[mode])
    _assert_bitwise(_gradients(_model(policy, layer), whole_step=[mode]), reference)
    # Nested under a counting mode, and under autocast.
    _assert_bitwise(
        _gradients(_model(policy, layer), whole_step=[Calls, mode]),
        _gradients(_model(layer=layer), whole_step=[Calls, mode]),
    )
    _assert_bitwise(
        _gradients(_model(policy, layer), whole_step=[mode], autocast=True),
        _gradients(_model(layer=layer), whole_step=[mode], autocast=True),
    )


def test_kept_calls_are_served_under_a_mode_and_the_mode_sees_only_what_ran():
    policy = Policy(kept_ops=["aten::addmm"])
    unmodified = Calls()
    _gradients(_model(), whole_step=[unmodified])
    seen = Calls()
    with sac_plugin.audit() as audit:
        _gradients(_model(policy), whole_step=[seen])
    # Each layer keeps its two projections, both served in the recompute and unseen there: the
    # mode sees each addmm of the forward once, exactly as around the unmodified model, and the
    # recomputed tanh a second time.
    assert audit.hits("aten::addmm") == 6
    assert seen.calls["aten::addmm"] == unmodified.calls["aten::addmm"] == 6
    assert seen.calls["aten::tanh"] == 2 * unmodified.calls["aten::tanh"] == 6
    assert not [op for op in seen.calls if op.startswith("sac::")]


def test_a_mode_entered_for_the_backward_only_sees_no_served_call():
    policy = Policy(kept_ops=["aten::addmm"])
    seen = Calls()
    with sac_plugin.audit() as audit:
        ours = _gradients(_model(policy), backward_only=[seen])
    _assert_bitwise(ours, _gradients(_model()))
    assert audit.hits("aten::addmm") == 6
    # The recompute's addmms were all served.
    assert seen.calls["aten::addmm"] == 0 and seen.calls["aten::tanh"] == 3
    assert not [op for op in seen.calls if op.startswith("sac::")]


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
def test_a_mode_sees_none_of_the_offload_copies(engine):
    values = _on_accelerator(
        """
import collections
from torch.utils._python_dispatch import TorchDispatchMode

class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func._name] += 1
        return func(*args, **(kwargs or {}))

def seen(policy, whole_step):
    model, x = checkpointed(policy)
    step(model, x)
    calls = Calls()
    if whole_step:
        with calls:
            step(model, x)
    else:
        loss = model(x).square().mean()
        with calls:
            loss.backward()
    return {op: n for op, n in calls.calls.items() if op in ("aten::copy_", "aten::empty_strided", "aten::_to_copy")
            or op.startswith("sac::")}

report(**{f"{how}_{when}": seen(Policy(**{how: ["aten::addmm"]}), when == "step")
          for how in ("kept_ops", "offloaded_ops") for when in ("step", "backward")})
""",
        engine,
    )
    assert values["offloaded_ops_step"] == values["kept_ops_step"]
    assert values["offloaded_ops_backward"] == values["kept_ops_backward"]
