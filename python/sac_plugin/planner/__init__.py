"""Memory-budget planning: profile a layer and keep (or offload) what saves the most step time
within a byte budget (`plan`, giving a `Plan`; `OffloadModel` prices the copies), or plan a whole
training step for a peak-memory budget (`plan_step`, giving a `StepPlan`). A recompute config's
budget is split over the model's layers by the same planner."""

from __future__ import annotations

from ._cost import OffloadModel, PlanError
from ._plan import Plan, plan
from ._profile import LayerProfile, ProfiledCall
from ._reference import reference_policies
from ._step import plan_step
from ._step_plan import StepPlan


__all__ = [
    "LayerProfile",
    "OffloadModel",
    "Plan",
    "PlanError",
    "ProfiledCall",
    "StepPlan",
    "plan",
    "plan_step",
    "reference_policies",
]
