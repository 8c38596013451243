"""python -m sac_plugin plan: the layers it plans (reference, transformers config, a factory of
yours), its budget spellings, its progress on stderr, its help, and optional dependencies named
with their extras before any work."""

import json
import os
import subprocess
import sys

import pytest

import sac_plugin
from sac_plugin.__main__ import build_parser, main
from sac_plugin.planner import PlanError

SMALL = ["--seq", "16", "--batch", "1", "--runs", "2"]


def test_a_reference_layer_within_bytes_with_a_unit(tmp_path, capsys):
    assert (
        main(
            ["plan", "--model", "llama", "--dim", "32", *SMALL, "--budget", "64KiB", "--save", str(tmp_path / "p.json")]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "Plan(budget=65536: 0.06 MiB" in out
    assert sac_plugin.Plan.load(tmp_path / "p.json").budget == 65536
    progress = [line for line in err.splitlines() if line.startswith("profiling llama layer (run ")]
    assert progress == [
        "profiling llama layer (run 1 of 6: warmup)...",
        "profiling llama layer (run 2 of 6: counting bytes)...",
        "profiling llama layer (run 3 of 6: counting bytes)...",
        "profiling llama layer (run 4 of 6: counting bytes)...",
        "profiling llama layer (run 5 of 6: timed)...",
        "profiling llama layer (run 6 of 6: timed)...",
    ]


def test_a_transformers_config_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # The folder holding config.json, or the file itself.
    assert main(["plan", "--hf-config", str(tmp_path / "config.json"), *SMALL, "--budget", "0.5"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("LlamaDecoderLayer (model.layers.0 of llama)")
    assert main(["plan", "--hf-config", str(tmp_path), *SMALL, "--budget", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "LlamaDecoderLayer (model.layers.0 of llama): seq 16, batch 1, cpu"
    assert "Plan(budget=0.5:" in out
    assert "running LlamaForCausalLM once to capture model.layers.0's inputs..." in err
    assert "profiling LlamaDecoderLayer (model.layers.0 of llama) (run 6 of 6: timed)..." in err


FACTORY = """
import torch

def make():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    return layer, (torch.randn(8, 16, requires_grad=True),)

def not_a_layer():
    return 3
"""


def test_a_factory_of_yours(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_factory_module.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "cli_factory_module:make", "--runs", "2", "--budget", "8KiB"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "Sequential (from cli_factory_module:make)"
    assert "Plan(budget=8192:" in out
    assert "building the layer cli_factory_module:make returns..." in err
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "cli_factory_module:not_a_layer"])
    assert exited.value.code == 2
    assert "--model 'cli_factory_module:not_a_layer' returned 3; expected package.module:function" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "1",
            "argument --budget: --budget=1 reads two ways: 1 byte, or the fraction 1.0 of the layer's "
            "no-checkpointing activation bytes; pass a fraction as a float from 0.0 to 1.0 (such as 1.0), or "
            "bytes as an int >= 2 or a string with a unit (such as '1B' or '512MiB')",
        ),
        (
            "lots",
            "argument --budget: --budget as a string must be bytes with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, "
            "TiB), such as '512MiB' or '1B', got 'lots'; pass a fraction as a float",
        ),
    ],
)
def test_a_budget_that_reads_two_ways_is_refused(text, message, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama", "--budget", text])
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m sac_plugin plan: error: {message}"


@pytest.mark.parametrize("budget", [0, 1, True, False])
def test_python_refuses_the_ints_that_read_two_ways(budget):
    from sac_plugin.planner._cost import check_budget

    n = int(budget)
    with pytest.raises(PlanError) as raised:
        check_budget(budget)
    assert str(raised.value) == (
        f"sac_plugin: budget={budget!r} reads two ways: {n} {'byte' if n else 'bytes'}, or the fraction {float(n)} "
        f"of the layer's no-checkpointing activation bytes; pass a fraction as a float from 0.0 to 1.0 (such as "
        f"{float(n)}), or bytes as an int >= 2 or a string with a unit (such as '{n}B' or '512MiB')"
    )


@pytest.mark.parametrize(
    "budget, value", [("512MiB", 512 << 20), ("1B", 1), ("0B", 0), ("1.5GB", 1_500_000_000), (0.0, 0.0), (2, 2)]
)
def test_python_takes_bytes_with_a_unit(budget, value):
    from sac_plugin.planner._cost import check_budget

    assert check_budget(budget) == value


def test_every_option_has_help_with_its_default():
    plan_parser = build_parser()._subparsers._group_actions[0].choices["plan"]
    options = [a for a in plan_parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) == 17
    formatter = plan_parser._get_formatter()
    for action in options:
        assert "(default: " in formatter._get_help_string(action), action.dest
    text = plan_parser.format_help()
    for default in ("(default: 256)", "(default: 2)", "(default: 5)", "(default: cpu)", "(default: 0.3)"):
        assert default in " ".join(text.split()), default


def _run_cli(arguments, blocked):
    code = f"import sys; sys.modules[{blocked!r}] = None; from sac_plugin.__main__ import main; sys.exit(main({arguments!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120)


def test_plot_without_matplotlib_names_the_extra_before_profiling(tmp_path):
    done = _run_cli(["plan", "--model", "llama", "--plot", str(tmp_path / "p.png")], "matplotlib")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "python -m sac_plugin: error: --plot needs matplotlib, which is not installed: pip install sac_plugin[plot]"
    )
    assert "profiling" not in done.stderr


def test_long_op_names_keep_the_table_in_columns(capsys):
    assert main(["plan", "--model", "llama", "--dim", "32", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    rows = lines[header + 1 : lines.index("", header)]
    assert any("~" in row[:47] for row in rows)  # aten::_scaled_dot_product_flash_attention_for_cpu, cut
    assert {row[48 + 14 + 6 + 6 + 9 + 10 + 9 + 10 : 48 + 14 + 6 + 6 + 9 + 10 + 9 + 10 + 2] for row in rows} == {"  "}


def test_yaml_configs_without_pyyaml_name_the_extra():
    code = (
        "import sys; sys.modules['yaml'] = None\n"
        "from sac_plugin.config import RecomputeConfig\n"
        "try:\n    RecomputeConfig.from_yaml('budget: 0.3')\nexcept ImportError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120)
    assert done.stdout.strip() == (
        "sac_plugin: RecomputeConfig.from_yaml needs pyyaml, which is not installed: pip install sac_plugin[yaml]"
    )


def _two_call_plan():
    from sac_plugin.planner import LayerProfile, Plan, ProfiledCall

    calls = (
        ProfiledCall("aten::mm", 0, "", 1000, 1.0e-3, ""),
        ProfiledCall("aten::mm", 1, "", 1000, 1.1e-3, ""),
    )
    # Room for one of the two calls over the 1000-byte floor: the plan keeps the slower one.
    return Plan.from_profile(LayerProfile(calls, 3000, 1000, 5), 2000)


def test_timings_too_noisy_to_separate_two_plans_are_said():
    from sac_plugin._cli_models import noise_line

    plan = _two_call_plan()
    assert plan.kept == {("aten::mm", 1)}
    # The plans keeping mm #1 or mm #0 differ by 0.1 ms of 1.1: a 5% spread separates them, 20% does not.
    assert noise_line(plan, 0.05) is None
    assert noise_line(plan, 0.2) == (
        "timings too noisy to separate this plan from the next best (keeping aten::mm #0 instead of aten::mm #1): "
        "their predicted recompute times differ by 0.100 ms, under the 20% run-to-run spread of the layer's "
        "forward (more --runs, or a quieter machine, may separate them)"
    )
    assert noise_line(plan, None) is None


@pytest.mark.parametrize(
    "arguments, message",
    [
        ([], "give one of --model, --hf-config, --hf-model-type (the layer to plan), got none"),
        (
            ["--model", "llama", "--hf-model-type", "llama"],
            "give one of --model, --hf-config, --hf-model-type (the layer to plan), got 2: --model, --hf-model-type",
        ),
        (
            ["--model", "os:getcwd", "--dim", "64"],
            "--dim: a factory's layer comes sized (--model os:getcwd); drop them",
        ),
        (
            ["--hf-config", "/nonexistent-folder"],
            "--hf-config '/nonexistent-folder': no such file (a config.json, or a folder holding one)",
        ),
        (
            ["--hf-model-type", "llama", "--peak", "8GiB"],
            "--peak plans a reference model's training step: pass --model llama or --model moe",
        ),
    ],
)
def test_the_layer_to_plan_is_named_once(arguments, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", *arguments])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m sac_plugin: error: {message}"


def test_a_plan_files_int_is_bytes_and_with_budget_takes_a_unit():
    from sac_plugin.planner import Plan

    plan = _two_call_plan()
    data = plan.to_dict()
    # JSON writes 1 and 1.0 apart: a file's 1 is one byte (a plan that keeps nothing, under its floor).
    data.update(budget=1, kept=[])
    assert Plan.from_dict(data).budget == 1
    data["budget"] = -5
    with pytest.raises(PlanError) as raised:
        Plan.from_dict(data)
    assert str(raised.value).endswith("budget as bytes must be an int from 0 to 2**63 - 1, got -5")
    assert plan.with_budget("2000B").budget_bytes == 2000
    assert plan.with_budget("2000B").kept == plan.kept
