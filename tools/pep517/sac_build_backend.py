"""sac_plugin's build backend: scikit-build-core, also where --no-build-isolation finds none.

sac_plugin builds without isolation (`pip install --no-build-isolation .`), so that it compiles
against the torch that will import it; pip then installs no build requirement at all. Where the
environment has scikit-build-core, this module is exactly it. Where it has not (a fresh venv
holding only torch), this module installs scikit-build-core into a private cache directory
(`pip install --target`, never into the environment itself: torch and everything else stay as
they are) and builds with it from there. Without scikit-build-core and without an index to fetch
it from, it stops with one line saying to install it.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

_REQUIREMENT = "scikit-build-core>=0.10"


def _private_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "sac_plugin" / "build-backend" / f"py{sys.version_info.major}.{sys.version_info.minor}"


def _backend():
    try:
        return importlib.import_module("scikit_build_core.build")
    except ImportError:
        pass
    target = _private_dir()
    if not (target / "scikit_build_core").is_dir():
        print(
            f"sac_plugin: scikit-build-core is not installed for {sys.executable}; "
            f"fetching it into {target} (the environment is left as it is)",
            file=sys.stderr,
        )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--target",
                str(target),
                "--upgrade",
                _REQUIREMENT,
            ],
            stdout=sys.stderr,
            stderr=subprocess.STDOUT,
            check=False,
        )
        if done.returncode != 0 or not (target / "scikit_build_core").is_dir():
            raise SystemExit(
                f"sac_plugin: scikit-build-core is not installed for {sys.executable} and could "
                f"not be fetched; install it (pip install '{_REQUIREMENT}') and build again"
            )
    sys.path.insert(0, str(target))
    return importlib.import_module("scikit_build_core.build")


def __getattr__(name: str):
    # Every PEP 517/660 hook is scikit-build-core's own; a hook it lacks stays missing.
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_backend(), name)
