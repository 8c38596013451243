"""The one way into the compiled plugin: loading it, the C ABI's signatures and the enums mirrored
from C++, under one ABI-version check.

Python reaches the library three ways, all set up here: `torch.ops.sac.*` (stateless ops) and
`torch.classes.sac.*` (objects with a lifetime), registered by `torch.ops.load_library`, and the C
ABI (csrc/bindings/c_api.h) through ctypes for the hot paths, bound as `lib`. Every other module
calls `lib.sac_*` or the ops; none loads, binds or declares anything itself, so a signature or an
enum value that changes in C++ changes in one place here.
"""

from __future__ import annotations

import ctypes
import enum
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
    """Loads the library, binds its C ABI as `lib` and installs the interception.

    Returns:
        Why the native engine cannot run here (the interception could not be installed), or None
        when it can.

    Raises:
        ImportError: torch is too old, or the library is missing, built for another torch or
            with another C ABI than this package expects.
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
    # The native fallback, or per-op kernels beside another owner of the key; if neither can be
    # installed, the dispatch-mode engine runs instead (_engine.choose_engine says so once).
    _bind(path)
    try:
        torch.ops.sac.install_fallback()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def interception_path() -> str:
    """How the plugin receives ops.

    Returns:
        "native" (its own fallback on the dispatch key) or "coexisting" (per-op kernels beside
        another library's fallback on the same key).
    """
    return torch.ops.sac.interception_path()


# --- The C ABI (csrc/bindings/c_api.h) ------------------------------------------------------------

# kSacCApiVersion: bumped in C++ when a signature or a meaning changes.
C_API_VERSION = 9

_c_int32, _c_int64, _c_pointer, _c_string = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p
# Every C function Python calls but the version (which _bind reads first): name -> (restype,
# argtypes), so that ctypes converts and checks them.
_SIGNATURES = {
    # Sites, regions and units (the scopes).
    "sac_site_new": (_c_pointer, [_c_pointer, _c_string, _c_int32]),
    "sac_site_outside_writes": (_c_int32, [_c_pointer]),
    "sac_site_release": (None, [_c_pointer]),
    "sac_region_new": (_c_pointer, [_c_pointer]),
    "sac_region_release": (None, [_c_pointer]),
    "sac_region_enter": (_c_int64, [_c_pointer, _c_int32]),
    "sac_region_exit": (_c_int32, [_c_pointer, _c_int32, _c_int64]),
    "sac_region_forward_position": (_c_int64, [_c_pointer]),
    "sac_region_release_unreached": (_c_int64, [_c_pointer, _c_int64]),
    "sac_site_dead_calls": (_c_int32, [_c_pointer]),
    "sac_region_watch_saves": (_c_int32, [_c_pointer]),
    "sac_region_note_saved": (None, [_c_pointer, ctypes.c_size_t]),
    "sac_unit_id": (_c_int64, [_c_string, _c_int64]),
    "sac_unit_push": (_c_int64, [_c_int64]),
    "sac_unit_pop": (_c_int32, [_c_int64, _c_int64]),
    "sac_scope_last_error": (_c_string, []),
    # The region scopes as a Python type written in C (NOTE: [Scopes as a C type]).
    "sac_python_scope_types": (ctypes.py_object, []),
    # The keep rule.
    "sac_op_entry": (_c_pointer, [_c_string, _c_int64]),
    "sac_call_decider_new": (_c_pointer, [_c_pointer]),
    "sac_call_decider_release": (None, [_c_pointer]),
    "sac_call_decider_decide": (
        _c_int64,
        [_c_pointer, _c_pointer, _c_int32, ctypes.POINTER(_c_int64), _c_int64, _c_int32],
    ),
    "sac_policy_decide": (
        _c_int64,
        [_c_pointer, _c_pointer, ctypes.POINTER(_c_int64), _c_int64, _c_int64, _c_int32],
    ),
    "sac_reason_text": (_c_string, [_c_int32]),
    # Where an offloaded call's outputs live.
    "sac_offload_placement": (_c_int32, [_c_int64] * 4),
}

# The bound C ABI, set by load(); `lib.sac_region_enter(...)` and so on.
lib: ctypes.PyDLL | None = None
# The module of the region scope type (csrc/bindings/python_scopes.cpp), set by load():
# new_region_scopes, adopt_forward_scope, set_recompute_above_modes and the RegionScope type.
scope_types = None


def _bind(path: Path) -> None:
    global lib
    if lib is not None:
        return
    # ctypes on the path torch.ops.load_library loaded returns that very library (dlopen hands
    # back the loaded object), so a SAC_PLUGIN_LIBRARY build serves these calls too. PyDLL: the
    # calls keep the GIL (CDLL would release and retake it around each one, which cost more than
    # the call itself); none of them calls back into Python or blocks.
    bound = ctypes.PyDLL(str(path))
    # The version first: a library of another version may lack a function declared below.
    bound.sac_scope_c_api_version.restype = _c_int32
    bound.sac_scope_c_api_version.argtypes = []
    version = bound.sac_scope_c_api_version()
    if version != C_API_VERSION:
        raise ImportError(
            f"sac_plugin: {path} has scope C ABI version {version}, this package expects "
            f"{C_API_VERSION}; rebuild the library from the same source as the package"
        )
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(bound, name)
        function.restype = restype
        function.argtypes = argtypes
    if bound.sac_reason_text(len(Reason) - 1) is None or bound.sac_reason_text(len(Reason)) is not None:
        raise ImportError(
            f"sac_plugin: {path} names a different set of keep reasons than "
            f"sac_plugin._native.Reason ({len(Reason)}); rebuild the library from the same source as the package"
        )
    lib = bound
    global scope_types
    scope_types = bound.sac_python_scope_types()


class ScopeStatus(enum.IntEnum):
    """How a C ABI call that can fail ended (C++ SacScopeStatus); the message is the library's
    sac_scope_last_error()."""

    OK = 0
    RUNTIME_ERROR = 1
    VALUE_ERROR = 2


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
        return lib.sac_reason_text(int(self)).decode()


# A decision crosses the C ABI as one int64 (c_api.h): outcome in bits 0-7, reason in 8-15, two
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
