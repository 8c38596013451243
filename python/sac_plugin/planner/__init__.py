"""Memory-budget planning: profile a layer, keep (or offload) what saves the most step time within
a byte budget (`plan`), split a model's budget over its layers (`split`), plan a training step
for a peak-memory budget (`plan_step`)."""

from __future__ import annotations

from ._cost import CopyCost, OffloadModel, PlanError, check_budget
from ._plan import Plan, plan
from ._profile import LayerProfile, ProfiledCall, profile_layer
from ._reference import reference_policies
from ._split import split, total_budget_bytes
from ._step import StepPlan, plan_step


__all__ = [
    "CopyCost",
    "LayerProfile",
    "OffloadModel",
    "Plan",
    "PlanError",
    "ProfiledCall",
    "StepPlan",
    "check_budget",
    "plan",
    "plan_step",
    "profile_layer",
    "reference_policies",
    "split",
    "total_budget_bytes",
]
