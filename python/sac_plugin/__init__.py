"""sac_plugin: selective activation checkpointing as a C++ dispatcher plugin."""

from typing import TYPE_CHECKING

from . import _engine, _native
from ._version import __version__

_engine.choose_engine(_native.load())

from ._apply_config import apply_recompute_config  # noqa: E402
from ._engine import engine  # noqa: E402
from ._native import interception_path  # noqa: E402
from ._audit import Audit, AuditRow, audit  # noqa: E402
from .checkpointing import (  # noqa: E402
    Region,
    apply_selective_checkpointing,
    context_fn,
    remove_checkpointing,
    torch_policy_fn,
)
from .config import ConfigError, RecomputeConfig  # noqa: E402
from .policy import Policy, resolve_kept_ops  # noqa: E402
from ._oom import install_oom_observer  # noqa: E402
from ._report import Report, report, trace  # noqa: E402
from ._trace import TraceEntry  # noqa: E402
from ._warnings import HeldNeverServedWarning  # noqa: E402
from .targets import KeptCallables, KeptOps, RecomputeTargetMap  # noqa: E402
from .units import RecomputeUnit, in_recompute_unit, open_units, recompute_unit  # noqa: E402

# The planner is imported when first used: it imports torch._dynamo, which costs about a second
# above `import torch` and is needed only to plan (or to compile, which imports it anyway).
if TYPE_CHECKING:
    from .planner import Plan, PlanError, StepPlan, plan, plan_step

_PLANNER_NAMES = frozenset({"Plan", "PlanError", "StepPlan", "plan", "plan_step"})


def __getattr__(name: str):
    if name in _PLANNER_NAMES:
        from . import planner

        value = getattr(planner, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sac_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _PLANNER_NAMES)


__all__ = [
    "Audit",
    "AuditRow",
    "ConfigError",
    "HeldNeverServedWarning",
    "KeptCallables",
    "KeptOps",
    "Plan",
    "PlanError",
    "Policy",
    "RecomputeConfig",
    "RecomputeTargetMap",
    "RecomputeUnit",
    "Region",
    "Report",
    "StepPlan",
    "TraceEntry",
    "__version__",
    "apply_recompute_config",
    "apply_selective_checkpointing",
    "audit",
    "context_fn",
    "engine",
    "in_recompute_unit",
    "install_oom_observer",
    "interception_path",
    "open_units",
    "plan",
    "plan_step",
    "recompute_unit",
    "remove_checkpointing",
    "report",
    "resolve_kept_ops",
    "torch_policy_fn",
    "trace",
]
