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
import contextlib
import json

import pytest
import sac_plugin
import torch
import torch.fx.traceback as fx_traceback
from sac_plugin import Policy, recompute_unit
from sac_plugin._call_facts import casts_a_parameter, draws_random, op_traits
from sac_plugin.units import UNIT_ANNOTATION_PREFIX
from support import every_kind_of_call
from support.every_kind_of_call import LINEAR_POLICIES, POLICIES, hits_per_policy, linear_layer_and_input
from support.subprocesses import run_program
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

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


# A call's two facts beyond its op (NOTE: [A call's facts are decided here] in csrc/ops/op_traits.h).
ATTENTION_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
TO_COPY = torch.ops.aten._to_copy.default
FACTS_POLICY = Policy(kept_ops=[every_kind_of_call.ATTENTION, "aten::_to_copy"])


def calls_with_facts():
    """Calls as a Python front door sees them, (op, args, kwargs), each with the facts the rule
    must find: (draws random numbers, casts a parameter)."""
    q = torch.randn(1, 1, 8, 8)
    weight = nn.Parameter(torch.randn(8, 8))
    return {
        "dropout_p int 0": ((ATTENTION_OP, (q, q, q, 0), {}), (False, False)),
        "dropout_p 0.0": ((ATTENTION_OP, (q, q, q, 0.0), {}), (False, False)),
        "dropout_p 0.1": ((ATTENTION_OP, (q, q, q, 0.1), {}), (True, False)),
        "dropout_p 0.1 by name": ((ATTENTION_OP, (q, q, q), {"dropout_p": 0.1}), (True, False)),
        "dropout_p left out": ((ATTENTION_OP, (q, q, q), {}), (False, False)),
        "a random op": ((torch.ops.aten.bernoulli.default, (q,), {}), (True, False)),
        "a leaf parameter cast": ((TO_COPY, (weight,), {"dtype": torch.float64}), (False, True)),
        "a leaf parameter cast into out=": (
            (torch.ops.aten._to_copy.out, (weight,), {"out": torch.empty(8, 8, dtype=torch.float64)}),
            (False, True),
        ),
        "a cast of a cast": ((TO_COPY, (weight.to(torch.float64),), {"dtype": torch.float32}), (False, False)),
        "a cast of a tensor without grad": ((TO_COPY, (q,), {"dtype": torch.float64}), (False, False)),
    }


@pytest.mark.parametrize("case", list(calls_with_facts()))
def test_the_python_front_doors_take_a_calls_facts_from_the_cpp_rule(case):
    (op, args, kwargs), (draws, casts) = calls_with_facts()[case]
    traits = op_traits(op)
    # What the dispatch-mode engine and the policy function hand the rule: C++'s answers.
    assert draws_random is sac_plugin._C.draws_random and casts_a_parameter is sac_plugin._C.casts_a_parameter
    assert (draws_random(traits, args, kwargs), casts_a_parameter(traits, args)) == (draws, casts)
    if op is torch.ops.aten.bernoulli.default:
        return  # a random op cannot be named in a policy
    # torch.compile's policy function keeps a call of a named op unless one of its facts forbids it.
    decide = sac_plugin.torch_policy_fn(FACTS_POLICY)
    decision = decide(SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)
    assert (decision == CheckpointPolicy.MUST_SAVE) is not (draws or casts)


class CallsWithFacts(nn.Module):
    """The calls of calls_with_facts() that the CPU can run (its attention has no dropout),
    made inside the region."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.register_buffer("scale", torch.ones(8, 8))

    def forward(self, x):
        q = torch.mm(x, self.weight).view(1, 1, 8, 8)
        a = ATTENTION_OP(q, q, q, 0)[0] + ATTENTION_OP(q, q, q, 0.0)[0] + ATTENTION_OP(q, q, q)[0]
        cast = TO_COPY(self.weight, dtype=torch.float64)  # a leaf parameter cast: recomputed
        w = TO_COPY(cast, dtype=torch.float32) * TO_COPY(self.scale, dtype=torch.float32)
        return (a.view(8, 8) @ w).sum()


class PassThroughMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("door", ["native engine", "dispatch-mode engine"])
def test_both_engines_serve_the_calls_whose_facts_allow_it(door):
    """The native engine reads the facts from the dispatcher's stack, the dispatch-mode engine
    (which a region whose forward runs under another dispatch mode uses) from Python's values:
    they serve the same calls."""
    layer, x = CallsWithFacts(), torch.randn(8, 8, requires_grad=True)
    sac_plugin.apply_selective_checkpointing(layer, FACTS_POLICY)
    with PassThroughMode() if door == "dispatch-mode engine" else contextlib.nullcontext():
        with sac_plugin.audit() as audited:
            layer(x).backward()
    assert audited.hits(every_kind_of_call.ATTENTION) == 3
    assert audited.hits("aten::_to_copy") == 2
