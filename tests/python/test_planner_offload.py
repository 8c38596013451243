"""Memory-budget plans with three outcomes per call: keep, offload or recompute. Built on synthetic
profiles with given copy bandwidths: a copy that hides is chosen over a recompute, a recompute
over a copy that cannot hide, copies that each hide alone queue on one stream and are recomputed
where queued they cost more, the host-memory cap and the size floor bind; at every budget the
three-way plan predicts a step no slower than the two-way plan and no faster than the fastest
choice; plans with offloads survive a file round trip; bad offload arguments are refused by name;
on CPU without bandwidths the plan is two-way and says why once; on the simulated device the
predicted exposed copy time is the measured one."""

import copy
import itertools
import logging
import math

import pytest
import sac_plugin
import torch
from sac_plugin import Plan, PlanError, Policy
from sac_plugin.planner import OffloadModel
from sac_plugin.planner._cost import CopyCost, byte_budget
from sac_plugin.planner._profile import LayerProfile, ProfiledCall
from sac_plugin.planner import _knapsack as knapsack, _plan, _plan_offload
from sac_plugin.planner._profile import AFTER_THE_RECOMPUTE_STOPS
from sac_plugin.models import LlamaBlock, rotary_tables

from hypothesis import given, strategies as st
from support.accelerator import SKIP_REASON, run_on_accelerator
from support.random_steps import examples

pytestmark = pytest.mark.filterwarnings("ignore:sac. .*:UserWarning")

MiB = 1 << 20
AFTER = AFTER_THE_RECOMPUTE_STOPS  # a call that gives the copies out before it a window, at no recompute cost
# A call the recompute always runs (no policy keeps it): its kernel time is a window for the copies
# back of the calls after it.
COMPUTE = "not keepable: always recomputed"
LINK = 16 * 2**30  # bytes per second: 8 MiB copies in 2**-11 s each way


def profile_of(*calls, floor=0):
    """A profile of (op, bytes, milliseconds[, why not keepable]) calls in forward order."""
    counts, profiled = {}, []
    for op, size, ms, *why in calls:
        index = counts[op] = counts.get(op, -1) + 1
        reason = why[0] if why else ""
        profiled.append(ProfiledCall(op, index, "", size, ms / 1e3, reason, reason != AFTER))
    return LayerProfile(tuple(profiled), floor + sum(c.bytes for c in profiled), floor, 1)


def two_matmuls():
    """0.75 ms of compute the recompute always runs, then two 8 MiB matmuls of 1 and 10 ms: each
    copy takes 2**-11 s (0.488 ms) each way over LINK."""
    return profile_of(
        ("aten::gelu", 0, 0.75, COMPUTE), ("aten::mm", 8 * MiB, 1.0), ("aten::mm", 8 * MiB, 10.0), floor=MiB
    )


def test_a_copy_that_hides_is_chosen_over_a_recompute():
    plan = Plan.from_profile(two_matmuls(), 9 * MiB, offload=OffloadModel(LINK, LINK))
    assert (plan.kept, plan.offloaded) == ({("aten::mm", 1)}, {("aten::mm", 0)})
    # Out behind the second matmul's 10 ms, back behind the recompute's 0.75 ms before it.
    assert plan.copies[("aten::mm", 0)] == CopyCost(2**-11, 2**-11, 10e-3, 0.75e-3)
    assert plan.copies[("aten::mm", 0)].hides and plan.copy_seconds == 0.0
    assert plan.overhead_seconds == plan.recompute_seconds == 0.75e-3
    assert (plan.held_bytes, plan.offloaded_bytes) == (9 * MiB, 8 * MiB)
    two_way = plan.without_offload()
    assert (two_way.kept, two_way.offloaded, two_way.overhead_seconds) == ({("aten::mm", 1)}, frozenset(), 1.75e-3)


def test_copies_that_each_hide_alone_queue_on_one_stream():
    # With no room on the device both are offloaded. Alone, each copy back hides behind the
    # recompute before it; together they queue on the copy-in stream, both starting when the
    # recompute begins, and the second is ready 2 * 2**-11 s in, 0.227 ms after the recompute
    # (0.75 ms: the first matmul is served, not run) reaches it. Recomputing either costs more.
    nothing_kept = Plan.from_profile(two_matmuls(), MiB, offload=OffloadModel(LINK, LINK))
    assert (nothing_kept.kept, nothing_kept.offloaded) == (frozenset(), {("aten::mm", 0), ("aten::mm", 1)})
    assert [(r["op"], r["index"], r["outcome"], r["copy"].hides) for r in nothing_kept.call_rows()] == [
        ("aten::mm", 0, "offload", True),
        ("aten::mm", 1, "offload", True),
    ]
    assert nothing_kept.copies[("aten::mm", 1)] == CopyCost(2**-11, 2**-11, 0.0, 1.75e-3)
    assert nothing_kept.copy_seconds == pytest.approx(2**-10 - 0.75e-3, rel=1e-12)
    assert nothing_kept.overhead_seconds == pytest.approx(2**-10, rel=1e-12)
    assert nothing_kept.without_offload().overhead_seconds == pytest.approx(11.75e-3, rel=1e-12)


def test_offloads_whose_copies_queue_past_their_recompute_are_recomputed():
    # Each alone hides behind the 0.25 ms before it, but queued, the second and third copies back
    # arrive 0.24 and 0.49 ms after the recompute reaches them, more than their 0.1 ms recomputes.
    calls = [("aten::gelu", 0, 0.25, COMPUTE)] + [("aten::mm", 4 * MiB, 0.1)] * 3 + [("aten::sum", 0, 20.0, AFTER)]
    plan = Plan.from_profile(profile_of(*calls), 0.0, offload=OffloadModel(LINK, LINK))
    assert all(plan.copies[("aten::mm", i)].hides for i in range(3))
    assert len(plan.offloaded) == 1  # any one of them: the others then run beside its copy back
    assert (plan.copy_seconds, plan.overhead_seconds) == (0.0, pytest.approx(0.45e-3, rel=1e-12))
    everything = plan.evaluate(Policy(offloaded_ops=["aten::mm"], offload_min_bytes=0))
    assert everything["overhead_seconds"] == pytest.approx(0.25e-3 + 3 * 2**-12 - 0.25e-3, rel=1e-12)


def test_a_recompute_is_chosen_over_copies_that_cannot_hide():
    profile = profile_of(
        ("aten::gelu", 0, 0.2, COMPUTE), ("aten::mul.Tensor", 8 * MiB, 0.1), ("aten::sum", 0, 0.2, AFTER)
    )
    plan = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK))
    copy = plan.copies[("aten::mul.Tensor", 0)]
    assert copy == CopyCost(2**-11, 2**-11, 0.2e-3, 0.2e-3)
    # The copy out's overrun past the forward delays the copy back.
    assert not copy.hides and copy.exposed == pytest.approx(2 * (2**-11 - 0.2e-3), rel=1e-12)
    assert (plan.kept, plan.offloaded) == (frozenset(), frozenset())
    assert plan.overhead_seconds == pytest.approx(0.3e-3, rel=1e-12)
    assert [r["outcome"] for r in plan.call_rows()] == ["recompute"]
    # Over a link four times as fast the same copies hide behind the 0.2 ms each side.
    fast = Plan.from_profile(profile, 0.0, offload=OffloadModel(4 * LINK, 4 * LINK))
    assert (fast.offloaded, fast.copy_seconds, fast.overhead_seconds) == ({("aten::mul.Tensor", 0)}, 0.0, 0.2e-3)


def test_the_directions_are_priced_with_their_own_bandwidths():
    profile = profile_of(("aten::gelu", 0, 0.5, COMPUTE), ("aten::mm", 8 * MiB, 1.0), ("aten::sum", 0, 0.5, AFTER))
    copy = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK / 4)).copies[("aten::mm", 0)]
    assert (copy.to_host, copy.to_device) == (2**-11, 2**-9)
    assert copy.exposed == pytest.approx(2**-9 - 0.5e-3, rel=1e-12)  # the copy to the host hides


def test_the_host_memory_limit_binds():
    profile = profile_of(
        ("aten::gelu", 0, 1.0, COMPUTE),
        ("aten::mm", 4 * MiB, 3.0),
        ("aten::mm", 4 * MiB, 2.0),
        ("aten::mm", 4 * MiB, 1.0),
        ("aten::sum", 0, 20.0, AFTER),
    )
    unlimited = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK))
    assert (len(unlimited.offloaded), unlimited.copy_seconds, unlimited.overhead_seconds) == (3, 0.0, 1e-3)
    capped = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK, host_memory_limit=8 * MiB))
    assert capped.offloaded == {("aten::mm", 0), ("aten::mm", 1)}  # the two recomputes that cost the most
    assert (capped.offloaded_bytes, capped.overhead_seconds) == (8 * MiB, 2e-3)
    # Room for one call on the device: one is kept, which leaves the host room for both others.
    roomier = capped.with_budget(4 * MiB)
    assert (len(roomier.kept), len(roomier.offloaded), roomier.kept | roomier.offloaded) == (
        1,
        2,
        {("aten::mm", 0), ("aten::mm", 1), ("aten::mm", 2)},
    )
    assert (roomier.held_bytes, roomier.offloaded_bytes, roomier.overhead_seconds) == (4 * MiB, 8 * MiB, 1e-3)
    none_on_the_host = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK, host_memory_limit=0))
    assert (none_on_the_host.offloaded, none_on_the_host.overhead_seconds) == (frozenset(), 7e-3)


def test_calls_under_the_size_floor_are_never_offloaded():
    profile = profile_of(
        ("aten::gelu", 0, 1.0, COMPUTE),
        ("aten::mm", MiB // 2, 1.0),
        ("aten::mm", MiB, 1.0),
        ("aten::sum", 0, 10.0, AFTER),
    )
    plan = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK))
    assert plan.offloaded == {("aten::mm", 1)}  # 1 MiB is not under the 1 MiB floor
    assert ("aten::mm", 0) not in plan.copies and plan.overhead_seconds == 2e-3
    row = next(line for line in plan.table().splitlines() if line.startswith("aten::mm #0 "))
    assert row.endswith("recompute         -        -          -           -           -  - (under 1048576 bytes)")
    lower = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK, min_bytes=MiB // 4))
    assert (lower.offloaded, lower.overhead_seconds) == ({("aten::mm", 0), ("aten::mm", 1)}, 1e-3)


def test_the_table_curve_and_pareto_show_both_models():
    plan = Plan.from_profile(two_matmuls(), 9 * MiB, offload=OffloadModel(LINK, LINK))
    table = plan.table().splitlines()
    assert table[0] == (
        "Plan(budget=9437184: 9.00 MiB, keeps 1 of 3 calls, offloads 1 (8.00 MiB on the host, copies "
        "0.000 ms exposed), holds 9.00 MiB of 17.00, recompute 0.750 ms of 11.750)"
    )
    assert table[-4:] == [
        "per call (copies: 17.180 GB/s to the host, 17.180 GB/s back; each alone, hidden behind the forward's kernel "
        "time after it and the recompute's before it)",
        "call                                            unit                MiB       ms  outcome      d2h ms   h2d ms"
        "  window ms back win ms  exposed ms  hides",
        "aten::mm #0                                     -                 8.000    1.000  offload       0.488    0.488"
        "     10.000       0.750       0.000  yes",
        "aten::mm #1                                     -                 8.000   10.000  keep          0.488    0.488"
        "      0.000       1.750       0.000  yes",
    ]
    points = plan.pareto()
    assert [p["offloaded_calls"] for p in points[:3]] == [2, 2, 2] and points[-1]["offloaded_calls"] == 0
    assert all(p["overhead_seconds"] <= p["two_way_overhead_seconds"] for p in points)
    assert plan.curve().splitlines()[0].endswith("offloaded  host MiB  copy ms  total ms  2-way ms")


def test_the_plot_draws_the_three_way_curve_beside_the_two_way_one(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    profile = profile_of(("aten::mm", 8 * MiB, 1.0), ("aten::mm", 8 * MiB, 10.0), floor=MiB)
    plan = Plan.from_profile(profile, 9 * MiB, offload=OffloadModel(LINK, LINK))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plan.plot(tmp_path / "plan.png", policies={})
    axes = figures[0].axes[0]
    lines = {line.get_label(): line for line in axes.lines}
    assert set(lines) == {"keep or recompute", "keep, offload or recompute"}
    three, two = lines["keep, offload or recompute"].get_ydata(), lines["keep or recompute"].get_ydata()
    assert all(a <= b for a, b in zip(three, two)) and three[0] < two[0]
    assert axes.get_ylabel() == "recompute + exposed copy time (ms)"
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_the_policy_offloads_exactly_the_planned_calls():
    profile = profile_of(
        ("aten::gelu", 0, 2.0, COMPUTE),
        ("aten::mm", 8 * MiB, 1.0),
        ("aten::mm", 8 * MiB, 10.0),
        ("aten::addmm", 2 * MiB, 5.0),
        floor=MiB,
    )
    plan = Plan.from_profile(profile, MiB, offload=OffloadModel(LINK, LINK, MiB // 2, 64 * MiB))
    assert plan.offloaded == {("aten::mm", 0), ("aten::mm", 1), ("aten::addmm", 0)}
    assert plan.policy == Policy(
        kept_calls={},
        offloaded_calls={"aten::mm.default": [0, 1], "aten::addmm.default": [0]},
        offload_min_bytes=MiB // 2,
        host_memory_limit=64 * MiB,
    )
    assert plan.policy.offloaded_calls == {"aten::addmm": (0,), "aten::mm": (0, 1)}


def test_a_plan_predicts_its_own_policy_and_hand_written_offloading_ones():
    profile = profile_of(
        ("aten::gelu", 0, 1.0, COMPUTE),
        ("aten::mm", 8 * MiB, 1.0),
        ("aten::mm", 8 * MiB, 10.0),
        ("aten::addmm", MiB // 2, 5.0),
        ("aten::sum", 0, 20.0, AFTER),
        floor=MiB,
    )
    plan = Plan.from_profile(profile, 9 * MiB, offload=OffloadModel(LINK, LINK, host_memory_limit=32 * MiB))
    assert (plan.calls_kept_by(plan.policy), plan.calls_offloaded_by(plan.policy)) == (plan.kept, plan.offloaded)
    assert plan.evaluate(plan.policy) == {
        "held_bytes": plan.held_bytes,
        "kept_bytes": plan.kept_bytes,
        "offloaded_bytes": plan.offloaded_bytes,
        "recompute_seconds": plan.recompute_seconds,
        "overhead_seconds": plan.overhead_seconds,
    }
    # As the runtime does: an output under offload_min_bytes stays on the device, and so does one
    # that would take the host past host_memory_limit.
    policy = Policy(offloaded_ops=["aten::mm", "aten::addmm"], host_memory_limit=8 * MiB)
    assert plan.calls_offloaded_by(policy) == {("aten::mm", 0)}
    assert plan.calls_kept_by(policy) == {("aten::mm", 1), ("aten::addmm", 0)}
    assert plan.evaluate(policy) == {
        "held_bytes": MiB + 8 * MiB + MiB // 2,
        "kept_bytes": 8 * MiB + MiB // 2,
        "offloaded_bytes": 8 * MiB,
        "recompute_seconds": 1e-3,
        "overhead_seconds": 1e-3,
    }


def test_save_and_load_keep_the_offloads(tmp_path):
    profile = profile_of(("aten::mm", 8 * MiB, 1.0), ("aten::mm", 8 * MiB, 10.0), floor=MiB)
    plan = Plan.from_profile(profile, 9 * MiB, offload=OffloadModel(LINK, LINK / 2, MiB, 32 * MiB))
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert (loaded.kept, loaded.offloaded, loaded.offload, loaded.profile) == (
        plan.kept,
        plan.offloaded,
        plan.offload,
        plan.profile,
    )
    assert loaded.policy == plan.policy and loaded.table() == plan.table()


def test_bad_offloads_in_a_plan_file_are_refused_by_name(tmp_path):
    profile = profile_of(
        ("aten::gelu", 0, 1.0, COMPUTE),
        ("aten::mm", 8 * MiB, 1.0),
        ("aten::mm", 8 * MiB, 10.0),
        ("aten::mm", MiB // 2, 1.0),
        floor=MiB,
    )
    good = Plan.from_profile(profile, 9 * MiB, offload=OffloadModel(LINK, LINK, host_memory_limit=8 * MiB)).to_dict()
    assert (good["version"], good["offloaded"]) == (4, [["aten::mm", 0]])
    model = good["offload"]
    cases = [
        (
            {"offload": {**model, "h2d_bytes_per_s": 0}},
            "offload.h2d_bytes_per_s must be a finite number of bytes per second > 0, got 0",
        ),
        ({"offload": {"d2h_bytes_per_s": LINK}}, "missing key 'h2d_bytes_per_s' in offload"),
        ({"offloaded": [["aten::mm", 1]]}, "['aten::mm', 1] is both kept and offloaded"),
        ({"offloaded": [["aten::mm", 2]]}, "offloaded ['aten::mm', 2] cannot be offloaded: under 1048576 bytes"),
        (
            {"offloaded": [["aten::mm", 0]], "kept": [], "offload": {**model, "host_memory_limit": 4 * MiB}},
            f"it offloads {8 * MiB} bytes, over its host_memory_limit of {4 * MiB} bytes",
        ),
        ({"offloaded": [["aten::mm", 7]]}, "offloaded[0] = ['aten::mm', 7] is not a profiled call"),
    ]
    path = tmp_path / "plan.json"
    for changes, message in cases:
        data = {**good, **changes}
        with pytest.raises(PlanError) as raised:
            Plan.from_dict(data, where=f"plan file {path}")
        assert str(raised.value) == f"sac_plugin: plan file {path}: {message}"


def test_a_version_1_file_loads_as_a_two_way_plan(tmp_path):
    profile = profile_of(("aten::mm", 8 * MiB, 1.0), ("aten::mm", 8 * MiB, 10.0), floor=MiB)
    plan = Plan.from_profile(profile, 9 * MiB)
    data = plan.to_dict()
    del data["offload"], data["offloaded"], data["rng_state_bytes"]
    calls = [{k: v for k, v in call.items() if k != "units"} for call in data["calls"]]
    loaded = Plan.from_dict({**data, "calls": calls, "version": 1})
    assert (loaded.kept, loaded.offloaded, loaded.offload, loaded.policy) == (plan.kept, frozenset(), None, plan.policy)


# --- random profiles -------------------------------------------------------------------------------

GRAIN = 1 << 18


@st.composite
def offload_problems(draw, max_calls=8):
    """A random profile of whole 256 KiB multiples (so the byte grid is exact), random bandwidths,
    size floor and host cap."""
    sizes = draw(st.lists(st.integers(0, 24), max_size=max_calls))
    recomputed = draw(st.integers(0, len(sizes)))  # the recompute stops after this many calls
    calls = [
        (
            f"aten::op{i % 3}",
            size * GRAIN,
            draw(st.floats(0.0, 5.0)),
            *(() if i < recomputed and draw(st.integers(0, 4)) else ("view",) if i < recomputed else (AFTER,)),
        )
        for i, size in enumerate(sizes)
    ]
    model = OffloadModel(
        draw(st.floats(2e9, 1e11)),
        draw(st.floats(2e9, 1e11)),
        draw(st.sampled_from([0, GRAIN, MiB, 4 * MiB])),
        draw(st.one_of(st.none(), st.integers(0, 40).map(lambda n: n * GRAIN))),
    )
    return profile_of(*calls, floor=draw(st.integers(0, 8)) * GRAIN), model


def _budgets(profile):
    # Byte counts under 2 are spelled as the fraction 0.0 (NOTE: [A budget has one reading]).
    return list(_plan.PARETO_BUDGETS) + [
        byte_budget(profile.full_recompute_bytes + k * GRAIN) for k in (0, 1, 3, 7, 20)
    ]


@examples(150)
@given(problem=offload_problems())
def test_three_way_plans_are_never_slower_than_two_way_plans(problem):
    """At every budget: the three-way plan predicts a step no slower than the two-way one (exactly,
    not within a tolerance), holds no more than the budget (or the floor), keeps the host within
    its cap and offloads only calls at or above the size floor."""
    profile, model = problem
    three_way = Plan.from_profile(profile, 1.0, offload=model)
    for budget in _budgets(profile):
        plan = three_way.with_budget(budget)
        two_way = Plan.from_profile(profile, budget)
        assert (plan.without_offload().kept, plan.without_offload().overhead_seconds) == (
            two_way.kept,
            two_way.overhead_seconds,
        )
        assert plan.overhead_seconds <= two_way.overhead_seconds, budget
        assert plan.held_bytes <= max(plan.budget_bytes, profile.full_recompute_bytes)
        assert not plan.kept & plan.offloaded
        assert model.host_memory_limit is None or plan.offloaded_bytes <= model.host_memory_limit
        by_key = {(c.op, c.index): c for c in profile.calls}
        assert all(
            not model.why_not_offloadable(by_key[k]) and by_key[k].bytes >= model.min_bytes for k in plan.offloaded
        )


def _fastest_step(profile, model, budget):
    """The least predicted step time over every keep/offload/recompute choice within the budget and
    the host cap, each priced on the copy queues: brute force."""
    plan = Plan.from_profile(profile, budget, offload=model)
    items = [c for c in profile.calls if c.keepable and c.bytes > 0]
    capacity = plan.budget_bytes - profile.full_recompute_bytes
    best = math.inf
    for choice in itertools.product("kor", repeat=len(items)):
        kept = {(c.op, c.index) for c, o in zip(items, choice) if o == "k"}
        offloaded = {(c.op, c.index) for c, o in zip(items, choice) if o == "o"}
        if sum(c.bytes for c in items if (c.op, c.index) in kept) > max(capacity, 0):
            continue
        if (
            model.host_memory_limit is not None
            and sum(c.bytes for c in items if (c.op, c.index) in offloaded) > model.host_memory_limit
        ):
            continue
        if not offloaded <= plan.copies.keys():
            continue
        best = min(best, Plan(profile, budget, kept, offloaded, offload=model).overhead_seconds)
    return best


@examples(80)
@given(problem=offload_problems(max_calls=6))
def test_the_three_way_plan_is_between_the_fastest_step_and_the_two_way_plan(problem):
    """Offloads share the copy queues, so no table is exact: the plan predicts a step no faster
    than the fastest choice (brute force, priced the same way) and no slower than the two-way
    plan, and recomputing any one call it offloads instead would not predict a faster step."""
    profile, model = problem
    for budget in (0.0, 0.25, 0.5, 0.75, 1.0):
        plan = Plan.from_profile(profile, budget, offload=model)
        fastest = _fastest_step(profile, model, budget)
        assert fastest <= plan.overhead_seconds * (1 + 1e-12) + 1e-15, budget
        assert plan.overhead_seconds <= plan.without_offload().overhead_seconds, budget
        for key in plan.offloaded:
            fewer = Plan(profile, budget, plan.kept, plan.offloaded - {key}, offload=model)
            assert fewer.overhead_seconds >= plan.overhead_seconds, (budget, key)


# --- plan() ----------------------------------------------------------------------------------------


def llama():
    torch.manual_seed(0)
    cos, sin = rotary_tables(8, 16)
    return LlamaBlock(32, 4), (torch.randn(2, 16, 32, requires_grad=True), cos, sin)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the message for a machine without an accelerator")
def test_offload_without_an_accelerator_or_bandwidths_plans_two_way_and_says_why_once(caplog, monkeypatch):
    monkeypatch.setattr(_plan_offload, "_warned_offload_unavailable", set())
    block, args = llama()
    with caplog.at_level(logging.WARNING, logger="sac_plugin"):
        plans = [sac_plugin.plan(block, *args, budget=0.3, runs=1, offload=True) for _ in range(2)]
    assert all(p.offload is None and p.offloaded == frozenset() for p in plans)
    assert [r.getMessage() for r in caplog.records] == [
        "sac_plugin: plan: offload=True, but no accelerator is available and no offload_bandwidth was given: the plan "
        "keeps or recomputes each call (pass offload_bandwidth=(device_to_host, host_to_device) bytes per second to "
        "plan offload for another machine)"
    ]


def test_offload_with_given_bandwidths_plans_three_way_on_cpu():
    block, args = llama()
    plan = sac_plugin.plan(
        block,
        *args,
        budget=0.1,
        runs=1,
        offload=True,
        offload_bandwidth=(2e9, 3e9),
        offload_min_bytes=0,
        host_memory_limit=1 << 30,
    )
    assert plan.offload == OffloadModel(2e9, 3e9, 0, 1 << 30)
    assert plan.offloaded and plan.overhead_seconds <= plan.without_offload().overhead_seconds
    assert plan.held_bytes <= plan.budget_bytes


def test_offload_is_planned_only_where_its_copies_hide():
    block, args = llama()

    def planned(bandwidth):
        return sac_plugin.plan(
            block,
            *args,
            budget=0.1,
            runs=1,
            offload=True,
            offload_bandwidth=(bandwidth, bandwidth),
            offload_min_bytes=0,
        )

    # At a kilobyte a second no copy hides: the plan is the two-way one, call for call.
    slow = planned(1e3)
    two_way = slow.without_offload()
    assert (slow.kept, slow.offloaded, slow.copy_seconds) == (two_way.kept, frozenset(), 0.0)
    assert slow.overhead_seconds == two_way.overhead_seconds
    # At a petabyte a second every copy is nanoseconds: the plan offloads, for a faster step.
    fast = planned(1e15)
    assert fast.offloaded and fast.copy_seconds < 1e-9
    assert fast.overhead_seconds < fast.without_offload().overhead_seconds


PREDICTED_AND_MEASURED = """
import statistics
import sac_plugin, sac_plugin.memory
from sac_plugin.models import LlamaBlock, rotary_tables

# Copies out fast, so that they end within the forward; copies back slow, so that they, not this
# loaded CPU's scheduling, set the time the recompute waits.
sac_test_accelerator.set_copy_bandwidth(to_host=1e9, to_device=5e6)
device = torch.device("sac_accel")
torch.manual_seed(0)
block = LlamaBlock(256, 4).to(device)
cos, sin = rotary_tables(64, 256, device=device)
x = torch.randn(1, 256, 256, device=device, requires_grad=True)
plan = sac_plugin.plan(block, x, cos, sin, budget=1.0, offload=True, offload_min_bytes=0)
# The query, key and value projections: the recompute needs them at once, near its start.
policy = sac_plugin.Policy(offloaded_calls={"aten::mm": [0, 1, 2]}, offload_min_bytes=0)
priced = plan.evaluate(policy)
sac_plugin.apply_selective_checkpointing(block, policy)
measured = []
for _ in range(6):
    torch.accelerator.synchronize()
    before = sac_plugin.memory.offload_stats()["exposed_copy_us"]
    block(x, cos, sin).sum().backward()
    torch.accelerator.synchronize()
    measured.append((sac_plugin.memory.offload_stats()["exposed_copy_us"] - before) / 1e6)
report(
    offloaded=sorted(plan.calls_offloaded_by(policy)),
    bytes=[c.bytes for c in plan.profile.calls if (c.op, c.index) in plan.calls_offloaded_by(policy)],
    predicted=priced["overhead_seconds"] - priced["recompute_seconds"],
    measured=statistics.median(measured[1:]),
)
"""


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_the_predicted_exposed_copy_time_is_what_the_simulated_device_measures():
    values = run_on_accelerator(PREDICTED_AND_MEASURED)
    assert values["offloaded"] == [["aten::mm", 0], ["aten::mm", 1], ["aten::mm", 2]]
    assert values["bytes"] == [256 * 256 * 4] * 3
    # Queued on the copy-in stream, the three copies back take 3 x 52 ms from the recompute's start;
    # priced one by one, each would hide behind the forward's kernel time after it.
    assert values["measured"] > 0.1
    assert values["predicted"] == pytest.approx(values["measured"], rel=0.10)


def test_a_three_way_plans_policy_serves_every_planned_call_and_gives_bitwise_gradients():
    block, (x, cos, sin) = llama()
    plan = sac_plugin.plan(
        block, x, cos, sin, budget=0.2, runs=1, offload=True, offload_bandwidth=(2e9, 3e9), offload_min_bytes=0
    )
    assert plan.offloaded and plan.kept
    reference = copy.deepcopy(block)
    sac_plugin.apply_selective_checkpointing(block, plan.policy)
    xa, xb = (x.detach().clone().requires_grad_() for _ in range(2))
    with sac_plugin.audit() as audit:
        block(xa, cos, sin).pow(2).sum().backward()  # on the CPU an offloaded output is kept
    reference(xb, cos, sin).pow(2).sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(block.parameters(), reference.parameters()))
    assert sum(row.hits for row in audit.rows()) == len(plan.kept) + len(plan.offloaded)


def test_offload_times_the_copies_on_the_layers_accelerator(monkeypatch):
    block, args = llama()
    timed = []
    monkeypatch.setattr(_plan_offload, "accelerator_device", lambda module, a, k: torch.device("cuda", 0))
    monkeypatch.setattr(_plan_offload, "measure_offload_bandwidth", lambda device: timed.append(device) or (4e9, 5e9))
    plan = sac_plugin.plan(block, *args, budget=0.1, runs=1, offload=True)
    assert (timed, plan.offload) == ([torch.device("cuda", 0)], OffloadModel(4e9, 5e9))


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"offload": "yes"}, TypeError, "sac_plugin: plan: offload must be True or False, got 'yes' (str)"),
        (
            {"offload_bandwidth": (1e9, 1e9)},
            ValueError,
            "sac_plugin: plan: offload_bandwidth only apply with offload=True",
        ),
        (
            {"host_memory_limit": 0, "offload_min_bytes": 0},
            ValueError,
            "sac_plugin: plan: host_memory_limit, offload_min_bytes only apply with offload=True",
        ),
        (
            {"offload": True, "offload_bandwidth": (1e9,)},
            ValueError,
            "sac_plugin: plan: offload_bandwidth must be (device_to_host, host_to_device) bytes per second, two finite "
            "numbers > 0, got (1000000000.0,)",
        ),
        (
            {"offload": True, "offload_bandwidth": (1e9, float("inf"))},
            ValueError,
            "sac_plugin: plan: offload_bandwidth must be (device_to_host, host_to_device) bytes per second, two finite "
            "numbers > 0, got (1000000000.0, inf)",
        ),
        (
            {"offload": True, "host_memory_limit": -1},
            ValueError,
            "sac_plugin: plan: host_memory_limit must be None (no cap) or an int from 0 to 2**63 - 1 (bytes), got -1",
        ),
        (
            {"offload": True, "offload_min_bytes": 0.5},
            ValueError,
            "sac_plugin: plan: offload_min_bytes must be an int from 0 to 2**63 - 1 (bytes), got 0.5",
        ),
    ],
)
def test_bad_offload_arguments_are_refused_by_name_before_profiling(arguments, error, message, monkeypatch):
    block, args = llama()
    monkeypatch.setattr(_plan, "profile_layer", lambda *a, **k: pytest.fail("profiled"))
    with pytest.raises(error) as raised:
        sac_plugin.plan(block, *args, budget=0.3, **arguments)
    assert str(raised.value) == message


def test_a_coarse_pair_table_never_goes_over_either_capacity():
    """Tables beyond the exact grid round weights up: possibly less value, never more bytes."""
    weights = [3 * MiB + 7 * i + 1 for i in range(40)]
    table = knapsack.PairKnapsack(
        weights,
        [float(i % 7 + 1) for i in range(40)],
        [float(i % 5) or None for i in range(40)],
        50 * MiB + 13,
        30 * MiB + 5,
    )
    assert table.device_grid > 1 and table.host_grid > 1
    for capacity in (0, 4 * MiB, 50 * MiB + 13):
        device, host = table.solve(capacity)
        assert bool(device) == (capacity > 0) and host and not set(device) & set(host)
        assert sum(weights[i] for i in device) <= capacity
        assert sum(weights[i] for i in host) <= 30 * MiB + 5
        assert all(i % 5 for i in host)  # only items the host may take


def test_a_plan_refuses_offloads_it_cannot_price():
    profile = profile_of(("aten::mm", 8 * MiB, 1.0), ("aten::mm", MiB // 2, 1.0))
    with pytest.raises(ValueError) as raised:
        Plan(profile, 1.0, frozenset(), {("aten::mm", 0)})
    assert str(raised.value) == (
        "sac_plugin: Plan: ('aten::mm', 0) cannot be offloaded: there is no OffloadModel (offload=...)"
    )
    with pytest.raises(ValueError) as raised:
        Plan(profile, 1.0, frozenset(), {("aten::mm", 1)}, offload=OffloadModel(LINK, LINK))
    assert str(raised.value) == (
        "sac_plugin: Plan: ('aten::mm', 1) cannot be offloaded: not a profiled call a plan may offload"
    )


@pytest.mark.parametrize(
    "nbytes, reserved, floor, limit, placement",
    [
        (MiB, 0, MiB, None, "HOST"),
        (MiB - 1, 0, MiB, None, "DEVICE_BELOW_FLOOR"),
        (MiB - 1, 0, MiB, 0, "DEVICE_BELOW_FLOOR"),  # the floor first: a small output takes no host room
        (MiB, 3 * MiB, MiB, 4 * MiB, "HOST"),  # reserved + bytes == limit fits
        (MiB, 3 * MiB + 1, MiB, 4 * MiB, "DEVICE_HOST_LIMIT"),
        (5 * MiB, 0, MiB, 4 * MiB, "DEVICE_HOST_LIMIT"),
        (2**62, 2**62 - 1, 0, 2**63 - 1, "HOST"),  # no sum overflows int64
        (2**62, 2**62, 0, 2**63 - 1, "DEVICE_HOST_LIMIT"),
        (0, 0, 0, None, "HOST"),
    ],
)
def test_the_offload_rule_is_the_librarys(nbytes, reserved, floor, limit, placement):
    from sac_plugin.planner._cost import Placement, offload_placement

    assert offload_placement(nbytes, reserved, floor, limit) == Placement[placement]


def test_a_policys_offloads_are_placed_by_the_librarys_rule(monkeypatch):
    """Plan.calls_offloaded_by asks the library where each offloaded call lives, in forward order
    with the host bytes taken so far: the calls it says stay on the device are kept there."""
    from sac_plugin.planner import _rule_calls

    profile = profile_of(("aten::mm", 8 * MiB, 1.0), ("aten::mm", 2 * MiB, 1.0), ("aten::mm", MiB // 2, 1.0), floor=MiB)
    plan = Plan.from_profile(profile, 0.0, offload=OffloadModel(LINK, LINK))
    policy = Policy(offloaded_ops=["aten::mm"], host_memory_limit=9 * MiB)
    asked = []
    rule = _rule_calls.offload_placement

    def spy(*arguments):
        asked.append(arguments)
        return rule(*arguments)

    monkeypatch.setattr(_rule_calls, "offload_placement", spy)
    offloaded, kept = plan.calls_offloaded_by(policy), plan.calls_kept_by(policy)
    assert offloaded == {("aten::mm", 0)} and kept == {("aten::mm", 1), ("aten::mm", 2)}
    assert asked[:3] == [
        (8 * MiB, 0, MiB, 9 * MiB),
        (2 * MiB, 8 * MiB, MiB, 9 * MiB),
        (MiB // 2, 8 * MiB, MiB, 9 * MiB),
    ]
