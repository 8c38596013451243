"""Installing sac_plugin never changes the installed torch."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sac_plugin  # noqa: F401 - loads the library, whose ops the test asks
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("no_deps", [False, True], ids=["with deps", "no deps"])
def test_an_install_under_a_pin_that_excludes_the_installed_torch_leaves_torch_alone(tmp_path, no_deps):
    pin = tmp_path / "constraints.txt"
    pin.write_text("torch==2.0.0\n")  # a company pin or a lock file naming another torch
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--no-build-isolation",
        "--quiet",
        "--disable-pip-version-check",
        "--report",
        str(report),
        str(ROOT),
    ]
    if no_deps:
        command.insert(-1, "--no-deps")
    done = subprocess.run(
        command, env={**os.environ, "PIP_CONSTRAINT": str(pin)}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["sac_plugin"], installed


def test_the_package_metadata_requires_no_torch():
    from importlib.metadata import requires

    names = [re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0] for requirement in requires("sac_plugin") or []]
    assert "torch" not in names and names  # the optional extras are still declared
    # The torch the suite runs on is the one the library was compiled against (as it reports it).
    assert torch.ops.sac.built_for_torch() == torch.__version__
