"""benchmarks/bench_offload.py --simulate h200: the test accelerator timed as an H200, its copy
bandwidths derived from this CPU's matmul rate and the reference block's copy/compute ratio, and
printed as a simulation with its parameters."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.accelerator import SKIP_REASON, accelerator_environment

ROOT = Path(__file__).resolve().parents[2]


def _run(*arguments):
    env = accelerator_environment()
    return subprocess.run(
        [sys.executable, "benchmarks/bench_offload.py", *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_the_simulated_h200_sets_the_bandwidths_it_prints(tmp_path):
    out = tmp_path / "offload.json"
    done = _run(
        "--device",
        "sac_accel",
        "--simulate",
        "h200",
        "--dim",
        "64",
        "--heads",
        "4",
        "--seq",
        "64",
        "--steps",
        "1",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    simulation = json.loads(out.read_text())["simulation"]
    # The H200's bandwidth times this CPU's share of its FLOP rate, times the reference block's
    # FLOPs per activation byte over this block's (fp32 here, bf16 there).
    factor = (
        simulation["cpu_matmul_flops"]
        / 800e12
        * (64 * 64 * 4)
        / (4096 * 4096 * 2)
        * simulation["reference_flops"]
        / simulation["block_flops"]
    )
    assert simulation["bandwidth_to_device"] == pytest.approx(55e9 * factor, rel=1e-12)
    assert simulation["device"] == {
        "bandwidth_to_host": simulation["bandwidth_to_host"],
        "bandwidth_to_device": simulation["bandwidth_to_device"],
        "compute_scale": 1.0,
    }
    lines = done.stdout.splitlines()
    assert lines[0] == "SIMULATION of an H200 on the test accelerator (sac_accel), not a GPU measurement:"
    assert f"{simulation['bandwidth_to_device'] / 1e6:.2f} MB/s host to device" in lines[3]
    table = next(line for line in lines if line.startswith("llama block:"))
    assert table.endswith(", SIMULATED H200")
    rows = {line[:36].strip(): line[36:].split() for line in lines if line.startswith("offload attention + matmuls")}
    # held, ratio, host, peak, step, vs none, exposed ms, predicted exposed ms, vs kept, bitwise
    row = rows["offload attention + matmuls"]
    assert len(row) == 10 and row[-1] == "True"
    results = json.loads(out.read_text())["results"]
    predicted = results["offload attention + matmuls"]["predicted_exposed_copy_s"]
    # How much of the copies the model predicts to hide depends on the timings measured: the
    # printed column is the JSON's figure, whatever it is.
    assert predicted >= 0 and row[7] == f"{predicted * 1e3:.1f}"
    assert results["no checkpointing"]["predicted_exposed_copy_s"] == 0.0
    assert any(
        line.startswith("exposed copy time (offload minus keep, same calls):") and "step ratio offload / keep" in line
        for line in lines
    )


def test_simulating_off_the_test_accelerator_is_refused_by_name():
    done = _run("--device", "cpu", "--simulate", "h200")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("--simulate runs on the test accelerator (--device sac_accel), got --device cpu")
    )
