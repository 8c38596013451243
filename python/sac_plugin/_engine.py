"""Which engine runs checkpointed regions in this process, chosen once at import.

- "native": the C++ interception on the plugin's dispatch key (NOTE: [The dispatch key sac_plugin
  intercepts on]), with its own fallback or per-op kernels beside another owner of the key;
- "dispatch_mode": a Python TorchDispatchMode that hands every call to the same C++ region, rule and
  data-flow matching, at Python's per-op cost. It runs when SAC_PLUGIN_ENGINE=dispatch_mode asks for
  it, or when the native interception cannot be installed in this torch.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["ENGINES", "ENGINE_VARIABLE", "choose_engine", "chosen", "engine"]

ENGINE_VARIABLE = "SAC_PLUGIN_ENGINE"
ENGINES = ("native", "dispatch_mode")

# The engine of this process, set once by choose_engine. The hot path of checkpointing.py reads
# it as a module global, not through engine(): a Python call per checkpoint costs microseconds.
chosen: str = "native"


def choose_engine(install_error: str | None) -> str:
    """The engine for this process: SAC_PLUGIN_ENGINE if set, else native unless the C++
    interception could not be installed (then dispatch_mode, with one warning saying why)."""
    global chosen
    requested = os.environ.get(ENGINE_VARIABLE, "").strip()
    if requested and requested not in ENGINES:
        raise ImportError(
            f"sac_plugin: {ENGINE_VARIABLE}={requested[:80]!r} is not an engine; expected one of {', '.join(ENGINES)} "
            "(or unset, to let the plugin choose)"
        )
    if requested == "native" and install_error is not None:
        raise ImportError(
            f"sac_plugin: {ENGINE_VARIABLE}=native, but the native engine cannot run here: {install_error}"
        )
    if requested:
        chosen = requested
    elif install_error is not None:
        warnings.warn(
            f"sac_plugin: the native engine cannot run in this torch ({install_error}); using the dispatch-mode "
            "engine, which makes the same decisions in the same C++ rule through a Python dispatch mode, at "
            f"Python's per-op cost. Set {ENGINE_VARIABLE}=dispatch_mode to choose it explicitly.",
            RuntimeWarning,
            stacklevel=3,
        )
        chosen = "dispatch_mode"
    else:
        chosen = "native"
    return chosen


def engine() -> str:
    """Which engine runs checkpointed regions in this process (docs/engines.md).

    Returns:
        "native" or "dispatch_mode".
    """
    return chosen
