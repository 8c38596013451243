"""Loads the compiled plugin once, with errors that say what to do."""

from __future__ import annotations

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
    """Loads the library and installs the interception; returns why the native engine cannot run
    here (the interception could not be installed), or None when it can."""
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
