"""Memory-budget planning: profile a layer, keep what saves the most recompute time within a
byte budget (plan.py, knapsack.py), split a model's budget over its layers (split.py)."""

from __future__ import annotations

from .plan import Plan, PlanError, check_budget, plan
from .profile import LayerProfile, ProfiledCall, profile_layer


def reference_policies() -> dict:
    """The hand-written policies a plan is compared with (README, tools/bench_budget.py)."""
    from ..policy import Policy
    from ..targets import ATTENTION_OPS

    attention = ATTENTION_OPS.resolve()
    matmuls = ["aten::mm", "aten::addmm"]
    return {
        "attention kept": Policy(kept_ops=attention),
        "attention + every other mm": Policy(kept_ops=attention, every_nth_op={op: 2 for op in matmuls}),
        "attention + all mm": Policy(kept_ops=attention | set(matmuls)),
    }


__all__ = ["LayerProfile", "Plan", "PlanError", "ProfiledCall", "check_budget", "plan", "profile_layer",
           "reference_policies"]
