"""A plan predicts exactly what the runtime does with its policy: for reference layers (a Llama
block, an MoE block that routes tokens, torch's TransformerEncoderLayer, a layer whose forward
writes a kept output in place, and torch_remat-annotated blocks with every combination of region
flags) at several budgets, the calls its policy serves are the plan's kept calls op by op, none is
held and never served, the bytes the runtime keeps are the plan's kept bytes (native engine: the
dispatch-mode engine reports none), and the gradients are the unmodified layer's, bitwise."""

import collections
import copy

import pytest
import sac_plugin
import torch
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import LlamaBlock, MoEBlock, rotary_tables
from torch import nn
from torch.utils._pytree import tree_leaves

remat = pytest.importorskip("torch_remat")

from test_remat_regions import DIM, AnnotatedBlock  # noqa: E402  (needs torch_remat)

pytestmark = pytest.mark.filterwarnings("ignore:sac. .*:UserWarning")

# Fractions of the layer's no-checkpointing bytes, and a byte count above everything it holds:
# that plan keeps every keepable call, keep-flag regions included.
BUDGETS = (0.0, 0.2, 0.4, 0.7, 1.0, 2**30)


class WritesAKeptOutput(nn.Module):
    """A forward that writes a call's output in place after later calls read it: kept, the runtime
    holds a copy from before the write (NOTE: [Kept outputs written in the forward])."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(DIM, DIM) * 0.3)
        self.w2 = nn.Parameter(torch.randn(DIM, DIM) * 0.3)

    def forward(self, x):
        h = x @ self.w1
        a = torch.tanh(h)
        h.mul_(0.5)
        return (a * h) @ self.w2


class RegionBesideAWideMlp(nn.Module):
    """A torch_remat region small beside what the layer holds without checkpointing, so that a
    plan can keep it whole."""

    def __init__(self, core_recomputes: bool):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.w1 = nn.Linear(DIM, 8 * DIM)
        self.w2 = nn.Linear(8 * DIM, DIM)
        self.core_recomputes = core_recomputes

    def core(self, x):
        return torch.tanh(self.wq(x))

    def forward(self, x):
        core = remat.region(self.core, "attn.core", recompute=self.core_recomputes)(x)
        remat.recompute_needs_tensor(core)
        return self.w2(torch.relu(self.w1(x + core)))


def _llama(moe: bool):
    torch.manual_seed(0)
    block = (MoEBlock if moe else LlamaBlock)(32, 4)
    cos, sin = rotary_tables(8, 16)
    return block, (torch.randn(2, 16, 32, requires_grad=True), cos, sin)


def _encoder():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0), (torch.randn(8, 2, 64, requires_grad=True),)


def _writes():
    torch.manual_seed(0)
    return WritesAKeptOutput(), (torch.randn(64, DIM, requires_grad=True),)


def _annotated(core_recomputes: bool, mlp_recomputes: bool):
    def make():
        torch.manual_seed(0)
        block = AnnotatedBlock(core_recomputes=core_recomputes, mlp_recomputes=mlp_recomputes)
        return block, (torch.randn(64, DIM, requires_grad=True),)

    return make


def _beside_a_wide_mlp(core_recomputes: bool):
    def make():
        torch.manual_seed(0)
        return RegionBesideAWideMlp(core_recomputes), (torch.randn(64, DIM, requires_grad=True),)

    return make


LAYERS = {
    "llama": lambda: _llama(moe=False),
    "moe": lambda: _llama(moe=True),
    "encoder": _encoder,
    "writes_a_kept_output": _writes,
    **{
        f"regions_core_{core}_mlp_{mlp}": _annotated(core == "recomputes", mlp == "recomputes")
        for core in ("keeps", "recomputes")
        for mlp in ("keeps", "recomputes")
    },
    "region_beside_a_wide_mlp_keeps": _beside_a_wide_mlp(False),
    "region_beside_a_wide_mlp_recomputes": _beside_a_wide_mlp(True),
}


def _fresh(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) for a in args]


def _gradients(module, args):
    inputs = _fresh(args)
    module(*inputs).square().sum().backward()
    return [a.grad for a in inputs if a.requires_grad] + [p.grad for p in module.parameters()]


def _run(layer, policy, args):
    """One step of `layer` checkpointed with `policy`: the audit, the bytes the runtime keeps for
    the backward less the storages the layer returns (its caller holds them), and the gradients."""
    checkpointed = sac_plugin.apply_selective_checkpointing(copy.deepcopy(layer), policy)
    inputs = _fresh(args)
    with sac_plugin.report() as report, sac_plugin.audit() as audit:
        with track_activation_memory(checkpointed.parameters()) as memory:
            out = checkpointed(*inputs)
            returned = {t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
            kept = {}
            for region in memory._regions:
                for tensor in region.kept_tensors():
                    kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        out.square().sum().backward()
    reported = sum(layer.kept_bytes for layer in report.layers.values())
    if sac_plugin.engine() == "native":
        assert reported == sum(kept.values())
    grads = [a.grad for a in inputs if a.requires_grad] + [p.grad for p in checkpointed.parameters()]
    kept_bytes = sum(nbytes for pointer, nbytes in kept.items() if pointer not in returned)
    return audit, kept_bytes, grads


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_the_plan_is_what_the_runtime_serves_and_holds(name):
    layer, args = LAYERS[name]()
    reference = _gradients(copy.deepcopy(layer), args)
    profiled = sac_plugin.plan(layer, *args, budget=1.0, runs=1)
    for budget in BUDGETS:
        plan = profiled.with_budget(budget)
        assert plan.held_bytes <= max(plan.budget_bytes, plan.profile.full_recompute_bytes), budget
        audit, kept_bytes, grads = _run(layer, plan.policy, args)
        planned = collections.Counter(op for op, _ in plan.kept)
        served = {row.op.removesuffix(".default"): row.hits for row in audit.rows() if row.hits}
        assert served == planned, (budget, plan.policy)
        assert audit.never_served() == 0, budget
        if sac_plugin.engine() == "native":  # the dispatch-mode engine reports no kept bytes
            assert kept_bytes == plan.kept_bytes, (budget, plan.policy)
        for expected, got in zip(reference, grads, strict=True):
            assert torch.equal(expected, got), budget


def test_a_keep_flag_region_is_kept_whole_or_recomputed_whole():
    """A selective plan holds every call of a recompute=False region that no list names, so it
    names the region: in kept_units where it keeps any of its calls (then it holds them all), in
    recomputed_units where it keeps none; the calls after a recomputed region count their index
    without its calls. What the plan holds is what the runtime serves and keeps."""
    layer, args = _beside_a_wide_mlp(False)()
    profiled = sac_plugin.plan(layer, *args, budget=1.0, runs=1)
    region = sac_plugin._rule.RegionOpening("attn.core", False)
    core = {(c.op, c.index) for c in profiled.profile.calls if c.keepable and c.units == (region,)}
    assert core == {("aten::addmm", 0), ("aten::tanh", 0)}
    outside = ("aten::addmm", 1)  # w1's, the first addmm outside the region
    floor = profiled.profile.full_recompute_bytes
    for asked, kept, policy in (
        ({("aten::tanh", 0)}, core, sac_plugin.Policy(kept_units=["attn.core"])),
        (
            {outside},
            {outside},
            sac_plugin.Policy(kept_calls={"aten::addmm.default": [0]}, recomputed_units=["attn.core"]),
        ),
        (set(), set(), sac_plugin.Policy()),
    ):
        plan = sac_plugin.Plan(profiled.profile, 2**30, frozenset(asked))
        assert (plan.kept, plan.policy) == (kept, policy)
        by_key = {(c.op, c.index): c.bytes for c in profiled.profile.calls}
        assert plan.held_bytes == floor + sum(by_key[k] for k in kept)
        audit, kept_bytes, _ = _run(layer, plan.policy, args)
        assert {row.op.removesuffix(".default"): row.hits for row in audit.rows() if row.hits} == dict(
            collections.Counter(op for op, _ in kept)
        )
        if sac_plugin.engine() == "native":
            assert kept_bytes == plan.kept_bytes


@pytest.mark.parametrize(
    "policy",
    [
        sac_plugin.Policy(kept_ops=["aten::relu"]),
        sac_plugin.Policy(kept_units=["mlp.ffn"], recomputed_units=["attn.core"]),
        sac_plugin.Policy(every_nth_op={"aten::addmm": 2}, recomputed_units=["attn.core"]),
    ],
    ids=["a_region_follows_its_flag", "the_lists_override_the_flags", "every_nth_counts_outside_recomputed_units"],
)
def test_a_hand_written_policy_is_priced_as_the_runtime_runs_it(policy):
    """Plan.evaluate and calls_kept_by ask the rule with each call's open units and flags."""
    layer, args = _annotated(False, True)()
    profiled = sac_plugin.plan(layer, *args, budget=1.0, runs=1)
    kept = profiled.calls_kept_by(policy)
    audit, kept_bytes, _ = _run(layer, policy, args)
    assert {row.op.removesuffix(".default"): row.hits for row in audit.rows() if row.hits} == dict(
        collections.Counter(op for op, _ in kept)
    )
    if sac_plugin.engine() == "native":
        assert kept_bytes == profiled.evaluate(policy)["kept_bytes"]


def test_a_plan_file_keeps_each_calls_open_units_and_flags():
    layer, args = _annotated(False, False)()
    plan = sac_plugin.plan(layer, *args, budget=0.7, runs=1)
    data = plan.to_dict()
    assert data["calls"][1]["units"] == [["attn.core", False]]
    loaded = sac_plugin.Plan.from_dict(data)
    assert (loaded.profile, loaded.kept, loaded.policy) == (plan.profile, plan.kept, plan.policy)
    data["calls"][1]["unit"] = "mlp.ffn"
    with pytest.raises(sac_plugin.PlanError) as raised:
        sac_plugin.Plan.from_dict(data)
    assert str(raised.value) == (
        "sac_plugin: plan: calls[1].unit is 'mlp.ffn', but the innermost of its units is [['attn.core', False]]"
    )
