"""What a Plan predicts beyond its own choice: the plans for other budgets (Plan.pareto) and what a
hand-written policy would hold and recompute on its profile (Plan.evaluate)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..policy import Policy
from .._validation import describe_value
from ._cost import call_key, check_budget, copy_costs, step_overhead
from ._rule_calls import held_by

__all__ = ["check_policy", "evaluate", "pareto"]


def pareto(plan, budgets: Iterable[float | int]) -> list[dict]:
    """What Plan.pareto returns (see there): the plan's profile planned for each budget."""
    points = []
    for budget in budgets:
        budget_plan = plan.with_budget(check_budget(budget, "pareto: budget"))
        point = {
            "budget": budget,
            "budget_bytes": budget_plan.budget_bytes,
            "held_bytes": budget_plan.held_bytes,
            "kept_bytes": budget_plan.kept_bytes,
            "kept_calls": len(budget_plan.kept),
            "recompute_seconds": budget_plan.recompute_seconds,
            "overhead_seconds": budget_plan.overhead_seconds,
        }
        if plan.offload is not None:
            two_way = budget_plan.without_offload()
            point.update(
                {
                    "offloaded_calls": len(budget_plan.offloaded),
                    "offloaded_bytes": budget_plan.offloaded_bytes,
                    "copy_seconds": budget_plan.copy_seconds,
                    "two_way_held_bytes": two_way.held_bytes,
                    "two_way_overhead_seconds": two_way.overhead_seconds,
                }
            )
        points.append(point)
    return points


def evaluate(plan, policy: Policy) -> dict:
    """What Plan.evaluate returns (see there): what `policy` holds and recomputes on the plan's profile."""
    check_policy(policy, "Plan.evaluate")
    kept, offloaded = held_by(policy, plan.profile)
    kept_bytes = sum(c.bytes for c in plan.profile.calls if call_key(c) in kept)
    result = {
        "held_bytes": plan.profile.full_recompute_bytes + kept_bytes,
        "kept_bytes": kept_bytes,
        "offloaded_bytes": sum(c.bytes for c in plan.profile.calls if call_key(c) in offloaded),
        "recompute_seconds": step_overhead(plan.profile, kept | offloaded, frozenset(), {}),
    }
    if plan.offload is not None:
        # A policy may offload a call under the plan's size floor: price every call's copies.
        copies = copy_costs(plan.profile, dataclasses.replace(plan.offload, min_bytes=0))
        result["overhead_seconds"] = step_overhead(plan.profile, kept, offloaded, copies)
    return result


def check_policy(policy, method: str) -> None:
    """A TypeError naming `method` ("Plan.evaluate") unless `policy` is a sac_plugin.Policy."""
    if not isinstance(policy, Policy):
        raise TypeError(f"sac_plugin: {method}: policy must be a sac_plugin.Policy, got {describe_value(policy)}")
