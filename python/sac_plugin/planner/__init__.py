"""Memory-budget planning: profile a layer, keep (or offload) what saves the most step time within
a byte budget (`plan`), split a model's budget over its layers (`split`)."""

from __future__ import annotations

from ._plan import CopyCost, OffloadModel, Plan, PlanError, check_budget, plan
from ._profile import LayerProfile, ProfiledCall, profile_layer
from ._reference import reference_policies
from ._split import split, total_budget_bytes


__all__ = ["CopyCost", "LayerProfile", "OffloadModel", "Plan", "PlanError", "ProfiledCall", "check_budget", "plan",
           "profile_layer", "reference_policies", "split", "total_budget_bytes"]
