"""CI's summary line (tools/ci_summary.py) reads the jobs' JUnit XML, written by real pytest and ctest runs."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ci_summary", ROOT / "tools" / "ci_summary.py")
ci_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ci_summary)

SUITE = """
import pytest

def test_passes():
    pass

@pytest.mark.parametrize("case", ["a b"])
def test_fails(case):
    assert case == "c"

def test_skips():
    pytest.skip("not here")
"""


def run_pytest_into(results: Path, index: int, tmp_path: Path) -> None:
    suite = tmp_path / "suite" / "test_suite.py"
    suite.parent.mkdir(exist_ok=True)
    suite.write_text(SUITE)
    results.mkdir(exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(suite),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={results / f'pytest-{index}.xml'}",
        ],
        cwd=suite.parent,
        capture_output=True,
        timeout=300,
    )


def test_pytest_runs_are_added_up_and_the_failed_tests_named(tmp_path):
    results = tmp_path / "results"
    run_pytest_into(results, 1, tmp_path)
    run_pytest_into(results, 2, tmp_path)
    log = tmp_path / "job.log"
    log.write_text("build: sac_plugin built against torch 2.13.0+cpu in 7 s (build tree x)\n")
    line = ci_summary.summarize("default", str(log), results, 1, "12")
    assert line == (
        "default       torch 2.13.0+cpu, build 7 s, "
        "ctest not run, pytest 2 passed 2 failed 2 skipped (2 runs), "
        "failed: test_suite::test_fails[a b]; 12 s in all: FAILED (exit 1)"
    )


@pytest.mark.skipif(
    shutil.which("ctest") is None or not os.environ.get("SAC_TEST_BUILD_DIR"),
    reason="needs ctest and the C++ build tree (SAC_TEST_BUILD_DIR, which tools/test.sh sets)",
)
def test_ctest_results_are_read_from_its_junit_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    subprocess.run(
        [
            "ctest",
            "--test-dir",
            os.environ["SAC_TEST_BUILD_DIR"],
            "-R",
            "^check_layers$",
            "--output-junit",
            str(results / "ctest.xml"),
        ],
        capture_output=True,
        timeout=300,
        check=True,
    )
    log = tmp_path / "job.log"
    log.write_text("")
    line = ci_summary.summarize("asan", str(log), results, 0, "3")
    assert (
        line == "asan          torch (installed), build none, ctest 1 passed 0 failed, pytest not run; 3 s in all: ok"
    )


def test_a_job_without_result_files_says_what_did_not_run(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("lint: import contracts kept\nlint: docs built\n")
    assert ci_summary.summarize("lint", str(log), tmp_path / "none", 0, "5") == (
        "lint          import contracts kept, docs built; 5 s in all: ok"
    )
    log.write_text("soak: 10 steps, RSS growth +0.0 MiB\n")
    assert ci_summary.summarize("soak", str(log), tmp_path / "none", 2, "5") == (
        "soak          torch (installed), build failed or not run, ctest not run, pytest not run, "
        "10 steps, RSS growth +0.0 MiB; 5 s in all: FAILED (exit 2)"
    )
