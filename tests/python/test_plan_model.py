"""Issue 9: a budget across a model (RecomputeConfig.budget): identical layers are planned once,
the budget is split over layers to save the most time, gradients stay bitwise, and the CLI."""

import copy
import logging

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, RecomputeConfig
from sac_plugin.__main__ import main
from sac_plugin.models import Llama
from sac_plugin.planner.split import split

from test_plan import llama_inputs

pytestmark = pytest.mark.filterwarnings("ignore:sac. .*:UserWarning")


def _train_pair(model, reference, tokens, targets):
    loss = model.loss(tokens, targets)
    loss.backward()
    ref = reference.loss(tokens, targets)
    ref.backward()
    assert torch.equal(loss, ref)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad), name


def _model():
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, heads=4, layers=3, seq=16)
    tokens = torch.randint(0, 64, (2, 16))
    return model, copy.deepcopy(model), tokens, torch.randint(0, 64, (2, 16))


def test_budget_from_an_example_batch_plans_identical_layers_once(caplog):
    model, reference, tokens, targets = _model()
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(budget=0.3), example_inputs=(tokens,))
    messages = [r.getMessage() for r in caplog.records if r.name == "sac_plugin"]
    assert [m.split(":")[1].strip() for m in messages[:3]] == ["layer 0 (LlamaBlock)", "layer 1 (LlamaBlock)",
                                                                "layer 2 (LlamaBlock)"]
    assert "over 3 layers (1 distinct)" in messages[3]
    assert all(layer._sac_policy.kept_calls for layer in model.layers)
    assert all(p.grad is None for p in model.parameters())
    with sac_plugin.audit() as audit:
        _train_pair(model, reference, tokens, targets)
    assert sum(row.hits for row in audit.rows()) == sum(
        sum(len(v) for v in layer._sac_policy.kept_calls.values()) for layer in model.layers)


def test_budget_without_an_example_plans_on_the_first_call(caplog):
    model, reference, tokens, targets = _model()
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(budget=0.25))
        _train_pair(model, reference, tokens, targets)
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sac_plugin: planned")]
    assert len(planned) == 1 and planned[0].startswith("sac_plugin: planned LlamaBlock within 0.25: keeps ")
    assert len({layer._sac_policy for layer in model.layers}) == 1
    # Later steps run the planned policy, bitwise as before.
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    _train_pair(model, reference, tokens, targets)


def test_split_saves_at_least_what_an_even_split_saves():
    block, args = llama_inputs()
    plan = sac_plugin.plan(block, *args, budget=1.0, runs=1)
    for fraction in (0.1, 0.25, 0.5):
        total = int(fraction * 3 * plan.profile.no_checkpoint_bytes)
        chosen = split([plan, plan, plan], total)
        assert sum(p.held_bytes for p in chosen) <= total
        even = plan.with_budget(total // 3)
        saved = sum(p.full_recompute_seconds - p.recompute_seconds for p in chosen)
        assert saved >= 3 * (even.full_recompute_seconds - even.recompute_seconds) - 1e-12


@pytest.mark.parametrize("data, message", [
    ({"budget": 1.5}, "recompute config: budget as a fraction must be from 0.0 to 1.0, got 1.5; pass an int for a "
                      "byte count"),
    ({"budget": "lots"}, "recompute config: budget must be a fraction of the layer's no-checkpointing activation bytes "
                         "(a float from 0.0 to 1.0) or a byte count (an int >= 0), got 'lots' (str)"),
    ({"budget": 0.3, "units": ["attn"], "every_nth_op": {"aten::mm": 2}},
     "recompute config: budget chooses what to keep by measurement; leave units, every_nth_op unset (or drop budget "
     "to choose by hand)"),
])
def test_bad_budget_configs_are_named(data, message):
    with pytest.raises(ConfigError) as raised:
        RecomputeConfig.from_dict(data)
    assert str(raised.value) == message


def test_budget_config_round_trips():
    config = RecomputeConfig(budget=0.3, every_nth_layer=2)
    assert RecomputeConfig.from_json(config.to_json()) == config
    assert RecomputeConfig.from_dict({"budget": 4096}).budget == 4096


def test_example_inputs_without_a_budget_are_refused():
    model, _, tokens, _ = _model()
    with pytest.raises(ConfigError, match="example_inputs are for planning a budget; the config sets no budget"):
        sac_plugin.apply_recompute_config(model, RecomputeConfig(units=["attn"]), example_inputs=(tokens,))
    assert not any("_sac_policy" in layer.__dict__ for layer in model.layers)


def test_cli_prints_the_table_and_the_curve(capsys, tmp_path):
    assert main(["plan", "--model", "moe", "--budget", "0.3", "--dim", "32", "--seq", "16", "--runs", "1",
                 "--save", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("moe layer: dim 32, heads 4, seq 16, batch 2, cpu\nPlan(budget=0.3: ")
    assert "Pareto curve (budget: fraction of no-checkpointing bytes):" in out
    assert sac_plugin.Plan.load(tmp_path / "plan.json").budget == 0.3


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["plan", "--model", "llama", "--dim", "32", "--seq", "16", "--runs", "1",
                 "--plot", str(tmp_path / "plan.png")]) == 0
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
