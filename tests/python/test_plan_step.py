"""plan_step: a training step planned for a peak-memory budget. On the test accelerator, whose
allocator reports the exact peak: a budget between full recompute's peak and no checkpointing's
is used (layers keep calls) and the measured peak stays within it, with gradients bitwise those of
the unmodified model; a budget below full recompute's peak is a PlanError naming it; the plan
file round trip, a config with peak_bytes and `plan --peak`. Without an accelerator: the chooser
against every combination on small problems, the peak model's terms, the table and files, bad
input by name, leaving the model unchanged."""

import itertools
import json
import random

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, PlanError, RecomputeConfig, StepPlan
from sac_plugin.__main__ import main
from sac_plugin.models import Llama
from sac_plugin.planner import OffloadModel, Plan
from sac_plugin.planner._profile import LayerProfile, ProfiledCall
from sac_plugin.planner import _step
from sac_plugin.planner._profile import AFTER_THE_RECOMPUTE_STOPS
from sac_plugin.planner._step_peaks import LayerChoice, Window, choose, lowest_peak, window_peaks

from support.accelerator import SKIP_REASON, run_accelerator_program

pytestmark = pytest.mark.filterwarnings("ignore:sac. .*:UserWarning")

MiB = 1 << 20
AFTER = AFTER_THE_RECOMPUTE_STOPS


def profile_of(*calls, floor=0):
    """A profile of (op, bytes, milliseconds[, why not keepable]) calls in forward order."""
    counts, profiled = {}, []
    for op, size, ms, *why in calls:
        index = counts[op] = counts.get(op, -1) + 1
        reason = why[0] if why else ""
        profiled.append(ProfiledCall(op, index, "", size, ms / 1e3, reason, reason != AFTER))
    return LayerProfile(tuple(profiled), floor + sum(c.bytes for c in profiled), floor, 1)


def windows_of(forward, head, backward):
    """Windows in the step's order: each layer's forward, the head, each layer's backward in reverse."""
    return tuple(
        [Window("forward", j, p) for j, p in enumerate(forward)]
        + [Window("head", None, head)]
        + [Window("backward", j, backward[j]) for j in range(len(backward) - 1, -1, -1)]
    )


# --- the peak model and the chooser, on synthetic profiles ------------------------------------------


def test_the_peak_model_adds_what_each_window_holds_beyond_full_recompute():
    profile = profile_of(("aten::mm", 300, 2.0), ("aten::mm", 200, 1.0), ("aten::sum", 0, 0.5, AFTER), floor=100)
    model = OffloadModel(1e12, 1e12, min_bytes=0)
    keeps = Plan(profile, 1.0, frozenset({("aten::mm", 0)}), offload=model)  # keeps 300
    offloads = Plan(profile, 1.0, frozenset(), frozenset({("aten::mm", 1)}), offload=model)  # offloads 200
    first, second = LayerChoice("a", keeps), LayerChoice("b", offloads, offload_inputs=True, input_bytes=50)
    assert (first.delta, first.forward_extra, first.fetched_back) == (300, 300, 0)
    assert (second.delta, second.forward_extra, second.fetched_back) == (-50, 200, 250)
    assert (first.own_backward, first.head_extra, second.own_backward, second.head_extra) == (0, 0, 200, 50)
    windows = windows_of(forward=[1000, 1000], head=2000, backward=[3000, 3000])
    # forward a: its kept; forward b: a's 300, b's kept and offloaded; head: 300 - 50 and b's inputs
    # still copying; backward b: a's 300 and b's offloaded outputs back; backward a: nothing.
    assert window_peaks(windows, [first, second]) == [1300, 1500, 2300, 3500, 3000]
    # backward a (second): b's -50 and the 250 it fetches back; backward b (first): its own 200.
    assert window_peaks(windows, [second, first]) == [1200, 1250, 2250, 3200, 3200]


def test_offloading_inputs_lowers_the_peak_by_the_inputs_on_the_host_there():
    # Four layers of 1000-byte inputs, full recompute's peak in the last layer's backward (15000).
    # There the inputs of layers 0 and 1 are on the host (layer 2's is fetched back one layer
    # ahead), so offload reaches 13000, and no lower: layer 1's backward holds 13000 too.
    profile = profile_of(("aten::mm", 300, 2.0), ("aten::sum", 0, 0.5, AFTER), floor=100)
    plan = Plan.from_profile(profile, 1.0, offload=OffloadModel(1e12, 1e12, min_bytes=0))
    windows = windows_of(forward=[5000, 6000, 7000, 8000], head=6000, backward=[12000, 13000, 14000, 15000])
    with_offload = [_step._options(plan, f"layers.{j}", 1000, True, []) for j in range(4)]
    without = [_step._options(plan, f"layers.{j}", 1000, False, []) for j in range(4)]
    assert lowest_peak(windows, without) == 15000
    assert lowest_peak(windows, with_offload) == 15000 - 2 * 1000
    chosen = choose(windows, with_offload, 13000)
    assert [c.offload_inputs for c in chosen[:2]] == [True, True]  # layer 2's may go too: it comes back
    assert max(window_peaks(windows, chosen)) == 13000


def _random_problem(rng, layers):
    calls = [("aten::mm", rng.randrange(1, 400), rng.uniform(0.1, 3.0)) for _ in range(3)]
    profile = profile_of(*calls, ("aten::sum", 0, 0.5, AFTER), floor=rng.randrange(0, 100))
    model = OffloadModel(rng.uniform(2e5, 2e6), rng.uniform(2e5, 2e6), min_bytes=0)
    plan = Plan.from_profile(profile, 1.0, offload=model)
    options = [_step._options(plan, f"layers.{j}", rng.randrange(0, 200), True, []) for j in range(layers)]
    # Full recompute and a few others per layer: every combination stays cheap to list.
    options = [layer[:1] + rng.sample(layer[1:], min(6, len(layer) - 1)) for layer in options]
    windows = windows_of(
        [rng.randrange(500, 1500) for _ in range(layers)],
        rng.randrange(500, 2500),
        [rng.randrange(1000, 2500) for _ in range(layers)],
    )
    return windows, options


@pytest.mark.parametrize("seed", range(12))
def test_choose_finds_the_fastest_plan_within_the_peak_of_every_combination(seed):
    rng = random.Random(seed)
    windows, options = _random_problem(rng, layers=3)
    combinations = list(itertools.product(*options))
    peaks = {combo: max(window_peaks(windows, combo)) for combo in combinations}
    lowest = min(peaks.values())
    assert lowest_peak(windows, options) == lowest
    assert choose(windows, options, lowest - 1) is None
    for budget in (lowest, (lowest + max(peaks.values())) // 2, max(peaks.values())):
        chosen = choose(windows, options, budget)
        best = min(sum(o.overhead_seconds for o in combo) for combo in combinations if peaks[combo] <= budget)
        assert max(window_peaks(windows, chosen)) <= budget
        assert sum(o.overhead_seconds for o in chosen) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_the_first_option_of_each_layer_is_full_recompute():
    windows, options = _random_problem(random.Random(0), layers=2)
    for layer in options:
        full = layer[0]
        assert (full.plan.kept, full.plan.offloaded, full.offload_inputs, full.delta) == (
            frozenset(),
            frozenset(),
            False,
            0,
        )
        assert full.policy.keeps_nothing
    assert max(window_peaks(windows, [layer[0] for layer in options])) == max(w.peak for w in windows)


def test_a_coarse_grid_never_under_counts_the_peak():
    rng = random.Random(7)
    profile = profile_of(
        *[("aten::mm", rng.randrange(1, 64) * MiB + rng.randrange(0, 4096), 1.0 + i) for i in range(6)],
        ("aten::sum", 0, 0.5, AFTER),
        floor=3 * MiB,
    )
    plan = Plan.from_profile(profile, 1.0)
    options = [_step._options(plan, f"layers.{j}", 0, False, []) for j in range(4)]
    windows = windows_of([100 * MiB] * 4, 200 * MiB, [300 * MiB] * 4)
    for budget in range(300 * MiB, 900 * MiB, 37 * MiB + 12345):
        chosen = choose(windows, options, budget)
        assert chosen is not None and max(window_peaks(windows, chosen)) <= budget


# --- the plan object --------------------------------------------------------------------------------


def _step_plan():
    profile = profile_of(
        ("aten::mm", 3 * MiB, 2.0), ("aten::mm", 2 * MiB, 1.0), ("aten::sum", 0, 0.5, AFTER), floor=MiB
    )
    plan = Plan.from_profile(profile, 1.0)
    layers = (LayerChoice("layers.0", plan.with_budget(4 * MiB)), LayerChoice("layers.1", plan.with_budget(0.0)))
    windows = windows_of([10 * MiB, 11 * MiB], 12 * MiB, [14 * MiB, 13 * MiB])
    return StepPlan(
        20 * MiB,
        windows,
        layers,
        measured_peak=16 * MiB,
        measured_windows=(13 * MiB, 14 * MiB, 15 * MiB, 16 * MiB, 14 * MiB),
    )


def test_the_table_shows_each_layer_and_each_window():
    plan = _step_plan()
    assert plan.predicted_peak == 16 * MiB and plan.full_recompute_peak == 14 * MiB
    assert plan.table().splitlines() == [
        "StepPlan(peak_bytes=20971520 (20.00 MiB): predicted peak 16777216 (16.00 MiB), measured 16777216 "
        "(16.00 MiB); full recompute 14.00 MiB; 2 layers, overhead 4.000 ms)",
        "layer                         inputs  kept  kept MiB offloaded  host MiB  held MiB  overhead ms",
        "layers.0                      device     1     3.000         0     0.000     4.000        1.000",
        "layers.1                      device     0     0.000         0     0.000     1.000        3.000",
        "",
        "window                                full recompute MiB  modelled MiB  measured MiB",
        "forward layers.0                                  10.000        13.000        13.000",
        "forward layers.1                                  11.000        14.000        14.000",
        "head (loss and its backward)                      12.000        15.000        15.000",
        "backward layers.1                                 13.000        16.000        16.000",
        "backward layers.0                                 14.000        14.000        14.000",
    ]
    assert plan.policies == {
        "layers.0": sac_plugin.Policy(kept_calls={"aten::mm.default": [0]}),
        "layers.1": sac_plugin.Policy(),
    }


def test_save_and_load_give_the_same_plan(tmp_path):
    plan = _step_plan()
    loaded = StepPlan.load(plan.save(tmp_path / "step.json"))
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.table() == plan.table()
    assert [(c.name, c.plan.kept) for c in loaded.layers] == [(c.name, c.plan.kept) for c in plan.layers]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d.update(format="sac_plugin.plan"),
            "'format' must be 'sac_plugin.step_plan', got 'sac_plugin.plan': not a sac_plugin step plan",
        ),
        (lambda d: d.update(version=2), "version 2 is not supported; this sac_plugin reads versions 1"),
        (lambda d: d.update(peak_bytes=-1), "peak_bytes must be an int from 0 to 2**63 - 1, got -1"),
        (lambda d: d.update(peak_bytes=0), "peak_bytes must be an int >= 1, got 0"),
        (
            lambda d: d["windows"][0].update(kind="sideways"),
            "windows[0].kind must be one of 'forward', 'head', 'backward', got 'sideways'",
        ),
        (
            lambda d: d["windows"].pop(),
            "windows must be, in order, the forward of each of the 2 layers, the head and "
            "each layer's backward in reverse",
        ),
        (lambda d: d.update(measured_windows=[1]), "measured_windows has 1 peaks for 5 windows"),
        (lambda d: d["layers"][1].update(name="layers.0"), "layers names one layer twice"),
        (
            lambda d: d["layers"][0]["plan"].update(kept=[["aten::mm", 7]]),
            "layers[0].plan: kept[0] = ['aten::mm', 7] is not a profiled call",
        ),
        (
            lambda d: d["layers"][0].update(offload_inputs=True),
            "layers[0] offloads its inputs but its plan has no offload model",
        ),
        (
            lambda d: d.update(extra=1),
            "unknown key 'extra'; known keys in version 1: format, layers, measured_peak, "
            "measured_windows, offload, peak_bytes, torch, version, windows",
        ),
    ],
)
def test_bad_step_plan_files_are_plan_errors_naming_the_field(tmp_path, edit, message):
    data = _step_plan().to_dict()
    edit(data)
    path = tmp_path / "step.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as raised:
        StepPlan.load(path)
    assert str(raised.value) == f"sac_plugin: step plan file {path}: {message}"


def test_plot_draws_the_windows_and_delegates_a_layers_curve(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    plan = _step_plan()
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda figure: (figures.append(figure), close(figure)))
    assert plan.plot(tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.get_label(): list(line.get_ydata()) for line in figures[0].axes[0].lines}
    assert lines["full recompute (measured)"] == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert lines["this plan (modelled)"] == [13.0, 14.0, 15.0, 16.0, 14.0]
    assert lines["peak_bytes"] == [20.0, 20.0] and lines["measured peak with the plan"] == [16.0, 16.0]
    assert plan.plot(tmp_path / "layer.png", layer="layers.0").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figures[1].axes[0].get_title() == "sac_plugin memory-budget plan"  # the layer plan's own plot
    with pytest.raises(
        ValueError,
        match=r"^sac_plugin: StepPlan.plot: layer must be one of the planned layers "
        r"\(layers.0, layers.1\), got 'layers.9'$",
    ):
        plan.plot(tmp_path / "x.png", layer="layers.9")


def test_apply_checkpoints_the_named_layers_and_refuses_a_model_without_them():
    torch.manual_seed(0)
    model = Llama(vocab=32, dim=16, heads=2, layers=2, seq=8)
    plan = _step_plan()
    with pytest.raises(
        ValueError,
        match=r"^sac_plugin: StepPlan.apply: ModuleList has no submodule 'layers.0', which "
        "the plan plans$",
    ):
        plan.apply(model.layers)
    assert not any("_sac_policy" in layer.__dict__ for layer in model.layers)
    plan.apply(model)
    assert [layer._sac_policy for layer in model.layers] == [
        sac_plugin.Policy(kept_calls={"aten::mm.default": [0]}),
        sac_plugin.Policy(),
    ]


# --- bad input --------------------------------------------------------------------------------------


def _model_and_step():
    torch.manual_seed(0)
    model = Llama(vocab=32, dim=16, heads=2, layers=2, seq=8)
    tokens = torch.randint(0, 32, (2, 8))
    return model, lambda: model.loss(tokens, tokens).backward()


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (
            {"peak_bytes": 0},
            ValueError,
            "peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, such as 8 * 2**30), got 0 (int)",
        ),
        (
            {"peak_bytes": 8.0 * 2**30},
            ValueError,
            "peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, such as 8 * 2**30), got 8589934592.0 (float)",
        ),
        (
            {"peak_bytes": True},
            ValueError,
            "peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, such as 8 * 2**30), got True (bool)",
        ),
        (
            {"peak_bytes": "8GiB"},
            ValueError,
            "peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, such as 8 * 2**30), got '8GiB' (str)",
        ),
        (
            {"peak_bytes": 2**63},
            ValueError,
            "peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, such as 8 * 2**30), "
            f"got {2**63} (int)",
        ),
        (
            {"peak_bytes": 2**70},
            ValueError,
            "peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, such as 8 * 2**30), "
            f"got {2**70} (int)",
        ),
        (
            {"step": "model.loss"},
            TypeError,
            "step must be a callable that runs one training step (forward, loss and "
            "backward) when called with no arguments, got 'model.loss' (str)",
        ),
        ({"offload": "yes"}, TypeError, "offload must be True or False, got 'yes' (str)"),
        (
            {"max_rounds": 0},
            ValueError,
            "max_rounds must be an int >= 1 (runs of the step with a plan applied), got 0 (int)",
        ),
        ({"offload_min_bytes": 0}, ValueError, "offload_bandwidth and offload_min_bytes only apply with offload=True"),
        (
            {"layers": "layers"},
            TypeError,
            "plan_step: layers must be a list of the model's submodules, got 'layers' (str)",
        ),
        ({"layers": []}, ValueError, "plan_step: layers is empty: plan_step plans at least one layer"),
        (
            {"layers": [torch.nn.Linear(2, 2)]},
            ValueError,
            "plan_step: layers[0] (Linear) is not a submodule of the Llama",
        ),
    ],
)
def test_bad_input_is_refused_by_name_and_changes_nothing(arguments, error, message):
    model, step = _model_and_step()
    arguments = {"peak_bytes": 2**30, **arguments}
    step = arguments.pop("step", step)
    with pytest.raises(error) as raised:
        sac_plugin.plan_step(model, step, **arguments)
    prefix = "sac_plugin: " if message.startswith("plan_step: ") else "sac_plugin: plan_step: "
    assert str(raised.value) == prefix + message
    assert not any("forward" in m.__dict__ or "_sac_policy" in m.__dict__ for m in model.modules())


def test_a_model_off_an_accelerator_is_refused_saying_why():
    model, step = _model_and_step()
    with pytest.raises(ValueError) as raised:
        sac_plugin.plan_step(model, step, peak_bytes=2**30)
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        assert str(raised.value) == (
            f"sac_plugin: plan_step: measuring a step's peak needs the model on the {kind} "
            "accelerator (its memory statistics), but its parameters are on cpu"
        )
    else:
        assert str(raised.value) == (
            "sac_plugin: plan_step: measuring a step's peak needs an accelerator's memory "
            "statistics (torch.accelerator), and none is available"
        )
    assert not any("_sac_policy" in layer.__dict__ for layer in model.layers)


def test_a_model_without_declared_layers_needs_layers():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(
        ValueError,
        match=r"^sac_plugin: plan_step: Sequential declares no layers \(no "
        r"recompute_wrap_sites\(\) method\); pass layers=\[the layers to checkpoint\]$",
    ):
        sac_plugin.plan_step(model, lambda: None, peak_bytes=2**30)


# --- configs and the command line, without an accelerator --------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"peak_bytes": 0},
            "recompute config: peak_bytes must be a byte count of device memory, an int from 1 to "
            "2**63 - 1, or null, got 0",
        ),
        (
            {"peak_bytes": "8GiB"},
            "recompute config: peak_bytes must be a byte count of device memory, an int from 1 to "
            "2**63 - 1, or null, got '8GiB'",
        ),
        (
            {"peak_bytes": 2**30, "budget": 0.3},
            "recompute config: peak_bytes plans the step by measurement; leave budget unset (or drop peak_bytes)",
        ),
        (
            {"peak_bytes": 2**30, "kept_units": ["attn"]},
            "recompute config: peak_bytes plans the step by measurement; leave kept_units unset (or drop peak_bytes)",
        ),
        (
            {"budget": 0.3, "offload_inputs": True},
            "recompute config: budget plans what each layer keeps and never offloads "
            "the layers' inputs; drop offload_inputs, or plan with peak_bytes, whose "
            "plans may offload them",
        ),
    ],
)
def test_bad_peak_configs_are_named(data, message):
    with pytest.raises(ConfigError) as raised:
        RecomputeConfig.from_dict(data)
    assert str(raised.value) == message


def test_a_peak_config_round_trips():
    config = RecomputeConfig(peak_bytes=8 << 30, every_nth_layer=2)
    assert RecomputeConfig.from_json(config.to_json()) == config
    assert RecomputeConfig.from_yaml(config.to_yaml()).peak_bytes == 8 << 30


def test_a_peak_config_with_offload_inputs_lets_the_plan_offload(monkeypatch):
    model, step = _model_and_step()
    asked = []
    monkeypatch.setattr(sac_plugin.planner, "plan_step", lambda model, step, **options: asked.append(options))
    for offload_inputs in (False, True):
        sac_plugin.apply_recompute_config(
            model, RecomputeConfig(peak_bytes=2**30, offload_inputs=offload_inputs), step=step
        )
    assert [options["offload"] for options in asked] == [False, True]


def test_a_peak_config_without_a_step_says_plan_step_needs_it():
    model, step = _model_and_step()
    with pytest.raises(ConfigError) as raised:
        sac_plugin.apply_recompute_config(model, RecomputeConfig(peak_bytes=2**30))
    assert str(raised.value) == (
        "apply_recompute_config: peak_bytes bounds a training step's peak, which sac_plugin.plan_step plans by "
        "running the step: pass step=<a callable that runs one forward, loss and backward of the model, called with "
        "no arguments>"
    )
    with pytest.raises(
        ConfigError, match="^apply_recompute_config: step is for planning a peak; the config sets no peak_bytes$"
    ):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]), step=step)
    assert not any("_sac_policy" in layer.__dict__ for layer in model.layers)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            ["--peak", "8XB"],
            "argument --peak: bytes, an int >= 1 or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, "
            "GiB, TiB), such as 8GiB, got '8XB'",
        ),
        (
            ["--peak", "0"],
            "argument --peak: bytes, an int >= 1 or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, "
            "TiB), such as 8GiB, got '0'",
        ),
        (
            ["--peak", "1.5"],
            "argument --peak: bytes, an int >= 1 or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, "
            "GiB, TiB), such as 8GiB, got '1.5'",
        ),
        (
            ["--peak", "8GiB"],
            "--peak measures the step's peak in the accelerator's memory statistics; --device cpu has "
            "none (pass --device cuda, or another accelerator)",
        ),
        (
            ["--peak", "8GiB", "--budget", "0.3"],
            "--peak plans a whole training step and --budget one layer; give one of them",
        ),
    ],
)
def test_the_peak_command_checks_its_arguments(arguments, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "llama", *arguments])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_device_the_machine_does_not_have_is_an_argument_error_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(sac_plugin, "plan_step", lambda *a, **k: pytest.fail("planned with a bad --device"))
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "llama", "--peak", "8GiB", "--device", "cuda:7"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m sac_plugin: error: --device cuda:7: there is no cuda device 7; this machine has 2 "
        "(pass cuda or cuda:0 to cuda:1)"
    )


@pytest.mark.parametrize(
    "text, value", [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096), ("2kib", 2048)]
)
def test_peak_accepts_bytes_with_units(text, value):
    from sac_plugin.__main__ import _peak_bytes

    assert _peak_bytes(text) == value


# --- on the test accelerator --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def between():
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    return run_accelerator_program("plan_step_between.py")


@pytest.mark.slow
def test_a_budget_between_full_recompute_and_none_is_used_and_holds(between):
    v = between
    assert v["engine"] == sac_plugin.engine()
    assert v["full_recompute"] < v["budget"] < v["none"]
    assert v["profiled"] == v["full_recompute"]  # the profiled step is full recompute, measured the same way
    # The plan's first step is measured; the steps after it peak no higher.
    assert v["measured"] <= v["budget"] and v["remeasured"] <= v["measured"]
    assert v["predicted"] <= v["budget"]
    assert sum(v["kept_calls"]) > 0 and v["measured"] > v["full_recompute"]  # the plan uses the room
    assert v["names"] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert all(v["checkpointed"]) and v["unequal_grads"] == []
    assert v["first_line"].startswith(
        f"StepPlan(peak_bytes={v['budget']} ({v['budget'] / MiB:.2f} MiB): predicted peak {v['predicted']} "
    )


@pytest.mark.slow
def test_a_budget_below_full_recompute_names_the_lowest_reachable_peak(between):
    v = between
    asked, lowest = v["full_recompute"] - 1, v["full_recompute"]
    assert v["below"] == (
        f"sac_plugin: plan_step: no plan reaches peak_bytes={asked} ({asked / MiB:.2f} MiB): the "
        f"lowest reachable peak is {lowest} bytes ({lowest / MiB:.2f} MiB), with full recompute of "
        "every layer; offload=True may go lower"
    )
    assert v["unchanged_after_error"]


@pytest.mark.slow
def test_a_saved_step_plan_loads_and_applies_the_same_policies(between):
    assert between["loaded_same"] and all(between["fresh_policies"])


@pytest.mark.slow
def test_a_config_with_peak_bytes_plans_the_step(between):
    v = between
    assert all(v["config_policies"]) and v["config_kept"] > 0
    assert v["full_recompute"] < v["config_peak"] <= v["budget"]


@pytest.mark.slow
def test_the_plan_command_plans_a_step_for_a_peak(between):
    header, first = between["cli"]
    assert header == "llama model: 2 layers, dim 32, heads 4, seq 16, batch 2, sac_accel"
    assert first.startswith("StepPlan(peak_bytes=1073741824 (1024.00 MiB): predicted peak ")
    assert between["cli_saved"] == ["layers.0", "layers.1"]


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_offload_reaches_below_full_recompute_by_offloading_layer_inputs():
    v = run_accelerator_program("plan_step_offload.py")
    assert v["engine"] == sac_plugin.engine()
    assert v["without_offload"].startswith(f"sac_plugin: plan_step: no plan reaches peak_bytes={v['budget']} ")
    assert v["measured"] <= v["budget"] < v["full_recompute"]
    assert any(v["inputs"]) and v["policies"] == v["inputs"]
    assert v["unequal_grads"] == []


@pytest.fixture(scope="module")
def limits():
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    return run_accelerator_program("plan_step_limits.py")


@pytest.mark.slow
def test_the_lowest_reachable_peak_a_plan_error_names_is_reached(limits):
    lowest = limits["lowest"]
    assert limits["below"] == (
        f"sac_plugin: plan_step: no plan reaches peak_bytes=1 (0.00 MiB): the lowest reachable peak is {lowest} "
        f"bytes ({lowest / MiB:.2f} MiB), with full recompute of every layer; offload=True may go lower"
    )
    assert limits["at_lowest"] <= lowest


@pytest.mark.slow
def test_the_largest_peak_bytes_is_planned_without_a_plan_error(limits):
    assert limits["lowest"] < limits["largest"] < 2**63 - 1


@pytest.mark.slow
def test_a_step_that_changes_the_parameters_is_refused_by_name_leaving_no_state(limits):
    assert limits["optimizer"] == (
        "sac_plugin: plan_step: the step calls Adam.step(), which would change 21 parameters (embed.weight, "
        "layers.0.attention_norm.weight, layers.0.attention.wq.weight and 18 more) and the optimizer's state; "
        "plan_step runs the step several times from the same state, so the step must run forward, loss and "
        "backward only: call the optimizer after plan_step (refused before it ran: nothing was changed)"
    )
    assert limits["in_place"] == (
        "sac_plugin: plan_step: the step changed 1 parameter (embed.weight) in place; plan_step runs the step "
        "several times from the same state, so the step must run forward, loss and backward only, without "
        "changing the parameters (this change stays: plan_step keeps no copy of the parameters to undo it)"
    )
    assert limits["parameters"] == 21 and limits["optimizer_state"] == 0
    assert limits["changed"] == limits["grads"] == limits["checkpointed"] == []
