"""The one keep rule (docs/semantics.md), asked through every front door, gives one answer.

One layer makes a call of every kind the rule tells apart: matmuls outside units, inside a kept
unit and inside a recomputed unit, a view, an in-place write, an uninitialised allocation, a
parameter cast, attention, dropout. Each policy of a grid is then asked through the native
engine (what it kept, from the per-op trace), torch.compile's policy function (torch_policy_fn,
run by torch's own SAC with the units as node metadata would carry them), the planner
(Plan.calls_kept_by) and the dispatch-mode engine (audit hits, in a subprocess), and they must
agree call by call.
"""

import collections
import json

import pytest
import sac_plugin
import torch
import torch.fx.traceback as fx_traceback
from sac_plugin import Policy, recompute_unit
from sac_plugin._call_facts import op_traits
from sac_plugin.units import UNIT_ANNOTATION_PREFIX
from support import every_kind_of_call
from support.every_kind_of_call import LINEAR_POLICIES, POLICIES, hits_per_policy, linear_layer_and_input
from support.subprocesses import run_program
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

pytestmark = pytest.mark.native_engine("the native engine's per-op trace is the reference every front door is held to")


def _indexed(ops_and_flags):
    """[(op, kept)] in call order -> {(op, index among the op's calls): kept}."""
    seen = collections.Counter()
    out = {}
    for op, kept in ops_and_flags:
        out[(op, seen[op])] = kept
        seen[op] += 1
    return out


def native_decisions(policy, *, after_a_step=False):
    """What the native engine holds in the forward, call by call: in the layer's first forward
    (what the rule decides), or after a step has taught the layer's checkpoint site which kept
    calls its recompute never reaches (what it holds from then on)."""
    layer, x = every_kind_of_call.layer_and_input()
    sac_plugin.apply_selective_checkpointing(layer, policy)
    if after_a_step:
        layer(x).backward()
    torch.manual_seed(1)
    with sac_plugin.trace(layer) as traced:
        layer(x).backward()
    return _indexed((e.op, e.status == "kept") for e in traced.trace if e.phase == "forward")


def compile_policy_fn_decisions(policy, make_layer=every_kind_of_call.layer_and_input):
    """torch_policy_fn as torch.compile runs it, driven by torch's own eager SAC: the units that
    are open become the node metadata recompute_unit writes under compile."""
    layer, x = make_layer()
    decide = sac_plugin.torch_policy_fn(policy)
    seen = []

    def policy_fn(ctx, op, *args, **kwargs):
        custom = {UNIT_ANNOTATION_PREFIX + unit: True for unit in sac_plugin.open_units()}
        saved, fx_traceback.current_meta = fx_traceback.current_meta, {"custom": custom}
        try:
            decision = decide(ctx, op, *args, **kwargs)
        finally:
            fx_traceback.current_meta = saved
        if not ctx.is_recompute and not op_traits(op).never_counted:
            seen.append((f"{op._schema.name}.{op._overloadname}", decision == CheckpointPolicy.MUST_SAVE))
        return decision

    # Only the forward's decisions are compared: torch's eager cache cannot keep the kept clone
    # the forward writes in place from the write (the native engine can), so it is told to allow it.
    torch.manual_seed(1)
    checkpoint(
        layer,
        x,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy_fn, allow_cache_entry_mutation=True),
    )
    return _indexed(seen)


def planner_decisions(policy, make_layer=every_kind_of_call.layer_and_input):
    layer, x = make_layer()
    plan = sac_plugin.plan(layer, x, budget=2**30, runs=1, warmup=0)  # only its profile is read
    held = plan.calls_kept_by(policy) | plan.calls_offloaded_by(policy)  # the trace shows both as kept
    return {(op if "." in op.partition("::")[2] else op + ".default", index) for op, index in held}


@pytest.mark.skipif(
    sac_plugin._compat.python_handlers_run_below_the_plugin(),
    reason="the per-op trace needs torch >= 2.13 (TorchDispatchModes above the plugin's key)",
)
@pytest.mark.parametrize("name", POLICIES)
def test_the_native_engine_and_the_compile_policy_function_agree_call_by_call(name):
    native = native_decisions(POLICIES[name])
    compiled = compile_policy_fn_decisions(POLICIES[name])
    assert compiled == native
    assert any(native.values())  # every policy of the grid keeps something


@pytest.mark.skipif(
    sac_plugin._compat.python_handlers_run_below_the_plugin(),
    reason="the per-op trace needs torch >= 2.13 (TorchDispatchModes above the plugin's key)",
)
@pytest.mark.parametrize("name", POLICIES)
def test_the_planner_predicts_the_calls_the_native_engine_keeps(name):
    native = {call for call, kept in native_decisions(POLICIES[name], after_a_step=True).items() if kept}
    assert planner_decisions(POLICIES[name]) == native


def test_the_dispatch_mode_engine_serves_what_the_native_engine_serves():
    native = {"grid": hits_per_policy(), "linear": hits_per_policy(LINEAR_POLICIES, linear_layer_and_input)}
    done = run_program("dispatch_mode_hits.py", env={"SAC_PLUGIN_ENGINE": "dispatch_mode"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == native
    # The native engine's forward writes the bias into the kept mm's output; the mode's does not.
    assert native["linear"] == {name: {"aten::mm": 1} for name in LINEAR_POLICIES}


@pytest.mark.skipif(
    sac_plugin._compat.python_handlers_run_below_the_plugin(),
    reason="the per-op trace needs torch >= 2.13 (TorchDispatchModes above the plugin's key)",
)
@pytest.mark.parametrize("name", LINEAR_POLICIES)
def test_a_mm_written_in_the_forward_is_kept_alike_by_every_front_door(name):
    """The trace, the compiled policy function and the planner agree that the transposed F.linear's
    mm is kept, and the untraced run serves it, although only the untraced forward and the
    planner's profile see the bias written into it in place."""
    policy = LINEAR_POLICIES[name]
    layer, x = linear_layer_and_input()
    sac_plugin.apply_selective_checkpointing(layer, policy)
    with sac_plugin.audit() as untraced:
        layer(x).backward()
    assert untraced.count("aten::add_.Tensor", phase="forward") == 1  # the bias, written in place
    assert untraced.hits("aten::mm") == 1 and untraced.count("aten::mm", phase="recompute") == 0
    with sac_plugin.trace(layer) as traced:
        layer(x).backward()
    mm = [(e.phase, e.status) for e in traced.trace if e.op == "aten::mm.default"]
    assert mm == [("forward", "kept"), ("recompute", "served")]
    compiled = compile_policy_fn_decisions(policy, linear_layer_and_input)
    assert [kept for (op, _), kept in compiled.items() if op == "aten::mm.default"] == [True]
    assert planner_decisions(policy, linear_layer_and_input) == {("aten::mm.default", 0)}


class RoutingLayer(nn.Module):
    """A router: topk over the gate's scores, nonzero over its indices, a count read on the host."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.gate = nn.Parameter(torch.randn(8, 4) / 3)

    def forward(self, x):
        with recompute_unit("attn"):
            h = torch.mm(x, self.weight).tanh()
        values, indices = torch.topk(torch.mm(h, self.gate), 2, dim=-1)
        tokens = torch.nonzero(indices == 1)[:, 0]
        count = int((indices == 0).sum().item())  # before the last saves, so the recompute reaches it
        picked = h[tokens] * values[tokens, :1] * (1 + count)
        return picked.sum()


@pytest.mark.skipif(
    sac_plugin._compat.python_handlers_run_below_the_plugin(),
    reason="the per-op trace needs torch >= 2.13 (TorchDispatchModes above the plugin's key)",
)
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "opt_out"])
def test_routing_is_decided_alike_by_every_front_door(pin, monkeypatch):
    policy = Policy(kept_units=["attn"], pin_routing=pin)
    monkeypatch.setattr(every_kind_of_call, "EveryKindOfCall", RoutingLayer)
    native = native_decisions(policy)
    routing = {
        call: kept
        for call, kept in native.items()
        if call[0] in ("aten::topk.default", "aten::nonzero.default", "aten::_local_scalar_dense.default")
    }
    assert routing == {
        ("aten::topk.default", 0): pin,
        ("aten::nonzero.default", 0): pin,
        ("aten::_local_scalar_dense.default", 0): pin,
    }
    assert compile_policy_fn_decisions(policy) == native
    assert planner_decisions(policy) == {call for call, kept in native.items() if kept}
