"""Recompute configs: files round-trip, bad fields and unreadable files are named, applying one keeps
gradients, and a refused one leaves the model untouched. Which layers a config checkpoints:
every_nth_layer from layer 0 by default, first_layer for the other convention (Modalities' ac_freq),
layer_ratio spread from layer 0."""

import copy
import dataclasses
import inspect
import re
import warnings
import io
import json

import pytest
import sac_plugin
import torch
from sac_plugin import (
    ConfigError,
    RecomputeConfig,
    RecomputeUnit,
    apply_recompute_config,
    apply_selective_checkpointing,
    audit,
)
from sac_plugin._config_policy import policy_for
from sac_plugin.models import Llama, MoEModel
from sac_plugin.models import LLAMA_TARGETS
from sac_plugin.targets import KeptOps, RecomputeTargetMap

FULL = RecomputeConfig(
    kept_units=(RecomputeUnit.ATTN, RecomputeUnit.MOE_GATE),
    kept_ops=("aten::addmm",),
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
    assert json.loads(FULL.to_json())["kept_units"] == ["attn", "moe_gate"]


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"unit": ["attn"]},
            "recompute config: unknown key 'unit'; known keys: kept_units, kept_ops, every_nth_op, "
            "every_nth_layer, first_layer, layer_ratio, force_recompute_modules, recomputed_units, "
            "preserve_rng_state, budget, peak_bytes, offloaded_units, offloaded_ops, offload_min_bytes, "
            "host_memory_limit, pin_routing, offload_inputs",
        ),
        (
            {"kept_units": ["attn", ""]},
            "recompute config: kept_units[1]: a recompute unit needs a non-empty str name such as 'attn', got ''",
        ),
        (
            {"kept_units": "attn"},
            "recompute config: kept_units must be a collection of names, not a single str: 'attn'; write ['attn']",
        ),
        ({"kept_ops": [""]}, "recompute config: kept_ops[0]: an op name is a non-empty str such as 'aten::mm', got ''"),
        (
            {"every_nth_op": {"aten::mm": 0}},
            "recompute config: every_nth_op['aten::mm'] must be an int from 1 to 2**63 - 1 (2 keeps every "
            "other call), got 0 (int)",
        ),
        (
            {"offload_min_bytes": -1},
            "recompute config: offload_min_bytes is a byte count, an int from 0 to 2**63 - 1; got -1 (int)",
        ),
        ({"every_nth_layer": 0}, "recompute config: every_nth_layer must be an int >= 1, got 0"),
        ({"layer_ratio": 1.5}, "recompute config: layer_ratio must be in (0, 1], got 1.5"),
        (
            {"layer_ratio": 0.5, "every_nth_layer": 2},
            "recompute config: layer_ratio and every_nth_layer both select layers; set one",
        ),
        ({"preserve_rng_state": "yes"}, "recompute config: preserve_rng_state must be True or False, got 'yes' (str)"),
        ({"offload_inputs": 1}, "recompute config: offload_inputs must be True or False, got 1 (int)"),
    ],
)
def test_bad_fields_are_named(data, message):
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.from_dict(data)
    assert str(error.value) == message


def test_unit_the_model_does_not_declare():
    with pytest.raises(ConfigError) as error:
        apply_recompute_config(Llama(), RecomputeConfig(kept_units=["moe_gate"]))
    assert str(error.value) == (
        "recompute config: kept_units[0]: Llama declares no unit 'moe_gate' (it declares attn, mlp, norm)"
    )


def test_collective_in_a_config_or_a_unit_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^recompute config: kept_ops: 'c10d::allreduce_' names "
        r"c10d::allreduce_, which is a collective",
    ):
        apply_recompute_config(Llama(), RecomputeConfig(kept_ops=["c10d::allreduce_"]))
    targets = RecomputeTargetMap("Custom", {RecomputeUnit.ATTN: KeptOps(["_c10d_functional::all_reduce"])})
    with pytest.raises(
        ConfigError,
        match=r"^target map of Custom: unit 'attn': "
        r"'_c10d_functional::all_reduce' names .*which is a collective",
    ):
        apply_recompute_config(Llama(), RecomputeConfig(kept_units=["attn"]), target_map=targets)


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


@pytest.mark.parametrize(
    "model_class,config",
    [
        (Llama, RecomputeConfig(kept_units=["attn", "mlp", "norm"], every_nth_op={"aten::mm": 2})),
        (Llama, RecomputeConfig(every_nth_layer=2)),
        (MoEModel, RecomputeConfig(kept_units=["attn", "moe_gate", "moe_dispatch", "mlp"])),
        (MoEModel, RecomputeConfig(kept_units=["moe_gate"], force_recompute_modules=["moe.router.gate"])),
    ],
)
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
    if RecomputeUnit.MOE_GATE in config.kept_units:
        assert audit.hits("aten::topk") == checkpointed
    if model_class is Llama and config.every_nth_layer == 2:
        assert audit.count("aten::_scaled_dot_product_flash_attention_for_cpu", phase="recompute") == 2


def test_moe_units_resolve_to_the_routing_ops():
    torch.manual_seed(0)
    model = MoEModel(layers=2)
    apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate", "moe_dispatch"]))
    tokens = torch.randint(512, (2, 32))
    with sac_plugin.audit() as audit:
        model.loss(tokens, tokens).backward()
    for op in ("aten::topk", "aten::sort.stable", "aten::histc"):
        assert audit.hits(op) == 2, op
        assert audit.count(op, phase="recompute") == 0, op


def test_deepcopy_after_applying_keeps_units_on_the_copy():
    torch.manual_seed(0)
    model = MoEModel(layers=1)
    apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate"]))
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
    config = RecomputeConfig(kept_units=["moe_gate"], force_recompute_modules=["moe.router.gate"] if forced else [])
    apply_recompute_config(model, config)
    tokens = torch.randint(512, (2, 16))
    with sac_plugin.audit() as audit:
        model.loss(tokens, tokens).backward()
    # The router's gate Linear is the only mm in the moe_gate unit; topk follows it in the unit.
    assert audit.hits("aten::mm") == (0 if forced else 1)
    assert audit.hits("aten::topk") == 1


# --- which layers a config checkpoints: every_nth_layer, first_layer, layer_ratio -----------------


def modalities_selected(count: int, ac_freq: int) -> list[int]:
    # Modalities' selective layer AC checkpoints a layer when (layer_id + 1) % ac_freq == 0: for
    # ac_freq=2 of 4 layers, layers 1 and 3.
    return [layer_id for layer_id in range(count) if (layer_id + 1) % ac_freq == 0]


def test_every_nth_layer_counts_from_layer_zero():
    assert RecomputeConfig(every_nth_layer=2).selected_layers(4) == [0, 2]
    assert RecomputeConfig(every_nth_layer=3).selected_layers(7) == [0, 3, 6]
    assert RecomputeConfig(layer_ratio=0.5).selected_layers(4) == [0, 2]
    assert RecomputeConfig(layer_ratio=0.25).selected_layers(4) == [0]


def test_first_layer_is_modalities_convention():
    assert RecomputeConfig(every_nth_layer=2, first_layer=1).selected_layers(4) == [1, 3] == modalities_selected(4, 2)
    for count in range(1, 9):
        for ac_freq in range(1, count + 1):
            config = RecomputeConfig(every_nth_layer=ac_freq, first_layer=ac_freq - 1)
            assert config.selected_layers(count) == modalities_selected(count, ac_freq), (count, ac_freq)


def test_first_layer_checkpoints_those_layers_of_a_model():
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, heads=4, layers=4, seq=16)
    reference = Llama(vocab=64, dim=32, heads=4, layers=4, seq=16)
    reference.load_state_dict(model.state_dict())
    apply_recompute_config(model, RecomputeConfig(kept_units=["attn"], every_nth_layer=2, first_layer=1))
    assert ["_sac_policy" in layer.__dict__ for layer in model.layers] == [False, True, False, True]
    tokens = torch.randint(64, (2, 16))
    with sac_plugin.audit() as audit:
        loss = model.loss(tokens, tokens)
        loss.backward()
    expected = reference.loss(tokens, tokens)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert audit.hits("aten::_scaled_dot_product_flash_attention_for_cpu") == 2


def test_first_layer_round_trips_and_is_checked():
    config = RecomputeConfig(every_nth_layer=2, first_layer=1)
    assert RecomputeConfig.from_json(config.to_json()) == config
    assert config.to_dict()["first_layer"] == 1
    with pytest.raises(ConfigError) as error:
        RecomputeConfig(first_layer=-1)
    assert str(error.value) == (
        "recompute config: first_layer must be an int >= 0 (the index of the first checkpointed layer), got -1"
    )
    with pytest.raises(ConfigError) as error:
        RecomputeConfig(layer_ratio=0.5, first_layer=1)
    assert str(error.value) == (
        "recompute config: first_layer applies to every_nth_layer; layer_ratio spreads its "
        "layers from layer 0. Set every_nth_layer and first_layer, or layer_ratio alone"
    )
    with pytest.raises(ConfigError) as error:
        apply_recompute_config(Llama(vocab=64, dim=32, layers=2, seq=16), RecomputeConfig(first_layer=2))
    assert str(error.value) == (
        "recompute config: first_layer is 2, but the model has 2 wrap sites (layers 0 to 1); "
        "first_layer must be one of them"
    )


# --- refusals that leave the model untouched, round trips, files ----------------------------------


def test_a_refused_config_leaves_every_layer_untouched():
    model = Llama()
    sites = model.recompute_wrap_sites()
    apply_selective_checkpointing(sites[1])
    with pytest.raises(ValueError, match="already selectively checkpointed"):
        apply_recompute_config(model, RecomputeConfig(kept_units=["mlp"]))
    # Layer 0 was not checkpointed, and its feed-forward was not put in the unit either.
    assert "forward" not in sites[0].__dict__
    assert "forward" not in sites[0].feed_forward.__dict__
    with pytest.raises(ValueError) as error:
        apply_recompute_config(model, RecomputeConfig(), wrap_sites=[sites[0], sites[0]])
    assert str(error.value) == "sac_plugin: apply_recompute_config: wrap_sites lists one LlamaBlock twice (at 0 and 1)"
    assert "forward" not in sites[0].__dict__


def test_a_config_applied_model_round_trips_with_its_units():
    torch.manual_seed(0)
    model = apply_recompute_config(Llama(), RecomputeConfig(kept_units=["mlp"]))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randint(0, 64, (2, 8))
    with audit() as a:
        loaded(x).float().pow(2).mean().backward()
    assert a.hits("aten::mm") > 0  # the feed-forward still runs in the kept "mlp" unit


def test_config_files_that_are_not_utf8_or_missing_are_config_errors(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("kept_units: [attn]  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.load(latin)
    assert str(error.value) == (
        f"recompute config: {latin}: not UTF-8 text (byte 0xe9 at offset 25); save the file as UTF-8"
    )
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.load(tmp_path / "missing.json")
    assert (
        str(error.value) == f"recompute config: {tmp_path / 'missing.json'}: cannot read it: No such file or directory"
    )
    deep = tmp_path / "deep.yaml"
    deep.write_text("kept_units:\n" + "".join(" " * i + "- \n" for i in range(1, 3000)))
    with pytest.raises(ConfigError, match="nested too deeply"):
        RecomputeConfig.load(deep)


def test_config_still_refuses_a_unit_the_target_map_does_not_declare():
    with pytest.raises(
        sac_plugin.ConfigError, match=r"^recompute config: kept_units\[0\]: Llama declares no unit 'moe_gate'"
    ):
        apply_recompute_config(Llama(vocab=64, dim=32, layers=1, seq=16), RecomputeConfig(kept_units=["moe_gate"]))


def _alias_bomb() -> str:
    """A flow list whose last entry expands to 9**9 strings through YAML aliases (~330 bytes)."""
    parts = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    previous = "a"
    for name in "bcdefghi":
        parts.append(f"&{name} [" + ",".join([f"*{previous}"] * 9) + "]")
        previous = name
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize(
    "text",
    [
        "kept_units: {bomb}",
        "kept_ops: {bomb}",
        "units: {bomb}",
        "force_recompute_modules: {bomb}",
        "every_nth_layer: {bomb}",
        "first_layer: {bomb}",
        "layer_ratio: {bomb}",
        "preserve_rng_state: {bomb}",
        "budget: {bomb}",
        "every_nth_op: {{x: {bomb}}}",
        "{bomb}",
    ],
    ids=lambda t: t.split(":")[0] if ":" in t else "top level",
)
@pytest.mark.filterwarnings("ignore:recompute config. 'units' is deprecated:FutureWarning")
def test_a_yaml_alias_bomb_is_refused_with_a_bounded_message(text):
    pytest.importorskip("yaml")
    with pytest.raises(ConfigError) as raised:
        RecomputeConfig.from_yaml(text.format(bomb=_alias_bomb()))
    assert len(str(raised.value)) < 400, str(raised.value)[:1000]


def test_configs_bound_list_sizes_and_text_length():
    with pytest.raises(ConfigError, match=r"^recompute config: kept_ops has 5000 entries; at most 4096 are accepted$"):
        RecomputeConfig.from_dict({"kept_ops": ["aten::mm"] * 5000})
    limit = sac_plugin.config.MAX_TEXT_CHARACTERS
    with pytest.raises(
        ConfigError, match=rf"the text has {limit + 1} characters; a recompute config has at most {limit}$"
    ):
        RecomputeConfig.from_json(" " * (limit + 1))


def test_a_unit_is_checked_against_every_selected_layer_of_a_mixed_stack():
    from sac_plugin.models import MOE_TARGETS, LlamaBlock

    torch.manual_seed(0)
    model = MoEModel(layers=3)
    model.layers[0] = LlamaBlock(128, 4)  # a dense first layer, as in DeepSeek-V3
    apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate"]), target_map=MOE_TARGETS)
    assert "forward" not in vars(model.layers[0].feed_forward)
    assert all("forward" in vars(layer.moe.router) for layer in list(model.layers)[1:])
    tokens = torch.randint(0, 512, (2, 16))
    with audit() as counted:
        model(tokens).sum().backward()
    assert counted.hits("aten::mm") > 0


def test_a_unit_that_matches_no_selected_layer_is_an_error_naming_it():
    from sac_plugin.models import Llama, MOE_TARGETS

    model = Llama(layers=2)
    with pytest.raises(
        ConfigError,
        match=r"target map of MoEModel: unit 'moe_gate': \[.moe.router.\] "
        r"match nothing in LlamaBlock$",
    ):
        apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate"]), target_map=MOE_TARGETS)
    assert not any("forward" in vars(m) for m in model.modules())


DUPLICATE = (
    "recompute config: key 'kept_units' is given twice{where}; each key may be given once (a parser would keep "
    "the last one silently)"
)


@pytest.mark.parametrize(
    ("fmt", "text", "where"),
    [
        ("json", '{"kept_units": ["attn"], "kept_units": []}', ""),
        ("json", '{"kept_units": ["attn"], "every_nth_op": {"aten::mm": 2, "aten::mm": 3}}', None),
        ("yaml", "kept_units: [attn]\nkept_ops: []\nkept_units: []\n", " (line 3)"),
        ("yaml", "kept_units: [attn]\nevery_nth_op:\n  aten::mm: 2\n  aten::mm: 3\n", None),
    ],
    ids=["json", "json nested", "yaml", "yaml nested"],
)
def test_a_key_given_twice_is_refused_naming_it(fmt, text, where, tmp_path):
    if fmt == "yaml":
        pytest.importorskip("yaml")
    if where is None:  # a nested mapping's key
        key = "aten::mm"
        where = " (line 4)" if fmt == "yaml" else ""
        expected = DUPLICATE.replace("'kept_units'", f"'{key}'").format(where=where)
    else:
        expected = DUPLICATE.format(where=where)
    with pytest.raises(ConfigError) as error:
        getattr(RecomputeConfig, "from_" + fmt)(text)
    assert str(error.value) == expected
    path = tmp_path / f"config.{fmt}"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.load(path)
    assert str(error.value) == expected


def test_yaml_merge_keys_are_not_duplicates():
    pytest.importorskip("yaml")
    # A merge supplies keys that the mapping's own keys override, as YAML says.
    config = RecomputeConfig.from_yaml("<<: {kept_units: [attn], kept_ops: [aten::addmm]}\nkept_ops: []\n")
    assert config.kept_units == (RecomputeUnit.ATTN,) and config.kept_ops == ()


def test_an_op_typo_suggests_the_closest_names_first():
    # aten::mH, aten::mT, aten::min and aten::mm are each one edit from aten::mn; mm is the one a
    # finger slipped to (n is next to m), and a change of case is the least likely typo.
    with pytest.raises(
        ConfigError,
        match=r"unknown op 'aten::mn'; closest registered names: aten::mm, aten::min, "
        r"aten::mv$",
    ):
        policy_for(RecomputeConfig(kept_ops=["aten::mn"]), RecomputeTargetMap("none", {}))


# --- one vocabulary with Policy -------------------------------------------------------------------

SHARED_FIELD_ERRORS = {
    "kept_units": ["attn", ""],
    "kept_ops": "aten::mm",
    "every_nth_op": {"aten::mm": 0},
    "recomputed_units": [7],
    "offloaded_units": ["\x00"],
    "offloaded_ops": [3],
    "offload_min_bytes": -1,
    "host_memory_limit": "1GiB",
    "pin_routing": 1,
    "offload_inputs": "no",
}


@pytest.mark.parametrize("field", list(SHARED_FIELD_ERRORS))
def test_a_field_shared_with_policy_is_refused_with_policys_message(field):
    value = SHARED_FIELD_ERRORS[field]
    with pytest.raises((TypeError, ValueError)) as by_policy:
        sac_plugin.Policy(**{field: value})
    with pytest.raises(ConfigError) as by_config:
        RecomputeConfig(**{field: value})
    assert str(by_policy.value).startswith(f"sac_plugin: {field}")
    assert str(by_config.value) == "recompute config: " + str(by_policy.value).removeprefix("sac_plugin: ")


def test_a_config_names_its_fields_as_policy_does():
    shared = set(SHARED_FIELD_ERRORS)
    policy_arguments = set(inspect.signature(sac_plugin.Policy).parameters)
    config_fields = {field.name for field in dataclasses.fields(RecomputeConfig)}
    assert shared <= policy_arguments and shared <= config_fields
    # What the config has beyond Policy selects layers, plans, or forces modules to recompute.
    assert config_fields - policy_arguments == {
        "every_nth_layer",
        "first_layer",
        "layer_ratio",
        "force_recompute_modules",
        "preserve_rng_state",
        "budget",
        "peak_bytes",
    }


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("units", "kept_units", ("attn",)),
        ("regions", "kept_units", ("*.core",)),
        ("ops", "kept_ops", ("aten::mm",)),
        ("recomputed_regions", "recomputed_units", ("*.ffn",)),
        ("offloaded_regions", "offloaded_units", ("*.experts",)),
    ],
)
def test_an_old_field_name_is_read_for_a_release_with_a_future_warning(old, new, value):
    expected = f"recompute config: '{old}' is deprecated and will be removed in a later release; write '{new}'"
    with pytest.warns(FutureWarning, match="^" + re.escape(expected)):
        config = RecomputeConfig.from_dict({old: list(value)})
    assert config == RecomputeConfig(**{new: value})
    assert old not in config.to_dict() and config.to_dict()[new] == list(value)
    with pytest.warns(FutureWarning, match=re.escape(f"'{old}' is deprecated")):
        assert getattr(config, old) == getattr(config, new)


def test_old_and_new_names_of_one_field_join_in_order():
    with pytest.warns(FutureWarning):
        config = RecomputeConfig(kept_units=["mlp"], units=["attn"], regions=["*.core"])
    assert config.kept_units == (RecomputeUnit.MLP, RecomputeUnit.ATTN, "*.core")
    with warnings.catch_warnings():  # the current names alone: a copy with a change warns of nothing
        warnings.simplefilter("error")
        assert dataclasses.replace(config, every_nth_layer=2).kept_units == config.kept_units
    with pytest.warns(FutureWarning), pytest.raises(ConfigError) as error:
        RecomputeConfig(kept_units=["attn"], units=["attn"])
    assert str(error.value) == "recompute config: kept_units: a unit is listed twice: ['attn', 'attn']"
    with pytest.warns(FutureWarning), pytest.raises(ConfigError) as error:
        RecomputeConfig(units=["attn", 5])
    assert str(error.value) == "recompute config: units[1]: a recompute unit name is a str such as 'attn', got 5 (int)"


def test_catalog_units_go_through_the_target_map_and_other_names_pass_as_written():
    config = RecomputeConfig(kept_units=["attn", "attention.core*"], offloaded_units=["mlp", "experts"])
    assert config.kept_units == (RecomputeUnit.ATTN, "attention.core*")
    assert config.selected_units == (RecomputeUnit.ATTN, RecomputeUnit.MLP)
    assert config.field_of(RecomputeUnit.MLP) == "offloaded_units[0]"
    policy = policy_for(config, LLAMA_TARGETS)
    assert LLAMA_TARGETS[RecomputeUnit.ATTN].resolve() <= policy.kept_ops
    assert policy.kept_units == {"attention.core*"}
    assert policy.offloaded_units == {"mlp", "experts"}  # mlp: Llama's callables run in unit "mlp"
    # A Policy error names the config's field as it is, the two names being one.
    with pytest.raises(ConfigError) as error:
        policy_for(RecomputeConfig(offloaded_ops=["aten::bernoulli_.float"]), LLAMA_TARGETS)
    assert str(error.value).startswith("recompute config: offloaded_ops: 'aten::bernoulli_.float' names ")


def test_a_misspelt_unit_passes_as_written_and_is_named_at_the_first_forward():
    # Outside the catalog a name is a unit the model's code may open, so the config takes it; the
    # first forward finds that nothing opened it and names the closest catalog unit.
    model = Llama(vocab=64, dim=32, layers=2, seq=16)
    apply_recompute_config(model, RecomputeConfig(kept_units=["atn"]))
    tokens = torch.randint(0, 64, (2, 16))
    with pytest.warns(UserWarning) as warned:
        model.loss(tokens, tokens).backward()
    assert [str(w.message) for w in warned] == [
        "sac_plugin: kept unit 'atn' is declared by no model and was not opened in the forward of a "
        "checkpointed region with Policy(kept_ops=[], kept_units=['atn']), so it keeps nothing. Units "
        "opened there: none; closest match: 'attn' (warned once per policy)"
    ]
