"""sac_plugin: selective activation checkpointing as a C++ dispatcher plugin."""

from . import _library
from ._version import __version__  # noqa: F401

_library.load()

from ._library import interception_path  # noqa: E402
from .audit import Audit, AuditRow, audit  # noqa: E402
from .checkpointing import Region, apply_selective_checkpointing, context_fn  # noqa: E402
from .dispatch_mode import engine  # noqa: E402
from .config import ConfigError, RecomputeConfig, apply_recompute_config  # noqa: E402
from .planner import Plan, PlanError, plan  # noqa: E402
from .policy import Policy, resolve_kept_ops  # noqa: E402
from .report import Report, TraceEntry, report, trace  # noqa: E402
from .targets import KeptCallables, KeptOps, RecomputeTargetMap, RecomputeUnit  # noqa: E402
from .units import in_recompute_unit, open_units, recompute_unit  # noqa: E402

__all__ = [
    "Audit",
    "AuditRow",
    "ConfigError",
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
    "TraceEntry",
    "apply_recompute_config",
    "apply_selective_checkpointing",
    "audit",
    "context_fn",
    "engine",
    "in_recompute_unit",
    "interception_path",
    "open_units",
    "plan",
    "recompute_unit",
    "report",
    "resolve_kept_ops",
    "trace",
]
