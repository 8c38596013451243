"""The one way into the compiled plugin: loading it, its extension module and the enums mirrored
from C++, under one version check.

Python reaches the library two ways, both set up here (NOTE: [One extension module] in
csrc/bindings/python_module.cpp): `torch.ops.sac.*`, registered by `torch.ops.load_library` (the
calls that take tensors, and the stateless queries), and the extension module `sac_plugin._C`,
imported from the same file and bound as `C`: owned types (Policy, Site, Region, RegionScope,
OpEntry, CallDecider, CallProfile) and the functions on the hot paths. Every other module calls
`C.*` or the ops; none loads or imports anything of the library itself, so a type or an enum
value that changes in C++ changes in one place here.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sys
from pathlib import Path

import torch

_LIBRARY_NAME = "libsac_plugin.so"
_STAMP_NAME = "built_for_torch.txt"
# The library must be compiled against the torch that imports it. --no-deps: never let pip change
# torch; --no-cache-dir: a wheel pip cached from an earlier build was compiled for the old torch.
_REBUILD_HINT = (
    "rebuild it against the installed torch with `pip install --no-build-isolation --no-deps "
    "--force-reinstall --no-cache-dir <sac_plugin source directory or git URL>` "
    "(from a checkout: `bash tools/build.sh`)"
)


def _package_dirs() -> list[Path]:
    # The package's __path__: one directory when installed; the source and the install tree for an
    # editable install (scikit-build-core's redirect), where the library lives in the latter.
    package = sys.modules.get(__package__)
    paths = getattr(package, "__path__", None) or [os.path.dirname(__file__)]
    return [Path(p) for p in paths]


def library_path() -> Path:
    override = os.environ.get("SAC_PLUGIN_LIBRARY")
    if override:
        return Path(override)
    candidates = [d / "_lib" / _LIBRARY_NAME for d in _package_dirs()]
    return next((c for c in candidates if c.exists()), candidates[0])


def _built_for(path: Path) -> str | None:
    stamp = path.parent / _STAMP_NAME
    return stamp.read_text().strip() if stamp.exists() else None


MINIMUM_TORCH = (2, 11)


def load() -> str | None:
    """Loads the library, imports its extension module as `C` and installs the interception.

    Returns:
        Why the native engine cannot run here (the interception could not be installed), or None
        when it can.

    Raises:
        ImportError: torch is too old, or the library is missing, built for another torch or
            with another extension module version than this package expects.
    """
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2] if part.isdigit())
    if version < MINIMUM_TORCH:
        raise ImportError(
            f"sac_plugin needs torch >= {'.'.join(map(str, MINIMUM_TORCH))}, but torch {torch.__version__} "
            "is installed; install a newer torch, then rebuild sac_plugin against it"
        )
    path = library_path()
    if not path.exists():
        raise ImportError(f"sac_plugin: compiled library not found at {path}; {_REBUILD_HINT}")
    built_for = _built_for(path)
    if built_for is not None and built_for != torch.__version__:
        raise ImportError(
            f"sac_plugin: {path} was built for torch {built_for}, but torch {torch.__version__} "
            f"is installed; {_REBUILD_HINT}"
        )
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        raise ImportError(
            f"sac_plugin: could not load {path} (built for torch {built_for or 'unknown'}, "
            f"torch {torch.__version__} installed): {error}; {_REBUILD_HINT}"
        ) from error
    compiled_for = torch.ops.sac.built_for_torch()
    if compiled_for != torch.__version__:
        raise ImportError(
            f"sac_plugin: {path} was built for torch {compiled_for}, but torch {torch.__version__} "
            f"is installed; {_REBUILD_HINT}"
        )
    _import_module(path)
    # The native fallback, or per-op kernels beside another owner of the key; if neither can be
    # installed, the dispatch-mode engine runs instead (_engine.choose_engine says so once).
    try:
        C.install_fallback()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def interception_path() -> str:
    """How the plugin receives ops.

    Returns:
        "native" (its own fallback on the dispatch key) or "coexisting" (per-op kernels beside
        another library's fallback on the same key).
    """
    return C.interception_path()


# --- The extension module (csrc/bindings/python_module.cpp) --------------------------------------

# kModuleVersion: bumped in C++ when a type, a function or a meaning changes.
MODULE_VERSION = 11

# sac_plugin._C, set by load().
C = None


def _import_module(path: Path) -> None:
    global C
    if C is not None:
        return
    # The extension module is the library torch.ops.load_library loaded: Python's loader opens the
    # same file (dlopen hands back the loaded object) and calls its PyInit__C, so a
    # SAC_PLUGIN_LIBRARY build serves it too.
    spec = importlib.util.spec_from_file_location(f"{__package__}._C", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"sac_plugin: {path} cannot be imported as an extension module; {_REBUILD_HINT}")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        raise ImportError(
            f"sac_plugin: {path} has no extension module sac_plugin._C ({error}); {_REBUILD_HINT}"
        ) from error
    if getattr(module, "ABI_VERSION", None) != MODULE_VERSION:
        raise ImportError(
            f"sac_plugin: {path} has extension module version {getattr(module, 'ABI_VERSION', None)}, this "
            f"package expects {MODULE_VERSION}; rebuild the library from the same source as the package"
        )
    if module.REASON_COUNT != len(Reason):
        raise ImportError(
            f"sac_plugin: {path} names a different set of keep reasons ({module.REASON_COUNT}) than "
            f"sac_plugin._native.Reason ({len(Reason)}); rebuild the library from the same source as the package"
        )
    sys.modules[spec.name] = module
    setattr(sys.modules[__package__], "_C", module)
    C = module


# --- Enums mirrored from C++ --------------------------------------------------------------------


class Placement(enum.IntEnum):
    """Where an offloaded call's outputs live (C++ sac::OffloadPlacement)."""

    HOST = 0
    DEVICE_BELOW_FLOOR = 1
    DEVICE_HOST_LIMIT = 2


class Outcome(enum.IntEnum):
    """What happens to a call's outputs (values as in C++ sac::Outcome)."""

    RECOMPUTE = 0
    KEEP = 1
    # Held like a kept output, in pinned host memory between forward and backward.
    OFFLOAD = 2


class Reason(enum.IntEnum):
    """Why (values and order as in C++ sac::Reason; `text` is the library's prose)."""

    KEPT_OP = 0
    EVERY_NTH_CALL = 1
    KEPT_CALL_INDEX = 2
    KEPT_UNIT = 3
    COLLECTIVE = 4
    NEVER_COUNTED = 5
    RANDOM_DRAW = 6
    MUTATES_INPUT = 7
    VIEW_IN_KEPT_UNIT = 8
    PARAMETER_CAST = 9
    UNINITIALISED_ALLOCATION = 10
    INSIDE_RECOMPUTED_UNIT = 11
    NOT_SELECTED = 12
    OFFLOADED_OP = 13
    OFFLOADED_CALL_INDEX = 14
    OFFLOADED_UNIT = 15
    # Kept: the call routes tokens or copies a value to the host (NOTE: [Routing is served from
    # the forward] in csrc/policy/policy.cpp).
    ROUTES_TOKENS = 16

    @property
    def text(self) -> str:
        return C.reason_text(int(self))


# A decision crosses as one int64 (csrc/bindings/rule_calls.h): outcome in bits 0-7, reason in 8-15, two
# warning flags, and the selecting unit's id + 1 (0: none) from bit 32.
DECISION_MUTATING_IN_KEPT_UNIT = 1 << 16
DECISION_RANDOM_CALL_OF_KEPT_OP = 1 << 17
# What the caller knows of a call (the `facts` argument of the deciding functions).
FACT_DRAWS_RANDOM = 1
FACT_CASTS_A_PARAMETER = 2
FACT_ROUTES_TOKENS = 4
# The caller does not say whether the call routes tokens: C++ answers from the op alone (topk,
# sort, argsort, argmax, nonzero, unique, .item() always route; _to_copy to the CPU needs the
# arguments).
FACT_ROUTING_FROM_OP = 8


class ModeAction(enum.IntEnum):
    """What mode_call_begin answers for a call (C++ sac::ModeAction, csrc/dispatch/mode_engine.h)."""

    RUN_ONLY = 0
    RUN_AND_RECORD = 1
    RUN_AND_KEEP = 2
    SERVED = 3
    # Added to a run action: the call runs on the tensors that come back with the answer (NOTE:
    # [The recompute writes nothing outside its region] in csrc/dispatch/outside_writes.cpp).
    REDIRECTED = 4


class ModePass(enum.IntEnum):
    """The pass boundaries mode_region_pass drives (C++ sac::ModePass)."""

    BEGIN_FORWARD = 0
    END_FORWARD = 1
    BEGIN_RECOMPUTE = 2
    END_RECOMPUTE = 3


# c10::MemoryFormat's values: the fallback's stack holds a memory format as this int, and an `Any`
# argument cannot take a torch.memory_format. dtypes and layouts travel as ints by themselves.
MEMORY_FORMATS = {
    torch.contiguous_format: 0,
    torch.preserve_format: 1,
    torch.channels_last: 2,
    torch.channels_last_3d: 3,
}
