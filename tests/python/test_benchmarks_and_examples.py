"""The demo (examples/) and the benchmarks (benchmarks/) run and print their tables (tiny sizes; no
timing is asserted)."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def benchmarks_common():
    """benchmarks/_common.py, the helpers the benchmarks share, as the benchmarks see it."""
    spec = importlib.util.spec_from_file_location("benchmarks_common", ROOT / "benchmarks" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def private_sac_plugin_names(path: Path) -> set[str]:
    """Every sac_plugin name the file reaches that has a component starting with "_" (imported, or
    read as an attribute of the imported module), dotted in full: "sac_plugin.report._x"."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "sac_plugin":
                    # `import sac_plugin.x as y` binds y to sac_plugin.x; `import sac_plugin.x` binds sac_plugin.
                    aliases[alias.asname or "sac_plugin"] = alias.name if alias.asname else "sac_plugin"
                    names.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sac_plugin":
            for alias in node.names:
                names.add(f"{node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                names.add(".".join([aliases[inner.id], *reversed(chain)]))
    return {name for name in names if any(part.startswith("_") for part in name.split("."))}


def test_benchmarks_and_examples_use_the_public_api():
    found = {}
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")]):
        for name in private_sac_plugin_names(path):
            found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert found == {}


def run_tool(*args):
    env = dict(os.environ)  # the sac_plugin this test imports: installed, or on PYTHONPATH
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_demo_prints_identical_losses():
    out = run_tool("examples/demo.py", "--steps", "2", "--dim", "64", "--layers", "2", "--seq", "32", "--batch", "2")
    assert "losses identical across modes at every step: True" in out
    assert "selective (attn kept)" in out
    # The per-layer report is part of every run's output (the chart only with --report).
    assert "per-layer report, selective (attn kept), one more step on the last batch:" in out
    assert "no chart" not in out and "sac_report.png" not in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,config",
    [("dense", None), ("moe", "examples/configs/moe_routing.yaml"), ("dense", "examples/configs/dense_attn.json")],
)
def test_demo_takes_a_model_and_a_config(model, config):
    args = [
        "examples/demo.py",
        "--model",
        model,
        "--steps",
        "1",
        "--dim",
        "64",
        "--layers",
        "2",
        "--seq",
        "32",
        "--batch",
        "2",
    ] + (["--config", config] if config else [])
    out = run_tool(*args)
    assert "losses identical across modes at every step: True" in out
    assert ("moe_gate, moe_dispatch kept" in out) == (model == "moe")


@pytest.mark.slow
def test_overhead_benchmark_prints_its_ratios():
    # Each path in its own process (the coexisting one needs the test owner library tools/test.sh
    # points SAC_TEST_FOREIGN_OWNER at), one small layer stack for the attention-core table. Two
    # fixed rounds (--reps), the fewest that give every statistic the tables print, and with them
    # 100 steps of the per-region set-up instead of 1,000: what is checked is the output's shape.
    out = run_tool(
        "benchmarks/bench_overhead.py",
        "--sizes",
        "16",
        "--reps",
        "2",
        "--steps-per-sample",
        "1",
        "--layers",
        "16 layers of 16x16 ops",
    )
    assert out.count("intercepted per step: forward + recompute; 2 rounds of 1 step)") == 3
    assert "plugin overhead / torch SAC overhead, same kept list" in out
    assert "plugin with nothing kept / full recompute" in out
    assert out.count("per-region set-up in the step: ") == 3
    for path in ("native", "coexisting", "dispatch_mode"):
        assert f"#### path: {path} " in out, path
    assert "16 layers of 16x16 ops, attention core kept" in out


@pytest.mark.slow
def test_memory_benchmark_finds_no_more_bytes_than_torch_sac():
    # The tool exits non-zero when the plugin holds more bytes than torch's SAC.
    out = run_tool("benchmarks/bench_memory.py", "--dims", "64", "--seqs", "32", "--heads", "4")
    assert "attention + matmuls kept" in out and " NO " not in out


@pytest.mark.slow
def test_block_benchmark_prints_every_mode():
    out = run_tool("benchmarks/bench_block.py", "--dim", "64", "--heads", "4", "--seq", "32", "--steps", "1")
    for mode in ("no checkpointing", "full recompute", "attention kept, torch SAC", "attention kept, sac_plugin"):
        assert mode in out


@pytest.mark.slow
def test_demo_report_prints_the_per_layer_table_and_draws_it(tmp_path):
    png = tmp_path / "report.png"
    out = run_tool(
        "examples/demo.py",
        "--model",
        "moe",
        "--config",
        "examples/configs/moe_routing.yaml",
        "--steps",
        "1",
        "--dim",
        "64",
        "--layers",
        "2",
        "--seq",
        "32",
        "--batch",
        "2",
        "--report",
        "--report-png",
        str(png),
    )
    assert "per-layer report, selective (attn, moe_gate, moe_dispatch kept), one more step on the last batch:" in out
    for line in ("layers.0 ", "layers.1 ", "  unit moe_gate ", "by place (each storage once per life):"):
        assert line in out
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (tools/setup.sh installs it)")
    assert f"per-layer chart: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_torchtitan_benchmark_prints_both_modes():
    pytest.importorskip(
        "torchtitan.distributed.activation_checkpoint",
        reason="torchtitan is not importable: tools/setup.sh installs torchtitan 0.3.0, which needs torch >= 2.13",
    )
    out = run_tool("benchmarks/bench_torchtitan.py", "--layers", "1", "--seq", "16", "--samples", "1")
    for mode in ("none", "torchtitan SAC", "sac_plugin", "step ratio sac_plugin / torchtitan SAC"):
        assert mode in out


@pytest.mark.native_engine(
    "bench_budget maps each plan to torch_remat regions through sac_plugin.trace, which "
    "reads the native engine's kept calls"
)
def test_budget_benchmark_quick_prints_every_column_and_writes_its_plots(tmp_path):
    common = benchmarks_common()
    remat = common.have_torch_remat()
    traceable = common.why_trace_cannot_run() is None  # the plan -> torch_remat mapping traces the plan
    plots = tmp_path / "new" / "plots"  # a directory the benchmark makes
    out = run_tool(
        "benchmarks/bench_budget.py", "--quick", "--json", str(tmp_path / "budget.json"), "--plot-dir", str(plots)
    )
    assert sorted(path.name for path in plots.iterdir()) == ["plan_llama_64x32.png", "plan_moe_64x32.png"]
    assert out.startswith("command: ") and "benchmarks/bench_budget.py --quick" in out.splitlines()[0]
    assert "solver: a 1,000-call profile planned in" in out
    for model in ("llama", "moe"):
        assert f"{model} layer, dim 64, seq 32, batch 2, heads 4" in out
    header = [line for line in out.splitlines() if line.startswith("mode ")]
    assert len(header) == 2 and all(
        h.split() == ["mode", "held", "MiB", "predicted", "off", "step", "ms", "fits", "0.25"] for h in header
    )
    rows = [
        "no checkpointing",
        "full recompute",
        "attention kept",
        "attention + every other mm",
        "attention + all mm",
        "units",
        "plan 0.25 (",
        "torch.compile budget 0.25",
    ]
    rows += ["torch_remat, plan 0.25's modules"] if remat and traceable else []
    lines = out.splitlines()
    for row in rows:
        found = [line for line in lines if line.startswith(row)]
        assert len(found) == 2, row  # one per layer
        for line in found:
            cells = line[34:].split()
            assert len(cells) == 5 and cells[3].replace(".", "").isdigit() and cells[4] in ("yes", "NO"), line
    plan_lines = [line for line in lines if line.startswith("plan 0.25 (")]
    assert all(line[34:].split()[2] == "0.0%" for line in plan_lines)  # predicted == measured
    assert out.count("verdict (plan <= best fitting hand-written when the head-to-head ratio <= 1.05):") == 2
    assert out.count("  budget 0.25: best fitting hand-written: ") == 2 and "plan <= best: " in out
    if remat and traceable:
        assert out.count("  torch_remat 0.25 regions: ") == 2
    elif remat:
        assert "torch_remat rows are left out: mapping a plan to its regions needs sac_plugin.trace" in out
    else:
        assert "torch_remat is not installed" in out
    assert "\nwall time: " in out
    import json

    data = json.loads((tmp_path / "budget.json").read_text())
    assert [(r["model"], r["budget"]) for r in data["rows"]] == [("llama", 0.25), ("moe", 0.25)]
    for r in data["rows"]:
        assert r["plan_fits"] and r["plan_measured_bytes"] == r["plan_predicted_bytes"] <= r["budget_bytes"]
        assert set(r["hand"]) == {"attention kept", "attention + every other mm", "attention + all mm", "units"}
        assert r["compile"]["bytes"] > 0 and r["compile"]["step_s"] > 0
        assert ("torch_remat" in r) == (remat and traceable)
        assert r["tolerance"] == 0.05 and (r["plan_le_best"] is None) == (r["best_fitting_hand"] is None)


@pytest.mark.slow
def test_llama_benchmark_prints_every_mode_bitwise():
    pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
    import sac_plugin
    import torch

    args = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128", "--steps", "3"]
    out = run_tool("benchmarks/bench_llama.py", *args, "--warmup", "1")
    lines = out.splitlines()
    assert lines[0].startswith("command: ") and lines[0].endswith(
        " ".join(["benchmarks/bench_llama.py", *args, "--warmup", "1"])
    )
    assert lines[1].startswith("date: ") and lines[1].endswith(f" UTC; torch {torch.__version__}")
    assert lines[2].startswith("machine: ")
    assert "first step bitwise (loss and every gradient) across modes: yes" in lines
    assert "3 interleaved rounds of one step per mode; " in out
    header = lines.index("mode                           step ms  vs torch SAC   vs none  held MiB")
    rows = lines[header + 2 : header + 7]
    modes = ["no checkpointing", "full recompute", "torch SAC", "sac_plugin, same kept ops", "sac_plugin, plan"]
    assert [row[:28].strip() for row in rows] == modes
    cells = {row[:28].strip(): row[28:].split() for row in rows}
    assert all(len(values) == 4 for values in cells.values())
    assert cells["torch SAC"][1] == "1.000" and cells["no checkpointing"][2] == "1.000"
    held = {mode: values[3] for mode, values in cells.items()}
    assert float(held["full recompute"]) < float(held["torch SAC"]) < float(held["no checkpointing"])
    if sac_plugin.engine() == "native":
        assert float(held["full recompute"]) < float(held["sac_plugin, plan"]) < float(held["no checkpointing"])
        assert float(held["sac_plugin, same kept ops"]) <= float(held["torch SAC"])
    else:  # its kept outputs are not counted: the tool says so rather than print full recompute's bytes
        assert held["sac_plugin, plan"] == held["sac_plugin, same kept ops"] == "-"
        assert "held -: track_activation_memory counts the kept outputs of the native engine's regions only" in out


@pytest.mark.slow
def test_llama_benchmark_names_the_modes_that_differ():
    pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
    import torch

    # bench_llama imports _common by name, as when it runs from benchmarks/; the test leaves
    # neither the path nor that module behind.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_llama", ROOT / "benchmarks" / "bench_llama.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("_common", None)
    one, next_float = torch.tensor(1.0), torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))

    def step(loss, grad):
        return {"loss": loss, "grads": {"w": grad, "b": one}}

    first = {
        "no checkpointing": step(one, one),
        "full recompute": step(one, one),
        "torch SAC": step(next_float, one),
        "sac_plugin, plan": step(one, next_float),
    }
    assert bench.mismatches(first) == [
        "torch SAC: loss 1.0000001192092896 != 1.0",
        "sac_plugin, plan: gradients differ in w",
    ]
