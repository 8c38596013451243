"""Prints the requirements of the development environment, as pyproject.toml declares them.

    python tools/dev_requirements.py [--no-deps] [--missing]

pyproject.toml is the one list of pins: tools/setup.sh installs what this prints, and nothing
else. Without --no-deps: the build backend's requirements ([build-system] requires, since the
package builds without isolation) and every extra in [project.optional-dependencies], to be
installed with their dependencies. With --no-deps: [tool.sac_plugin] dev-no-deps, the packages
installed without their dependencies (a package whose dependencies would require another torch).
With --missing, only the requirements the running Python's environment does not satisfy, so a
second run of the setup installs nothing. One requirement per line, sorted, each once.

Runs on the venv's Python before anything is installed there, so it imports only what every
Python >= 3.10 with pip has: tomllib (or pip's vendored tomli on 3.10) and pip's vendored packaging.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared(no_deps: bool, pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements pyproject.toml declares for the development environment."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    if no_deps:
        found = data.get("tool", {}).get("sac_plugin", {}).get("dev-no-deps", [])
    else:
        found = list(data["build-system"]["requires"])
        for requirements in data["project"].get("optional-dependencies", {}).values():
            found.extend(requirements)
    by_text = {str(Requirement(text)): None for text in found}  # one spelling each, in order
    return sorted(by_text, key=lambda text: canonicalize_name(Requirement(text).name))


def satisfied(text: str) -> bool:
    """Whether the installed distribution meets the requirement's version (its extras' own
    requirements are listed separately in pyproject.toml where they matter)."""
    requirement = Requirement(text)
    if requirement.marker is not None and not requirement.marker.evaluate():
        return True  # not for this environment
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        return False
    return requirement.specifier.contains(installed, prereleases=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-deps", action="store_true", help="the packages installed without their dependencies")
    parser.add_argument("--missing", action="store_true", help="only those this environment does not satisfy")
    args = parser.parse_args(argv)
    for text in declared(args.no_deps):
        if not (args.missing and satisfied(text)):
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
