"""Memory-budget planning: profile a layer, keep what saves the most recompute time within a
byte budget (`plan`), split a model's budget over its layers (`split`)."""

from __future__ import annotations

from ._plan import Plan, PlanError, check_budget, plan
from ._profile import LayerProfile, ProfiledCall, profile_layer
from ._reference import reference_policies
from ._split import split, total_budget_bytes


__all__ = ["LayerProfile", "Plan", "PlanError", "ProfiledCall", "check_budget", "plan", "profile_layer",
           "reference_policies", "split", "total_budget_bytes"]
