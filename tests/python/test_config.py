"""Recompute configs: files round-trip, bad fields are named, and applying one keeps gradients."""

import copy
import json

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, RecomputeConfig, RecomputeUnit, apply_recompute_config
from sac_plugin.config import policy_for
from sac_plugin.models import Llama, MoEModel
from sac_plugin.targets import LLAMA_TARGETS, KeptOps, RecomputeTargetMap

FULL = RecomputeConfig(
    units=(RecomputeUnit.ATTN, RecomputeUnit.MOE_GATE),
    ops=("aten::addmm",),
    every_nth_op={"aten::mm": 2},
    every_nth_layer=2,
    force_recompute_modules=("moe.router.gate",),
    preserve_rng_state=False,
)


def test_unset_config_keeps_nothing():
    config = RecomputeConfig()
    policy = policy_for(config, LLAMA_TARGETS)
    assert policy.keeps_nothing
    assert config.selected_layers(4) == [0, 1, 2, 3]


@pytest.mark.parametrize("config", [RecomputeConfig(), FULL, RecomputeConfig(layer_ratio=0.5)])
@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_files_round_trip_identically(config, fmt, tmp_path):
    path = tmp_path / f"recompute.{fmt}"
    config.save(path)
    text = path.read_text()
    loaded = RecomputeConfig.load(path)
    assert loaded == config
    loaded.save(path)
    assert path.read_text() == text


def test_json_and_yaml_say_the_same():
    assert RecomputeConfig.from_yaml(FULL.to_yaml()) == RecomputeConfig.from_json(FULL.to_json()) == FULL
    assert json.loads(FULL.to_json())["units"] == ["attn", "moe_gate"]


@pytest.mark.parametrize(
    "data,message",
    [
        ({"unit": ["attn"]}, "recompute config: unknown key 'unit'; known keys: units, ops, every_nth_op, "
                             "every_nth_layer, first_layer, layer_ratio, force_recompute_modules, preserve_rng_state, budget"),
        ({"units": ["attn", "atn"]}, "recompute config: units[1]: unknown unit 'atn'; known units: attn, mlp, "
                                     "moe_gate, moe_dispatch, norm"),
        ({"units": "attn"}, "recompute config: units must be a list, got 'attn'"),
        ({"ops": [""]}, "recompute config: ops[0] must be a non-empty string, got ''"),
        ({"every_nth_op": {"aten::mm": 0}}, "recompute config: every_nth_op['aten::mm']: n must be an int from 1 to 2**63 - 1, got 0"),
        ({"every_nth_layer": 0}, "recompute config: every_nth_layer must be an int >= 1, got 0"),
        ({"layer_ratio": 1.5}, "recompute config: layer_ratio must be in (0, 1], got 1.5"),
        ({"layer_ratio": 0.5, "every_nth_layer": 2},
         "recompute config: layer_ratio and every_nth_layer both select layers; set one"),
        ({"preserve_rng_state": "yes"}, "recompute config: preserve_rng_state must be true or false, got 'yes'"),
    ],
)
def test_bad_fields_are_named(data, message):
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.from_dict(data)
    assert str(error.value) == message


def test_unit_the_model_does_not_declare():
    with pytest.raises(ConfigError) as error:
        apply_recompute_config(Llama(), RecomputeConfig(units=["moe_gate"]))
    assert str(error.value) == (
        "recompute config: units[0]: Llama declares no unit 'moe_gate' (it declares attn, mlp, norm)"
    )


def test_collective_in_a_config_or_a_unit_is_refused():
    with pytest.raises(ConfigError, match=r"^recompute config: ops: sac: kept_ops: 'c10d::allreduce_' names "
                                          r"c10d::allreduce_, which is a collective"):
        apply_recompute_config(Llama(), RecomputeConfig(ops=["c10d::allreduce_"]))
    targets = RecomputeTargetMap("Custom", {RecomputeUnit.ATTN: KeptOps(["_c10d_functional::all_reduce"])})
    with pytest.raises(ConfigError, match=r"^target map of Custom: unit 'attn': sac: kept_ops: "
                                          r"'_c10d_functional::all_reduce' names .*which is a collective"):
        apply_recompute_config(Llama(), RecomputeConfig(units=["attn"]), target_map=targets)


def test_empty_unit_is_refused():
    targets = RecomputeTargetMap("Custom", {RecomputeUnit.ATTN: KeptOps([])})
    with pytest.raises(ConfigError) as error:
        apply_recompute_config(Llama(), RecomputeConfig(), target_map=targets)
    assert str(error.value) == "target map of Custom: unit 'attn' is empty: it names no op"


def test_force_recompute_module_that_matches_nothing():
    with pytest.raises(ConfigError) as error:
        apply_recompute_config(Llama(), RecomputeConfig(force_recompute_modules=["attention.nope"]))
    assert str(error.value) == (
        "recompute config: force_recompute_modules[0]: 'attention.nope' matches nothing in LlamaBlock (layer 0)"
    )


def test_layer_selection():
    assert RecomputeConfig(every_nth_layer=2).selected_layers(5) == [0, 2, 4]
    assert RecomputeConfig(layer_ratio=0.5).selected_layers(4) == [0, 2]
    assert RecomputeConfig(layer_ratio=1 / 3).selected_layers(6) == [0, 3]


@pytest.mark.parametrize("model_class,config", [
    (Llama, RecomputeConfig(units=["attn", "mlp", "norm"], every_nth_op={"aten::mm": 2})),
    (Llama, RecomputeConfig(every_nth_layer=2)),
    (MoEModel, RecomputeConfig(units=["attn", "moe_gate", "moe_dispatch", "mlp"])),
    (MoEModel, RecomputeConfig(units=["moe_gate"], force_recompute_modules=["moe.router.gate"])),
])
def test_applied_config_keeps_gradients_bitwise(model_class, config):
    torch.manual_seed(0)
    model = model_class(layers=3)
    reference = copy.deepcopy(model)
    apply_recompute_config(model, config)
    tokens = torch.randint(512, (2, 32))
    with sac_plugin.audit() as audit:
        loss = model.loss(tokens, tokens)
        loss.backward()
    expected = reference.loss(tokens, tokens)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    checkpointed = len(config.selected_layers(3))
    if RecomputeUnit.MOE_GATE in config.units:
        assert audit.hits("aten::topk") == checkpointed
    if model_class is Llama and config.every_nth_layer == 2:
        assert audit.count("aten::_scaled_dot_product_flash_attention_for_cpu", phase="recompute") == 2


def test_moe_units_resolve_to_the_routing_ops():
    torch.manual_seed(0)
    model = MoEModel(layers=2)
    apply_recompute_config(model, RecomputeConfig(units=["moe_gate", "moe_dispatch"]))
    tokens = torch.randint(512, (2, 32))
    with sac_plugin.audit() as audit:
        model.loss(tokens, tokens).backward()
    for op in ("aten::topk", "aten::sort.stable", "aten::histc"):
        assert audit.hits(op) == 2, op
        assert audit.count(op, phase="recompute") == 0, op


def test_deepcopy_after_applying_keeps_units_on_the_copy():
    torch.manual_seed(0)
    model = MoEModel(layers=1)
    apply_recompute_config(model, RecomputeConfig(units=["moe_gate"]))
    clone = copy.deepcopy(model)
    tokens = torch.randint(512, (2, 16))
    with sac_plugin.audit() as audit:
        clone.loss(tokens, tokens).backward()
    assert audit.hits("aten::topk") == 1
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("forced", [False, True])
def test_force_recompute_by_module(forced):
    torch.manual_seed(0)
    model = MoEModel(layers=1)
    config = RecomputeConfig(units=["moe_gate"], force_recompute_modules=["moe.router.gate"] if forced else [])
    apply_recompute_config(model, config)
    tokens = torch.randint(512, (2, 16))
    with sac_plugin.audit() as audit:
        model.loss(tokens, tokens).backward()
    # The router's gate Linear is the only mm in the moe_gate unit; topk follows it in the unit.
    assert audit.hits("aten::mm") == (0 if forced else 1)
    assert audit.hits("aten::topk") == 1
