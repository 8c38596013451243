"""tools/gpu_check.sh fits a short slot on one GPU: its step budgets add up to at most 8 minutes, every
step draws on one of them, and the steps run in the order that matters (the CUDA tests, then what
goes below full recompute, then the benchmarks). NOTE: [The GPU check's time budget] in the
script says why."""

import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.accelerator import SKIP_REASON, accelerator_environment

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
LIMIT_S = 480


def _budgets(text):
    block = re.search(r"^declare -A budget=\(\n(.*?)^\)", text, re.S | re.M)
    assert block, "gpu_check.sh declares no budget table (declare -A budget=( ... ))"
    entries = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    budgets = {}
    for entry in entries:
        match = re.fullmatch(r"\[(\w+)\]=(\d+)", entry)
        assert match, f"not a [name]=seconds entry of the budget table: {entry!r}"
        budgets[match.group(1)] = int(match.group(2))
    return budgets


def _steps(text):
    """(budget, name) of every step the script runs, in the order they appear."""
    joined = text.replace("\\\n", " ")
    steps = []
    for line in joined.splitlines():
        code = line.strip()
        if code.startswith("#") or code.startswith("step()"):
            continue
        for part in code.split("&&"):
            if part.strip().startswith("step "):
                words = shlex.split(part)
                steps.append((words[1], words[2]))
    return steps


def test_the_step_budgets_add_up_to_at_most_eight_minutes():
    budgets = _budgets(SCRIPT.read_text())
    assert sum(budgets.values()) <= LIMIT_S, budgets
    assert all(seconds > 0 for seconds in budgets.values()), budgets


def test_every_step_draws_on_a_budget_and_every_budget_has_a_step():
    text = SCRIPT.read_text()
    budgets, steps = _budgets(text), _steps(text)
    assert {key for key, _ in steps} == set(budgets), (steps, budgets)
    # Only step() runs commands under a time limit: no other `timeout` adds to the total.
    timeouts = [line for line in text.splitlines() if re.search(r"(^|\s)timeout\s", line.split("#")[0])]
    assert timeouts == ['  timeout "$limit" "$@"'], timeouts


def test_the_cuda_tests_run_first_then_what_goes_below_full_recompute_then_the_benchmarks():
    keys = [key for key, _ in _steps(SCRIPT.read_text())]
    first = {key: keys.index(key) for key in keys}
    assert keys[0] == "build"
    assert first["build"] < first["cuda_tests"] < first["offload_inputs"] < first["plan_step"]
    benchmarks = ["overhead", "memory", "block", "offload", "memory_budget"]
    assert all(first["plan_step"] < first[key] for key in benchmarks), keys


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
@pytest.mark.parametrize(
    "check, feature, available",
    [
        (
            "offload-inputs",
            "layer inputs offloaded",
            lambda sac_plugin: "offload_inputs" in inspect.signature(sac_plugin.Policy).parameters,
        ),
        ("plan-step", "plan_step", lambda sac_plugin: hasattr(sac_plugin, "plan_step")),
    ],
)
def test_the_feature_steps_run_or_say_they_are_not_available(check, feature, available):
    import sac_plugin

    env = accelerator_environment()
    done = subprocess.run(
        [
            sys.executable,
            "tools/gpu_check_features.py",
            check,
            "--device",
            "sac_accel",
            "--dtype",
            "float32",
            "--dim",
            "64",
            "--heads",
            "4",
            "--seq",
            "64",
            "--layers",
            "2",
            "--steps",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if available(sac_plugin):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        # tools/gpu_check.sh reports status 77 as "not available in this build".
        assert (done.returncode, done.stdout.splitlines()[0].split(" (")[0]) == (
            77,
            f"{feature}: not available in this build",
        ), done.stdout + done.stderr
