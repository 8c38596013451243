"""One summary line for a CI job (.ci/run): its torch, build time, test results and verdict.

Test results come from the structured files the job's scripts write into its results folder
(SAC_TEST_RESULTS_DIR, see tools/lib.sh): ctest's JUnit XML (ctest.xml) and one JUnit XML per
pytest run (pytest-N.xml). The console log only gives what no result file holds: the torch a build
was made against and how long it took, the lint job's own lines and the soak's RSS line.

    python tools/ci_summary.py NAME LOG RESULTS_DIR EXIT_CODE SECONDS
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# Failed tests named in the line, at most; the rest are counted.
MAX_NAMED_FAILURES = 8


def read_junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """(counts of passed, failed, skipped, tests; ids of the failed ones) from one JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "tests": 0}
    failed = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            counts["failed"] += 1
            classname = case.get("classname", "")
            failed.append(f"{classname}::{case.get('name')}" if classname else str(case.get("name")))
        elif "skipped" in outcome or case.get("status") in ("notrun", "disabled"):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failed


def summarize(name: str, log: str, results: Path, rc: int, seconds: str) -> str:
    text = Path(log).read_text(errors="replace")
    torch = re.findall(r"built against torch (\S+)", text)
    build = re.findall(r"built against torch \S+ .*?in (\d+) s", text)
    parts = [
        f"torch {torch[-1] if torch else '(installed)'}",
        f"build {build[-1] + ' s' if build else ('none' if rc == 0 else 'failed or not run')}",
    ]
    failures: list[str] = []
    ctest_file = results / "ctest.xml"
    if ctest_file.is_file():
        counts, failed = read_junit(ctest_file)
        parts.append(f"ctest {counts['passed']} passed {counts['failed']} failed")
        failures += failed
    else:
        parts.append("no ctest" if rc == 0 else "ctest not run")
    runs = sorted(results.glob("pytest-*.xml"))
    if runs:
        # Every pytest run of the job (tools/test.sh runs the suite once per engine), added up.
        total = {"passed": 0, "failed": 0, "skipped": 0, "tests": 0}
        for run in runs:
            counts, failed = read_junit(run)
            total = {key: total[key] + counts[key] for key in total}
            failures += [f for f in failed if f not in failures]
        if total["tests"] == 0:
            parts.append("pytest collected no tests")
        else:
            parts.append(
                f"pytest {total['passed']} passed {total['failed']} failed {total['skipped']} skipped "
                f"({len(runs)} runs)"
            )
    else:
        parts.append("pytest not run")
    lint = re.findall(r"^lint: (.*)$", text, re.M)
    if lint:  # the lint job builds and tests nothing: its own lines are the summary
        parts = lint
    if failures:
        more = len(failures) - MAX_NAMED_FAILURES
        parts.append("failed: " + " ".join(failures[:MAX_NAMED_FAILURES]) + (f" and {more} more" if more > 0 else ""))
    soak = re.findall(r"^soak: (.*)$", text, re.M)
    if soak:
        parts.append(soak[-1])
    verdict = "ok" if rc == 0 else f"FAILED (exit {rc})"
    return f"{name:<13} " + ", ".join(parts) + f"; {seconds} s in all: {verdict}"


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    job, log_path, results_dir, exit_code, elapsed = sys.argv[1:]
    print(summarize(job, log_path, Path(results_dir), int(exit_code), elapsed))
