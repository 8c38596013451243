"""Memory-budget plans. A plan never holds more than its budget, its policy gives the same
gradients bitwise and keeps exactly the planned calls, profiling changes nothing, and plans survive
a file round trip; bad budgets and plan files are refused by name. A budget across a model
(RecomputeConfig.budget): identical layers are planned once, the budget is split over layers to save
the most time, gradients stay bitwise; and the command line."""

import copy
import itertools
import json
import logging
import math
import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, Plan, PlanError, RecomputeConfig
from sac_plugin import Policy, _native, _scopes
from sac_plugin._validation import bounded_repr
from sac_plugin.__main__ import main
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import Llama, LlamaBlock, MoEBlock, rotary_tables
from sac_plugin.planner import _knapsack as knapsack
from sac_plugin.planner._split import split
from torch.utils.checkpoint import checkpoint
from torch import nn

from hypothesis import given, strategies as st
from support.accelerator import SKIP_REASON, run_accelerator_program
from support.random_steps import DIM, examples, run_steps, steps_strategy

pytestmark = pytest.mark.filterwarnings("ignore:sac. .*:UserWarning")


def llama_inputs(dim=32, heads=4, seq=16, batch=2, moe=False):
    torch.manual_seed(0)
    block = (MoEBlock if moe else LlamaBlock)(dim, heads)
    cos, sin = rotary_tables(dim // heads, seq)
    x = torch.randn(batch, seq, dim, requires_grad=True)
    return block, (x, cos, sin)


class _RngStatesTaken:
    """The RNG states torch.get_rng_state hands out inside the block (the checkpoint saves the
    one it takes until the backward): their bytes are part of what a checkpointed forward holds."""

    def __init__(self, monkeypatch):
        self.states = []
        taken = torch.get_rng_state

        def get_rng_state():
            state = taken()
            self.states.append(state)
            return state

        monkeypatch.setattr(torch, "get_rng_state", get_rng_state)

    def bytes(self) -> int:
        return sum(state.untyped_storage().nbytes() for state in self.states)


def measured_bytes(module, args, policy, monkeypatch=None):
    """What a checkpointed forward holds until its backward: the tensors saved for backward and
    the kept outputs (sac_plugin.memory's count), less the storages of the layer's own output
    (the caller holds those anyway), plus the RNG state the checkpoint saved (with monkeypatch)."""
    rng = _RngStatesTaken(monkeypatch) if monkeypatch is not None else None
    with track_activation_memory(module.parameters()) as memory:
        out = checkpoint(module, *args, use_reentrant=False, context_fn=sac_plugin.context_fn(policy))
        returned = {out.untyped_storage().data_ptr()}
        memory._parameter_storages |= returned
        held = memory.bytes()
    if rng is not None:
        monkeypatch.undo()
        held += rng.bytes()
    out.sum().backward()
    return held


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "moe"])
@pytest.mark.parametrize("budget", [0.1, 0.3, 0.6])
def test_plan_policy_gives_bitwise_gradients_and_keeps_exactly_the_planned_calls(moe, budget):
    block, (x, cos, sin) = llama_inputs(moe=moe)
    plan = sac_plugin.plan(block, x, cos, sin, budget=budget, runs=2)
    assert plan.held_bytes <= plan.budget_bytes
    assert all(p.grad is None for p in block.parameters()) and x.grad is None
    reference = copy.deepcopy(block)
    sac_plugin.apply_selective_checkpointing(block, plan.policy)
    xa, xb = (x.detach().clone().requires_grad_() for _ in range(2))
    with sac_plugin.audit() as audit:
        loss = block(xa, cos, sin).pow(2).sum()
        loss.backward()
    ref_loss = reference(xb, cos, sin).pow(2).sum()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert torch.equal(xa.grad, xb.grad)
    for (name, p), r in zip(block.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad), name
    planned = {}
    for op, _ in plan.kept:
        planned[op] = planned.get(op, 0) + 1
    assert planned, "a budget above the floor keeps something"
    for op, count in planned.items():
        assert audit.hits(op) == count, op
    assert sum(row.hits for row in audit.rows()) == len(plan.kept)


@pytest.mark.native_engine(
    "track_activation_memory counts the native engine's regions, which hold exactly the planned outputs"
)
@pytest.mark.parametrize("moe", [False, True], ids=["llama", "moe"])
def test_measured_bytes_are_the_predicted_bytes(moe, monkeypatch):
    block, args = llama_inputs(moe=moe)
    profiled = sac_plugin.plan(block, *args, budget=1.0, runs=1)
    for budget in (0.0, 0.2, 0.5, 1.0):
        plan = profiled.with_budget(budget)  # 0.0: below the floor, full recompute
        held = measured_bytes(block, args, plan.policy, monkeypatch)
        assert held == plan.held_bytes, budget
        assert held <= max(plan.budget_bytes, plan.profile.full_recompute_bytes), budget


# --- a plan serves exactly its kept calls, at the bytes it predicts ----------------------------------

BUDGETS = tuple(round(0.1 * i, 1) for i in range(1, 11))


def docs_layer():
    """The planning example of docs/memory-budget.md."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
    return layer, (torch.randn(2, 32, 64, requires_grad=True),)


@pytest.mark.parametrize("model", ["docs", "llama"])
def test_every_plan_serves_exactly_its_kept_calls(model):
    """At every budget: the audit counts one hit per kept call, op by op (F.linear on a 3-D input
    writes its bias into its mm's output in place: that mm is served from a copy)."""
    layer, args = docs_layer() if model == "docs" else llama_inputs()
    plan = sac_plugin.plan(layer, *args, budget=1.0, runs=1)
    for budget in BUDGETS:
        budgeted = plan.with_budget(budget)
        checkpointed = sac_plugin.apply_selective_checkpointing(copy.deepcopy(layer), budgeted.policy)
        inputs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        with sac_plugin.audit() as audit:
            checkpointed(*inputs).sum().backward()
        planned = {}
        for op, _ in budgeted.kept:
            planned[op] = planned.get(op, 0) + 1
        assert {op: audit.hits(op) for op in planned} == planned, budget
        assert sum(row.hits for row in audit.rows()) == len(budgeted.kept), budget


@pytest.mark.native_engine(
    "track_activation_memory counts the native engine's regions, which hold exactly the planned outputs"
)
def test_the_docs_example_holds_the_predicted_bytes_at_every_budget(monkeypatch):
    layer, args = docs_layer()
    plan = sac_plugin.plan(layer, *args, budget=1.0, runs=1)
    for budget in (0.0, *BUDGETS):
        budgeted = plan.with_budget(budget)
        assert measured_bytes(layer, args, budgeted.policy, monkeypatch) == budgeted.held_bytes, budget


def test_the_profile_prices_calls_as_the_runtime_holds_them(monkeypatch):
    """The mm F.linear writes its bias into is offered at its whole output, which the runtime
    copies before the write; the last layer norm, whose output is the layer's, costs only its
    mean and rstd; the floor counts the RNG state the checkpoint saves (measured here as the
    checkpoint takes it)."""
    layer, args = docs_layer()
    plan = sac_plugin.plan(layer, *args, budget=0.3, runs=1)
    calls = {(c.op, c.index): c for c in plan.profile.calls}
    assert calls["aten::mm", 0].why_not_keepable == ""
    assert calls["aten::mm", 0].bytes == 2 * 32 * 3 * 64 * 4  # the attention.s packed q, k, v projection
    output_bytes = layer(*args).untyped_storage().nbytes()
    first, last = calls["aten::native_layer_norm", 0], calls["aten::native_layer_norm", 1]
    assert first.bytes - last.bytes == output_bytes
    rng = _RngStatesTaken(monkeypatch)
    with track_activation_memory(layer.parameters()) as memory:
        out = checkpoint(layer, *args, use_reentrant=False, context_fn=sac_plugin.context_fn(Policy()))
        saved = memory.bytes()
    monkeypatch.undo()
    out.sum().backward()
    assert len(rng.states) == 1 and rng.bytes() > 0
    assert plan.profile.rng_state_bytes == rng.bytes()
    assert plan.profile.full_recompute_bytes == saved + rng.bytes()


def test_a_policy_keeping_a_call_the_forward_writes_is_predicted_to_hold_its_copy(monkeypatch):
    """Plan.evaluate prices a hand-written policy as the runtime runs it: the mm F.linear writes its
    bias into is kept from before the write (NOTE: [Kept outputs written in the forward]), so it
    holds its whole output and is served once, by either engine."""
    layer, args = docs_layer()
    plan = sac_plugin.plan(layer, *args, budget=0.3, runs=1)
    policy = Policy(kept_calls={"aten::mm.default": [0]})
    assert plan.calls_kept_by(policy) == {("aten::mm", 0)}
    predicted = plan.evaluate(policy)
    mm_bytes = {(c.op, c.index): c.bytes for c in plan.profile.calls}["aten::mm", 0]
    assert predicted["held_bytes"] == plan.profile.full_recompute_bytes + mm_bytes
    if sac_plugin.engine() == "native":  # track_activation_memory counts the native engine's regions
        assert measured_bytes(layer, args, policy, monkeypatch) == predicted["held_bytes"]
    checkpointed = sac_plugin.apply_selective_checkpointing(copy.deepcopy(layer), policy)
    with sac_plugin.audit() as audit:
        checkpointed(*args).sum().backward()
    assert audit.hits("aten::mm") == 1


@pytest.mark.slow
def test_the_docs_example_predicts_the_allocators_bytes():
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    rows = run_accelerator_program("planned_bytes.py")["rows"]
    for budget, predicted, allocated, kept, hits in rows:
        assert (allocated, hits) == (predicted, kept), budget
    assert len({predicted for _, predicted, *_ in rows}) > 5


@examples(25, shrink=False)
@given(steps=steps_strategy, budget=st.one_of(st.floats(0.0, 1.0), st.integers(0, 1 << 20)))
def test_plan_never_exceeds_its_budget_on_random_layers(steps, budget):
    """Over random layers of the property suite's ops and random budgets (fractions and bytes,
    up to far above the layer's own bytes): what the plan predicts and what its policy measurably
    holds stay within the budget, or at the floor (full recompute's bytes) when the budget is below
    it, never above what the layer holds without checkpointing; and the plan's policy gives the
    unmodified layer's gradients bitwise."""
    torch.manual_seed(0)
    weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(DIM, DIM) * 0.5) for _ in range(3))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = weights

        def forward(self, h):
            return run_steps(steps, h, list(self.weights), dropout=False)

    layer = Layer()
    x = torch.randn(4, DIM, requires_grad=True)
    # Profiled within a budget above the floor (2**30 bytes), then planned for `budget`, which
    # may be below it: that plan is full recompute.
    plan = sac_plugin.plan(layer, x, budget=2**30, runs=1, warmup=0).with_budget(budget)
    limit = max(plan.budget_bytes, plan.profile.full_recompute_bytes)
    assert plan.held_bytes <= limit
    assert plan.held_bytes <= max(plan.profile.no_checkpoint_bytes, plan.profile.full_recompute_bytes)
    if sac_plugin.engine() == "native":
        assert measured_bytes(layer, (x,), plan.policy) <= limit
    reference = copy.deepcopy(layer)
    checkpointed = sac_plugin.apply_selective_checkpointing(copy.deepcopy(layer), plan.policy)
    grads = []
    for module in (reference, checkpointed):
        inputs = x.detach().clone().requires_grad_()
        torch.manual_seed(1)
        module(inputs).square().sum().backward()
        grads.append([inputs.grad, *(p.grad for p in module.parameters())])
    for expected, got in zip(*grads):
        assert (expected is None and got is None) or torch.equal(expected, got)


@examples(200)
@given(items=st.lists(st.tuples(st.integers(1, 64), st.floats(0.0, 10.0)), max_size=9), capacity=st.integers(0, 300))
def test_knapsack_is_optimal_and_within_capacity(items, capacity):
    weights = [w * 4096 for w, _ in items]
    values = [v for _, v in items]
    chosen = knapsack.solve(weights, values, capacity * 4096)
    assert sum(weights[i] for i in chosen) <= capacity * 4096
    best = max(
        (
            sum(values[i] for i in subset)
            for r in range(len(items) + 1)
            for subset in itertools.combinations(range(len(items)), r)
            if sum(weights[i] for i in subset) <= capacity * 4096
        ),
        default=0.0,
    )
    assert math.isclose(sum(values[i] for i in chosen), best, rel_tol=1e-9, abs_tol=1e-12)


def test_knapsack_on_a_coarse_grid_never_overshoots():
    """Capacities beyond the exact grid round weights up: possibly less value, never more bytes."""
    weights = [3 * 2**20 + 7 * i + 1 for i in range(40)]
    values = [float(i % 7 + 1) for i in range(40)]
    capacity = 50 * 2**20 + 13
    solver = knapsack.Knapsack(weights, values, capacity)
    assert solver.grid > 1
    chosen = solver.solve(capacity)
    assert chosen and sum(weights[i] for i in chosen) <= capacity


def test_profiling_changes_no_result_and_plan_leaves_no_trace():
    block, (x, cos, sin) = llama_inputs()
    rng = torch.get_rng_state()
    buffers = [b.clone() for b in block.buffers()]
    sac_plugin.plan(block, x, cos, sin, budget=0.3, runs=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in block.parameters()) and x.grad is None
    assert all(torch.equal(a, b) for a, b in zip(block.buffers(), buffers))
    # A forward inside a profiling region computes what a plain forward computes, bitwise.
    profile = _native.C.CallProfile()
    profile.begin_run()
    with _scopes.profiling_region_forward(profile):
        profiled = block(x, cos, sin)
    profile.end_run()
    profiled.pow(2).sum().backward()
    profiled_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    plain = block(x, cos, sin)
    plain.pow(2).sum().backward()
    assert torch.equal(profiled, plain)
    assert all(torch.equal(a, p.grad) for a, p in zip(profiled_grads, block.parameters()))


def test_profile_counts_bytes_by_unique_storage():
    def layer(a):
        b = a * 2  # new storage: 4 * 8 * 4 bytes
        c = b.view(8, 4)  # a view: 0, not keepable
        d, e = torch.split(c, 4)  # views of b
        f = torch.cat([d, e])  # new storage: 128 bytes
        return torch.tanh(f.add_(1))  # add_: in place, 0, mutates; tanh saves its output

    class Layer(torch.nn.Module):
        def forward(self, a):
            return layer(a)

    class SavesNothing(torch.nn.Module):
        def forward(self, a):
            return (a + 1).sum()  # autograd saves nothing: a recompute would stop before any call

    # Budgets in bytes above what these small layers hold (their floor, with the RNG state the
    # checkpoint saves, is above what they hold without checkpointing): only their profiles are read.
    nothing = sac_plugin.plan(SavesNothing(), torch.randn(4, 8, requires_grad=True), budget=2**30, runs=1)
    assert [(c.op, c.why_not_keepable, c.recomputed) for c in nothing.profile.calls] == [
        ("aten::add.Tensor", "after the recompute stops", False),
        ("aten::sum", "after the recompute stops", False),
    ]
    assert nothing.kept == frozenset() and nothing.recompute_seconds == 0

    plan = sac_plugin.plan(Layer(), torch.randn(4, 8, requires_grad=True), budget=2**30, runs=2)
    calls = {(c.op, c.index): c for c in plan.profile.calls}
    assert (calls[("aten::mul.Tensor", 0)].bytes, calls[("aten::mul.Tensor", 0)].why_not_keepable) == (128, "")
    assert (calls[("aten::view", 0)].bytes, calls[("aten::view", 0)].why_not_keepable) == (0, "view")
    assert calls[("aten::cat", 0)].bytes == 128
    assert calls[("aten::add_.Tensor", 0)].why_not_keepable == "mutates an input"
    assert all(c.recomputed for c in plan.profile.calls)
    assert all(c.recomputed for c in plan.profile.calls)


def test_save_and_load_give_the_same_plan(tmp_path):
    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=0.4, runs=1)
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.kept == plan.kept
    assert loaded.policy == plan.policy
    assert (loaded.held_bytes, loaded.budget, loaded.profile) == (plan.held_bytes, plan.budget, plan.profile)
    assert loaded.table() == plan.table()


@pytest.mark.parametrize(
    "budget, error, message",
    [
        (
            -0.1,
            PlanError,
            "sac_plugin: budget as a fraction must be from 0.0 to 1.0, got -0.1; pass an int or a string with a unit ('512MiB') for bytes",
        ),
        (
            1.5,
            PlanError,
            "sac_plugin: budget as a fraction must be from 0.0 to 1.0, got 1.5; pass an int or a string with a unit ('512MiB') for bytes",
        ),
        (
            float("nan"),
            PlanError,
            "sac_plugin: budget as a fraction must be from 0.0 to 1.0, got nan; pass an int or a string with a unit ('512MiB') for bytes",
        ),
        (-5, PlanError, "sac_plugin: budget as bytes must be an int from 2 to 2**63 - 1, got -5"),
        (2**63, PlanError, f"sac_plugin: budget as bytes must be an int from 2 to 2**63 - 1, got {2**63}"),
        (
            "0.3",
            PlanError,
            "sac_plugin: budget as a string must be bytes with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
            "such as '512MiB' or '1B', got '0.3'; pass a fraction as a float",
        ),
        (
            None,
            TypeError,
            "sac_plugin: budget must be a fraction of the layer's no-checkpointing activation bytes (a float "
            "from 0.0 to 1.0) or bytes (an int >= 2, or a string with a unit such as '512MiB'), got None (NoneType)",
        ),
        (
            True,
            PlanError,
            "sac_plugin: budget=True reads two ways: 1 byte, or the fraction 1.0 of the layer's no-checkpointing "
            "activation bytes; pass a fraction as a float from 0.0 to 1.0 (such as 1.0), or bytes as an int >= 2 "
            "or a string with a unit (such as '1B' or '512MiB')",
        ),
    ],
)
def test_bad_budgets_are_refused_by_name(budget, error, message):
    block, args = llama_inputs()
    with pytest.raises(error) as raised:
        sac_plugin.plan(block, *args, budget=budget)
    assert str(raised.value) == message
    assert all(p.grad is None for p in block.parameters())


def test_a_budget_below_full_recompute_names_the_least_a_plan_holds():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256)
    x = torch.randn(4, 2, 64, requires_grad=True)
    profile = sac_plugin.plan(layer, x, budget=1.0, runs=1).profile
    budget, floor = int(0.1 * profile.no_checkpoint_bytes), profile.full_recompute_bytes
    assert budget < floor
    with pytest.raises(PlanError) as raised:
        sac_plugin.plan(layer, x, budget=0.1, runs=1)
    assert str(raised.value) == (
        f"sac_plugin: plan: no plan reaches budget=0.1 ({budget} bytes): the least a plan holds is {floor} "
        f"bytes ({floor / 2**20:.2f} MiB), with full recompute (the layer's inputs and the RNG state its "
        "checkpoint saves)"
    )
    assert raised.value.lowest_bytes == floor
    with pytest.raises(PlanError, match=f"^sac_plugin: plan: no plan reaches budget={floor - 1} "):
        sac_plugin.plan(layer, x, budget=floor - 1, runs=1)
    assert sac_plugin.plan(layer, x, budget=floor, runs=1).held_bytes == floor
    assert all(p.grad is None for p in layer.parameters()) and x.grad is None


def _edit(data, **changes):
    data = copy.deepcopy(data)
    for key, value in changes.items():
        data[key] = value
    return data


def _without(data, key):
    return {k: v for k, v in data.items() if k != key}


def test_bad_plan_files_are_refused_by_name(tmp_path):
    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=0.3, runs=1)
    good = plan.to_dict()
    not_keepable = next(c for c in good["calls"] if c["not_keepable"])
    cases = [
        ("[]", "expected a JSON object, got list"),
        ("{", "not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        (
            json.dumps(_edit(good, format="other")),
            "'format' must be 'sac_plugin.plan', got 'other': not a sac_plugin plan",
        ),
        (json.dumps(_edit(good, version=5)), "version 5 is not supported; this sac_plugin reads versions 1, 2, 3, 4"),
        (
            json.dumps(_edit(good, version=True)),
            "version True is not supported; this sac_plugin reads versions 1, 2, 3, 4",
        ),
        (
            json.dumps(_edit(good, budget=2.0)),
            "budget as a fraction must be from 0.0 to 1.0, got 2.0; pass an int or a string with a unit ('512MiB') for bytes",
        ),
        (json.dumps(_edit(good, kept=[["aten::mm", 999]])), "kept[0] = ['aten::mm', 999] is not a profiled call"),
        (
            json.dumps(_edit(good, kept=[[not_keepable["op"], not_keepable["index"]]])),
            f"kept[0] = {[not_keepable['op'], not_keepable['index']]!r} cannot be kept: {not_keepable['not_keepable']}",
        ),
        (
            json.dumps(_edit(good, extra=1)),
            "unknown key 'extra'; known keys in version 4: budget, calls, format, "
            "full_recompute_bytes, kept, no_checkpoint_bytes, offload, offloaded, "
            "rng_state_bytes, runs, torch, version",
        ),
        (
            json.dumps(_edit(good, version=2)),
            "unknown key 'rng_state_bytes'; known keys in version 2: budget, calls, "
            "format, full_recompute_bytes, kept, no_checkpoint_bytes, offload, "
            "offloaded, runs, torch, version",
        ),
        (
            json.dumps({k: v for k, v in _edit(good, version=1).items() if k != "rng_state_bytes"}),
            "unknown key 'offload'; known keys in version 1: budget, calls, format, full_recompute_bytes, kept, "
            "no_checkpoint_bytes, runs, torch, version",
        ),
        (
            json.dumps(_edit(good, offloaded=[good["kept"][0]])),
            "'offloaded' lists calls but 'offload' is null: an offloaded call needs the offload model",
        ),
    ]
    path = tmp_path / "plan.json"
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(PlanError) as raised:
            Plan.load(path)
        assert str(raised.value) == f"sac_plugin: plan file {path}: {message}"
    over = _edit(good, budget=0, kept=good["kept"])
    path.write_text(json.dumps(over))
    with pytest.raises(PlanError, match=r"so it holds \d+, over its budget of 0 bytes"):
        Plan.load(path)


def _nested(depth: int):
    value = ["aten::mm", 0]
    for _ in range(depth):
        value = [value]
    return value


def _malformed_plan_files(good):
    """(file text, the message after "plan file PATH: ") for files malformed in nesting, size
    and type, field by field."""
    call = good["calls"][0]
    huge = 10**400

    def with_call(**changes):
        return json.dumps(_edit(good, calls=[_edit(call, **changes), *good["calls"][1:]]))

    offload = {"d2h_bytes_per_s": 1e9, "h2d_bytes_per_s": 1e9, "min_bytes": 0, "host_memory_limit": None}
    return [
        (
            "[" * 100_000 + "]" * 100_000,
            "not valid JSON for a plan: nested too deeply to read (a plan file nests 3 "
            "levels: the plan, its lists, their entries)",
        ),
        (
            json.dumps(_edit(good, kept=[])).replace('"kept": []', '"kept": ' + "[" * 100_000 + "]" * 100_000),
            "not valid JSON for a plan: nested too deeply to read (a plan file nests 3 levels: the plan, its lists, "
            "their entries)",
        ),
        (
            json.dumps(_edit(good, kept=[_nested(500)])),
            f"kept[0] must be an [op, index] pair (a string and an int from 0 to 2**63 - 1), got "
            f"{bounded_repr(_nested(500))}",
        ),
        (
            json.dumps(_edit(good, runs=0)).replace('"runs": 0', '"runs": 1' + "0" * 5000),
            "not valid JSON for a plan: Exceeds the limit (4300 digits) for integer string conversion: value has 5001 "
            "digits; use sys.set_int_max_str_digits() to increase the limit",
        ),
        (with_call(bytes=2**64), "calls[0].bytes must be an int from 0 to 2**63 - 1, got 18446744073709551616"),
        (with_call(index=-1), "calls[0].index must be an int from 0 to 2**63 - 1, got -1"),
        (with_call(seconds=huge), f"calls[0].seconds must be a finite number >= 0, got {bounded_repr(huge)}"),
        (with_call(seconds="1"), "calls[0].seconds must be a finite number >= 0, got '1'"),
        (with_call(recomputed=1), "calls[0].recomputed must be true or false, got 1"),
        (with_call(op=["aten::mm"]), "calls[0].op must be a string, got ['aten::mm']"),
        (
            json.dumps(_edit(good, calls=[{k: v for k, v in call.items() if k != "bytes"}])),
            "missing key 'bytes' in calls[0]",
        ),
        (
            json.dumps(_edit(good, calls=[_edit(call, size=1)])),
            "unknown key 'size' in calls[0]; known keys in version 4: bytes, index, not_keepable, op, recomputed, "
            "seconds, unit, units",
        ),
        (json.dumps(_edit(good, calls=[5])), "calls[0] must be an object, got 5"),
        (json.dumps(_edit(good, calls={})), "calls must be a list, got {}"),
        (json.dumps(_edit(good, runs="2")), "runs must be an int from 0 to 2**63 - 1, got '2'"),
        (
            json.dumps(_edit(good, full_recompute_bytes=huge)),
            f"full_recompute_bytes must be an int from 0 to 2**63 - 1, got {bounded_repr(huge)}",
        ),
        (
            json.dumps(_edit(good, rng_state_bytes=good["full_recompute_bytes"] + 1)),
            f"rng_state_bytes ({good['full_recompute_bytes'] + 1}) is part of full_recompute_bytes "
            f"({good['full_recompute_bytes']}), so it cannot be larger",
        ),
        (
            json.dumps(_edit(good, budget="0.3")),
            "budget must be a fraction (a float from 0.0 to 1.0) or a byte count (an int >= 0), got '0.3'",
        ),
        (
            json.dumps(_edit(good, budget=1e300)).replace("1e+300", "1e400"),
            "budget as a fraction must be from 0.0 to 1.0, got inf; pass an int or a string with a unit ('512MiB') for bytes",
        ),
        (
            json.dumps(_edit(good, kept=[[1, 2]])),
            "kept[0] must be an [op, index] pair (a string and an int from 0 to 2**63 - 1), got [1, 2]",
        ),
        (
            json.dumps(_edit(good, kept=[["aten::mm", 2**70]])),
            f"kept[0] must be an [op, index] pair (a string and an int from 0 to 2**63 - 1), got ['aten::mm', {2**70}]",
        ),
        (json.dumps(_edit(good, offload=3)), "offload must be null or an object, got 3"),
        (
            json.dumps(_edit(good, offload=_edit(offload, d2h_bytes_per_s=-1))),
            "offload.d2h_bytes_per_s must be a finite number of bytes per second > 0, got -1",
        ),
        (
            json.dumps(_edit(good, offload=_edit(offload, h2d_bytes_per_s=huge))),
            f"offload.h2d_bytes_per_s must be a finite number of bytes per second > 0, got {bounded_repr(huge)}",
        ),
        (
            json.dumps(_edit(good, offload=_edit(offload, host_memory_limit=2**63))),
            f"offload.host_memory_limit must be null or an int from 0 to 2**63 - 1, got {2**63}",
        ),
        (json.dumps(_edit(good, offload={"d2h_bytes_per_s": 1e9})), "missing key 'h2d_bytes_per_s' in offload"),
        (json.dumps(_edit(good, torch=2)), "torch must be a string, got 2"),
    ]


def test_malformed_plan_files_are_plan_errors_naming_the_field(tmp_path):
    """Nesting deeper than the JSON parser recurses, numbers too large for int64 or a float, and
    values of the wrong type: each is a PlanError with the field, what it holds and what it
    accepts; none escapes as another exception."""
    block, args = llama_inputs()
    good = sac_plugin.plan(block, *args, budget=0.3, runs=1).to_dict()
    path = tmp_path / "plan.json"
    for text, message in _malformed_plan_files(good):
        path.write_text(text)
        with pytest.raises(PlanError) as raised:
            Plan.load(path)
        assert str(raised.value) == f"sac_plugin: plan file {path}: {message}"


def test_plan_files_of_earlier_versions_load_with_no_rng_state(tmp_path):
    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=0.3, runs=1)
    data = plan.to_dict()
    assert data["version"] == 4 and data["rng_state_bytes"] == plan.profile.rng_state_bytes > 0
    del data["rng_state_bytes"]
    old = Plan.from_dict(_edit(data, version=2, calls=[_without(c, "units") for c in data["calls"]]))
    assert old.profile.rng_state_bytes == 0
    assert old.kept == plan.kept and old.held_bytes == plan.held_bytes


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    import builtins

    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=0.3, runs=1)
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError) as raised:
        plan.plot(tmp_path / "plan.png")
    assert str(raised.value) == (
        "sac_plugin: Plan.plot needs matplotlib, which is not installed; install the extra: "
        "pip install 'sac_plugin[plot]' (or pip install matplotlib)"
    )


def test_pareto_is_monotone_and_within_each_budget():
    block, args = llama_inputs(moe=True)
    plan = sac_plugin.plan(block, *args, budget=0.3, runs=1)
    points = plan.pareto()
    assert [p["budget"] for p in points] == [i / 20 for i in range(21)]
    for p in points:
        assert p["held_bytes"] <= max(p["budget_bytes"], plan.profile.full_recompute_bytes)
    times = [p["recompute_seconds"] for p in points]
    assert all(a >= b - 1e-12 for a, b in zip(times, times[1:]))
    assert points[0]["kept_bytes"] == 0


def test_plot_keeps_coinciding_policies_visible(tmp_path, monkeypatch):
    # Two policies at one point (the units policy of a layer that opens no units keeps what
    # "attention kept" keeps): different hollow markers, the first larger and drawn on top.
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from sac_plugin.planner._reference import reference_policies

    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=0.3, runs=1)
    same = reference_policies()["attention kept"]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plan.plot(tmp_path / "plan.png", policies={"attention kept": same, "units": same})
    axes = figures[0].axes[0]
    dots = {c.get_label(): c for c in axes.collections}
    first, second = dots["attention kept"], dots["units"]
    assert list(first.get_offsets()[0]) == list(second.get_offsets()[0])
    assert first.get_sizes()[0] > second.get_sizes()[0] and first.get_zorder() > second.get_zorder()
    assert len(first.get_facecolors()) == 0 or first.get_facecolors()[0][3] == 0  # hollow: the other shows through


# --- a budget across a model ---------------------------------------------------------------------


def _train_pair(model, reference, tokens, targets):
    loss = model.loss(tokens, targets)
    loss.backward()
    ref = reference.loss(tokens, targets)
    ref.backward()
    assert torch.equal(loss, ref)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad), name


def _model():
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, heads=4, layers=3, seq=16)
    tokens = torch.randint(0, 64, (2, 16))
    return model, copy.deepcopy(model), tokens, torch.randint(0, 64, (2, 16))


def test_budget_from_an_example_batch_plans_identical_layers_once(caplog):
    model, reference, tokens, targets = _model()
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(budget=0.3), example_inputs=(tokens,))
    messages = [r.getMessage() for r in caplog.records if r.name == "sac_plugin"]
    assert [m.split(":")[1].strip() for m in messages[:3]] == [
        "layer 0 (LlamaBlock)",
        "layer 1 (LlamaBlock)",
        "layer 2 (LlamaBlock)",
    ]
    assert "over 3 layers (1 distinct)" in messages[3]
    assert all(layer._sac_policy.kept_calls for layer in model.layers)
    assert all(p.grad is None for p in model.parameters())
    with sac_plugin.audit() as audit:
        _train_pair(model, reference, tokens, targets)
    assert sum(row.hits for row in audit.rows()) == sum(
        sum(len(v) for v in layer._sac_policy.kept_calls.values()) for layer in model.layers
    )


def test_budget_without_an_example_plans_on_the_first_call(caplog):
    model, reference, tokens, targets = _model()
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(budget=0.25))
        _train_pair(model, reference, tokens, targets)
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sac_plugin: planned")]
    assert len(planned) == 1 and planned[0].startswith("sac_plugin: planned LlamaBlock within 0.25: keeps ")
    assert len({layer._sac_policy for layer in model.layers}) == 1
    # Later steps run the planned policy, bitwise as before.
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    _train_pair(model, reference, tokens, targets)


def test_split_saves_at_least_what_an_even_split_saves():
    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=1.0, runs=1)
    for fraction in (0.1, 0.25, 0.5):
        total = int(fraction * 3 * plan.profile.no_checkpoint_bytes)
        chosen = split([plan, plan, plan], total)
        assert sum(p.held_bytes for p in chosen) <= total
        even = plan.with_budget(total // 3)
        saved = sum(p.full_recompute_seconds - p.recompute_seconds for p in chosen)
        assert saved >= 3 * (even.full_recompute_seconds - even.recompute_seconds) - 1e-12


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"budget": 1.5},
            "recompute config: budget as a fraction must be from 0.0 to 1.0, got 1.5; pass an int or a string with a unit ('512MiB') for bytes",
        ),
        (
            {"budget": "lots"},
            "recompute config: budget as a string must be bytes with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, "
            "TiB), such as '512MiB' or '1B', got 'lots'; pass a fraction as a float",
        ),
        (
            {"budget": 1},
            "recompute config: budget=1 reads two ways: 1 byte, or the fraction 1.0 of the layer's "
            "no-checkpointing activation bytes; pass a fraction as a float from 0.0 to 1.0 (such as 1.0), or bytes "
            "as an int >= 2 or a string with a unit (such as '1B' or '512MiB')",
        ),
        (
            {"budget": 0.3, "kept_units": ["attn"], "every_nth_op": {"aten::mm": 2}},
            "recompute config: budget chooses what to keep by measurement; leave kept_units, every_nth_op unset (or "
            "drop budget to choose by hand)",
        ),
    ],
)
def test_bad_budget_configs_are_named(data, message):
    with pytest.raises(ConfigError) as raised:
        RecomputeConfig.from_dict(data)
    assert str(raised.value) == message


def test_budget_config_round_trips():
    config = RecomputeConfig(budget=0.3, every_nth_layer=2)
    assert RecomputeConfig.from_json(config.to_json()) == config
    assert RecomputeConfig.from_dict({"budget": 4096}).budget == 4096


def test_example_inputs_without_a_budget_are_refused():
    model, _, tokens, _ = _model()
    with pytest.raises(ConfigError, match="example_inputs are for planning a budget; the config sets no budget"):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]), example_inputs=(tokens,))
    assert not any("_sac_policy" in layer.__dict__ for layer in model.layers)


def test_cli_prints_the_table_and_the_curve(capsys, tmp_path):
    assert (
        main(
            [
                "plan",
                "--model",
                "moe",
                "--budget",
                "0.3",
                "--dim",
                "32",
                "--seq",
                "16",
                "--runs",
                "1",
                "--save",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("moe layer: dim 32, heads 4, seq 16, batch 2, cpu\nPlan(budget=0.3: ")
    assert "Pareto curve (budget: fraction of no-checkpointing bytes):" in out
    assert sac_plugin.Plan.load(tmp_path / "plan.json").budget == 0.3


def test_cli_plans_three_ways_with_given_bandwidths(capsys, tmp_path):
    assert (
        main(
            [
                "plan",
                "--model",
                "llama",
                "--budget",
                "0.1",
                "--dim",
                "32",
                "--seq",
                "16",
                "--runs",
                "1",
                "--offload",
                "--offload-bandwidth",
                "1e12",
                "2e12",
                "--save",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    plan = sac_plugin.Plan.load(tmp_path / "plan.json")
    assert plan.offload is not None
    assert "policy: Policy(" in capsys.readouterr().out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--offload-bandwidth", "1e9", "1e9"], "--offload-bandwidth and --host-memory-limit need --offload"),
        (
            ["--offload", "--offload-bandwidth", "0", "1e9"],
            "argument --offload-bandwidth: bytes per second, a number > 0, got '0'",
        ),
        (
            ["--offload", "--host-memory-limit", "-5"],
            "argument --host-memory-limit: a byte count, an int >= 0, got '-5'",
        ),
    ],
)
def test_cli_offload_arguments_are_checked(arguments, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "llama", *arguments])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    assert (
        main(
            [
                "plan",
                "--model",
                "llama",
                "--dim",
                "32",
                "--seq",
                "16",
                "--runs",
                "1",
                "--plot",
                str(tmp_path / "plan.png"),
            ]
        )
        == 0
    )
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- planning under any grad mode, never above no checkpointing, only finite files -------------


def _block():
    from sac_plugin.models import LlamaBlock, rotary_tables

    torch.manual_seed(0)
    block = LlamaBlock(64, 4)
    cos, sin = rotary_tables(16, 16)
    return block, (torch.randn(2, 16, 64, requires_grad=True), cos, sin)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_plan_made_under_no_grad_or_inference_mode_measures_with_grad(mode):
    block, (_, cos, sin) = _block()
    expected = sac_plugin.plan(block, torch.randn(2, 16, 64), cos, sin, budget=0.3, runs=1)
    with getattr(torch, mode)():
        planned = sac_plugin.plan(block, torch.randn(2, 16, 64), cos, sin, budget=0.3, runs=1)
    assert planned.profile.no_checkpoint_bytes == expected.profile.no_checkpoint_bytes > 0
    assert [(c.op, c.index, c.bytes) for c in planned.profile.calls] == [
        (c.op, c.index, c.bytes) for c in expected.profile.calls
    ]
    assert planned.kept and planned.held_bytes <= planned.budget_bytes


@pytest.mark.parametrize("budget", [1.0, 10**12])
def test_no_plan_holds_more_than_no_checkpointing(budget):
    block, inputs = _block()
    planned = sac_plugin.plan(block, *inputs, budget=budget, runs=1)
    assert planned.held_bytes <= planned.profile.no_checkpoint_bytes
    for point in planned.pareto(budgets=(0.5, 1.0)):
        assert point["held_bytes"] <= planned.profile.no_checkpoint_bytes
    assert planned.with_budget(10**12).held_bytes <= planned.profile.no_checkpoint_bytes


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_a_plan_file_with_non_finite_seconds_is_a_plan_error_naming_the_field(tmp_path, bad):
    block, inputs = _block()
    path = sac_plugin.plan(block, *inputs, budget=0.3, runs=1).save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    data["calls"][2]["seconds"] = "__BAD__"
    path.write_text(json.dumps(data).replace('"__BAD__"', bad))
    with pytest.raises(
        sac_plugin.PlanError,
        match=r"calls\[2\]\.seconds must be a finite number >= 0, "
        r"got -?(nan|inf)",
    ):
        sac_plugin.Plan.load(path)


# --- a budget planned on the first call never leaves a layer unchecked --------------------------


def _budgeted_llama():
    from sac_plugin.models import Llama

    torch.manual_seed(0)
    model = Llama(layers=2)
    reference = copy.deepcopy(model)
    sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(budget=0.3))
    return model, reference


def _assert_full_recompute_with_one_warning(model, record, reason):
    messages = [str(w.message) for w in record if "could not be planned" in str(w.message)]
    assert len(messages) == 1, messages
    assert reason in messages[0]
    for layer in model.layers:
        assert type(vars(layer)["forward"]).__name__ == "CheckpointedForward"
        assert layer._sac_policy == Policy()


def test_a_layer_first_called_inside_another_checkpoint_falls_back_to_full_recompute():
    model, reference = _budgeted_llama()
    tokens = torch.randint(0, 512, (2, 16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.utils.checkpoint.checkpoint(model, tokens, use_reentrant=False).sum().backward()
    _assert_full_recompute_with_one_warning(model, record, "inside another checkpointed region")
    reference(tokens).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_layer_first_called_under_torch_compile_falls_back_to_full_recompute():
    model, reference = _budgeted_llama()
    tokens = torch.randint(0, 512, (2, 16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(tokens).sum().backward()
    _assert_full_recompute_with_one_warning(model, record, "while torch.compile traces it")


class _ChangingLayer(nn.Module):
    """Makes different calls on every call: profiling it cannot settle on one set of calls."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.linear(x)
        return torch.tanh(y) if self.calls % 2 else torch.sigmoid(y)


class _ChangingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_ChangingLayer()])

    def recompute_wrap_sites(self):
        return list(self.layers)

    def forward(self, x):
        return self.layers[0](x)


def test_a_layer_whose_profiling_raises_falls_back_to_full_recompute():
    torch.manual_seed(0)
    model = _ChangingModel()
    sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(budget=0.5))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    _assert_full_recompute_with_one_warning(model, record, "profiling it raised")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--dim", "30", "--heads", "4"], "--dim 30 must be a multiple of --heads 4 (each head gets dim / heads)"),
        (["--dim", "12", "--heads", "4"], "--dim / --heads must be even (rotary embeddings rotate pairs), got 3"),
        (["--batch", "-1"], "argument --batch: an int >= 1, got -1"),
        (["--seq", "x"], "argument --seq: an int >= 1, got 'x'"),
        (["--device", "not-a-device"], "--device 'not-a-device' is not a device (cpu, cuda, cuda:1, ...)"),
        (
            ["--save", "/nonexistent-folder/plan.json"],
            "--save '/nonexistent-folder/plan.json': the folder /nonexistent-folder does not exist",
        ),
        (["--plot", "/nonexistent-folder/plan.png"], "the folder /nonexistent-folder does not exist"),
    ],
)
def test_the_plan_command_checks_its_arguments_before_profiling(arguments, message, capsys):
    from sac_plugin.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "llama", *arguments])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a torch without CUDA")
def test_the_plan_command_refuses_a_device_this_torch_lacks(capsys):
    from sac_plugin.__main__ import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama", "--device", "cuda"])
    assert f"--device cuda: this torch ({torch.__version__}) has no cuda device available" in capsys.readouterr().err


def test_a_plan_that_keeps_anything_counts_the_routing_its_policy_serves():
    # Under a policy that selects anything the rule serves the router's top-k and the sort that
    # groups tokens by expert (docs/semantics.md): a plan counts them among its kept calls.
    block, (x, cos, sin) = llama_inputs(moe=True)
    for budget in (0.1, 0.5):
        plan = sac_plugin.plan(block, x, cos, sin, budget=budget, runs=1)
        assert plan.kept and {("aten::topk", 0), ("aten::sort.stable", 0)} <= plan.kept
        assert plan.held_bytes <= plan.budget_bytes


def test_a_budget_without_room_for_the_routing_calls_keeps_nothing():
    # Keeping anything, even a call that holds no new bytes (it makes the layer's output), holds
    # the routing calls: a budget above the floor but short of them is full recompute.
    from sac_plugin.planner import LayerProfile, ProfiledCall

    calls = (
        ProfiledCall("aten::topk", 0, "", 4096, 1e-3, ""),
        ProfiledCall("aten::mm", 0, "", 8192, 1e-3, ""),
        ProfiledCall("aten::relu", 0, "", 0, 1e-3, ""),
    )
    profile = LayerProfile(calls, 1000 + 12288, 1000, 1)
    for budget, kept in ((1000, set()), (1000 + 4095, set()), (1000 + 4096, {("aten::topk", 0), ("aten::relu", 0)})):
        plan = Plan.from_profile(profile, budget)
        assert (plan.kept, plan.held_bytes) == (kept, 1000 + 4096 * bool(kept)), budget
        assert plan.policy.keeps_nothing == (not kept)
    everything = Plan.from_profile(profile, 1.0)
    assert everything.kept == {("aten::topk", 0), ("aten::mm", 0), ("aten::relu", 0)}
    assert everything.policy == Policy(kept_calls={"aten::mm.default": [0], "aten::relu.default": [0]})


def test_a_plan_below_the_floor_is_full_recompute_and_plan_refuses_it():
    """from_profile and with_budget plan a budget below the floor as full recompute, which holds
    the floor (a keep-flag region's calls recomputed too); plan() refuses it, naming the floor."""
    pytest.importorskip("torch_remat")
    from test_remat_regions import DIM, AnnotatedBlock

    torch.manual_seed(0)
    block, x = AnnotatedBlock(core_recomputes=False), torch.randn(64, DIM)
    profiled = sac_plugin.plan(block, x, budget=1.0, runs=1)
    floor = profiled.profile.full_recompute_bytes
    for below in (profiled.with_budget(0.0), Plan.from_profile(profiled.profile, floor - 1)):
        assert below.policy.keeps_nothing and below.kept == frozenset() and below.held_bytes == floor
        assert below.evaluate(Policy())["held_bytes"] == floor
    with pytest.raises(PlanError) as raised:
        sac_plugin.plan(block, x, budget=floor - 1, runs=1)
    assert raised.value.lowest_bytes == floor
