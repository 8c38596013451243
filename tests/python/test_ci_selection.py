"""Which runs a test module is in (NOTE: [Which runs a test module needs] in conftest.py): the
modules the sets name exist, their tests carry the marker tools/test.sh and CI select by, and a
module the sets do not name carries neither, so that it runs in every engine and on every torch."""

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

HERE = Path(__file__).resolve().parent


def test_every_module_the_sets_name_exists():
    modules = {path.stem for path in HERE.glob("test_*.py")}
    for named in (
        conftest.ENGINE_INDEPENDENT,
        conftest.TORCH_INDEPENDENT,
        conftest.STARTS_EACH_ENGINE,
        conftest.OVER_THE_ENGINES,
    ):
        assert sorted(named - modules) == []


def test_a_module_independent_of_the_torch_version_is_independent_of_the_engine():
    # The other torch versions run no engine-independent module in their two other engine runs
    # either; a module only the default torch runs must not need the other engines.
    assert sorted(conftest.TORCH_INDEPENDENT - conftest.ENGINE_INDEPENDENT) == []


def test_a_module_over_the_engines_or_starting_each_engine_runs_in_every_engine_run():
    # Both sets only narrow the other engines' runs: a module in them must be in none of the
    # engine-independent modules, which those runs leave out already.
    assert sorted((conftest.OVER_THE_ENGINES | conftest.STARTS_EACH_ENGINE) & conftest.ENGINE_INDEPENDENT) == []


# test_ci_summary.py (named in ENGINE_INDEPENDENT and TORCH_INDEPENDENT), test_install.py (in
# ENGINE_INDEPENDENT only), test_units.py (in no set), test_property.py (in OVER_THE_ENGINES) and
# test_dispatch_mode_data_flow.py (in STARTS_EACH_ENGINE).
COLLECTED = (
    "test_ci_summary.py",
    "test_install.py",
    "test_units.py",
    "test_property.py",
    "test_dispatch_mode_data_flow.py",
)


def collected(*args: str) -> list[str]:
    """The modules pytest selects from COLLECTED with `args`."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
        + [str(HERE / name) for name in COLLECTED],
        cwd=HERE.parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line.split("::")[0].rsplit("/", 1)[-1] for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize(
    "expression,modules",
    [
        # The coexisting and dispatch-mode runs.
        ("not engine_independent", {"test_units.py", "test_property.py", "test_dispatch_mode_data_flow.py"}),
        # The other torch versions.
        (
            "not torch_independent",
            {"test_install.py", "test_units.py", "test_property.py", "test_dispatch_mode_data_flow.py"},
        ),
        # Their coexisting and dispatch-mode runs.
        ("not engine_independent and not over_the_engines", {"test_units.py", "test_dispatch_mode_data_flow.py"}),
        # The dispatch-mode run.
        ("not engine_independent and not starts_each_engine", {"test_units.py", "test_property.py"}),
    ],
)
def test_the_markers_select_whole_modules(expression, modules):
    assert set(collected("-m", expression)) == modules


@pytest.mark.parametrize(
    "setting,message",
    [
        ("SAC_TEST_SUITE=every", "test: SAC_TEST_SUITE=every: expected all or torch-sensitive\n"),
        ("SAC_TEST_WORKERS=0", "test: SAC_TEST_WORKERS=0: expected a number of processes, 1 or more\n"),
    ],
)
def test_tools_test_refuses_a_bad_setting_before_it_installs_or_builds(setting, message, tmp_path):
    name, value = setting.split("=")
    # A venv of its own: were the setting read too late, the set-up would fill this one.
    done = subprocess.run(
        ["bash", str(HERE.parents[1] / "tools" / "test.sh")],
        env={**os.environ, name: value, "SAC_VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (1, "", message)
