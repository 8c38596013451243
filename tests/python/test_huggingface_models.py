"""Hugging Face transformers across model types: tiny random-init models (no download) built from
their config classes, checkpointed with full recompute and with units (shipped maps for six
types, derived maps for the rest), have loss and every gradient bitwise equal to the unmodified
model's, keep the attention they are told to keep (audit hits), plan budgets per layer, and
train bitwise-equal under transformers' Trainer."""

import copy
import dataclasses
import logging

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, RecomputeConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
from sac_plugin.integrations import huggingface  # noqa: E402
from support.transformers_models import enable_transformers_checkpointing, reference_for  # noqa: E402

LAYERS, VOCAB, BATCH, SEQ = 2, 128, 2, 8
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# model_type -> (config fields, fields that set dropout). Dropout is off everywhere: a random
# mask is replayed by the recompute, but the reference it is compared with has none to replay.
MODELS = {
    "llama": dict(_DECODER, attention_dropout=0.0),
    "mistral": dict(_DECODER, attention_dropout=0.0),
    "qwen2": dict(_DECODER, attention_dropout=0.0),
    "mixtral": dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0),
    "qwen2_moe": dict(_DECODER, **_MOE, num_experts=4, shared_expert_intermediate_size=32, attention_dropout=0.0),
    "gpt2": dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=LAYERS,
        n_head=4,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    ),
    "qwen3": dict(_DECODER, head_dim=8, attention_dropout=0.0),
    "qwen3_moe": dict(_DECODER, **_MOE, num_experts=4, head_dim=8, attention_dropout=0.0),
    "gemma2": dict(_DECODER, head_dim=8, attention_dropout=0.0),
    "gemma3_text": dict(_DECODER, head_dim=8, attention_dropout=0.0),
    "phi3": dict(_DECODER, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "olmo2": dict(_DECODER, attention_dropout=0.0),
    "olmoe": dict(_DECODER, num_experts=4, num_experts_per_tok=2, attention_dropout=0.0),
    # first_k_dense_replace=1: layer 0 is dense, layer 1 a MoE (a mixed stack).
    "deepseek_v3": dict(
        _DECODER,
        **_MOE,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,
        attention_dropout=0.0,
    ),
    "gpt_neox": dict(_DECODER, rotary_pct=0.25, attention_dropout=0.0, hidden_dropout=0.0),
    "falcon": dict(_DECODER, attention_dropout=0.0, hidden_dropout=0.0),
    "bert": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=32,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    ),
}
MOE_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"}
SHIPPED = {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gpt2"}
# The attention submodule of each layer, by the transformers name the derived map must find.
ATTENTION_NAME = {"gpt2": "attn", "gpt_neox": "attention", "falcon": "self_attention", "bert": "attention"}
SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _available(model_type):
    try:
        transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as error:
        return pytest.param(
            model_type,
            marks=pytest.mark.skip(
                reason=f"transformers {transformers.__version__} has no model type {model_type!r}: {error}"
            ),
        )
    return model_type


TYPES = [_available(t) for t in MODELS]
# Attention implementations a model type lacks (transformers refuses them at construction).
NO_SDPA = {"gemma2": "Gemma2 has no SDPA attention in transformers (it refuses attn_implementation='sdpa')"}


def build(model_type, attention=None):
    attention = attention or ("eager" if model_type in NO_SDPA else "sdpa")
    config = transformers.AutoConfig.for_model(model_type, attn_implementation=attention, **MODELS[model_type])
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    model.train()
    return model


def batch():
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": tokens, "labels": tokens}


def step(model):
    torch.manual_seed(3)
    loss = model(**batch()).loss
    loss.backward()
    return loss


def assert_bitwise_equal(model, reference):
    with sac_plugin.audit() as audit:
        loss = step(model)
    expected = step(reference)
    assert torch.equal(loss, expected), (loss.item(), expected.item())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    return audit


def attention_modules(model):
    return [
        getattr(layer, ATTENTION_NAME.get(model.config.model_type, "self_attn"))
        for layer in huggingface.decoder_layers(model)
    ]


UNITS = {"full": (), "attn": ("attn",), "moe_gate": ("moe_gate",), "mlp+moe_gate": ("mlp", "moe_gate")}


# Some layers write in place a tensor a kept call produced (the MoE block writes into its kept
# router's output; Falcon's eager attention divides its kept scores in place): both engines copy
# that kept output before the write and serve the copy (NOTE: [Kept outputs written in the forward]).


def cases():
    for model_type in TYPES:
        name = model_type if isinstance(model_type, str) else model_type.values[0]
        type_marks = [] if isinstance(model_type, str) else list(model_type.marks)
        for units in UNITS:
            if units.startswith(("moe", "mlp")) and name not in MOE_TYPES:
                continue
            for attention in ("eager", "sdpa"):
                marks = list(type_marks)
                if attention == "sdpa" and name in NO_SDPA:
                    marks.append(pytest.mark.skip(reason=NO_SDPA[name]))
                yield pytest.param(name, units, attention, id=f"{name}-{units}-{attention}", marks=marks)


@pytest.mark.parametrize(("model_type", "units", "attention"), list(cases()))
def test_full_recompute_and_units_are_bitwise(model_type, units, attention):
    model = build(model_type, attention)
    reference = reference_for(model_type, model)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=list(UNITS[units])))
    audit = assert_bitwise_equal(model, reference)
    matmuls = audit.hits("aten::mm") + audit.hits("aten::addmm") + audit.hits("aten::bmm")
    if units == "full":
        assert matmuls == 0
    elif units == "attn":
        # The attention is served in the recompute: its projections' matmuls are kept.
        assert matmuls > 0, audit


@pytest.mark.parametrize("model_type", TYPES)
def test_the_derived_attention_unit_is_the_attention_module(model_type):
    model = build(model_type)
    target = huggingface.target_map_for(model)["attn"]
    for layer, attention in zip(huggingface.decoder_layers(model), attention_modules(model)):
        assert [getattr(owner, name) for owner, name in target.find(layer)] == [attention]
    derived = huggingface.derived_target_map(model)["attn"]
    assert derived.paths == (ATTENTION_NAME.get(model_type, "self_attn"),)


@pytest.mark.parametrize("model_type", ["qwen3", "bert"])
def test_configs_without_units_need_no_map(model_type):
    model = build(model_type)
    reference = copy.deepcopy(model)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_ops=["aten::mm", "aten::addmm"]), target_map=None)
    audit = assert_bitwise_equal(model, reference)
    assert audit.hits("aten::mm") + audit.hits("aten::addmm") > 0


def test_the_derived_map_of_a_mixed_stack():
    model = build("deepseek_v3")
    dense, moe = huggingface.decoder_layers(model)
    target_map = huggingface.target_map_for(model)
    assert [u.value for u in target_map] == ["attn", "mlp", "moe_gate", "moe_dispatch", "norm"]
    assert target_map["mlp"].paths == ("mlp", "mlp.experts", "mlp.shared_experts")
    assert [name for _, name in target_map["mlp"].find(dense)] == ["mlp"]
    assert [name for _, name in target_map["mlp"].find(moe)] == ["experts", "shared_experts"]
    assert target_map["moe_gate"].find(dense) == []
    assert [name for _, name in target_map["moe_gate"].find(moe)] == ["gate"]


def test_a_unit_found_in_no_selected_layer_is_named():
    model = build("deepseek_v3")
    with pytest.raises(ConfigError) as error:
        huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate"], every_nth_layer=2))
    assert str(error.value) == (
        "recompute config: kept_units[0]: unit 'moe_gate' of deepseek_v3 (Hugging Face, derived) "
        "(mlp.gate) matches nothing in any of the 1 selected layers (DeepseekV3DecoderLayer)"
    )
    assert not any("_sac_policy" in vars(m) or "_sac_forward_units" in vars(m) for m in model.modules())


def test_a_unit_in_some_layers_of_a_mixed_stack_is_installed_there(caplog):
    model = build("deepseek_v3")
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.DEBUG, logger="sac_plugin"):
        huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate"]))
    assert "unit 'moe_gate' (deepseek_v3 (Hugging Face, derived)) is in layers 1 of 2 (1) only" in caplog.messages
    dense, moe = huggingface.decoder_layers(model)
    assert "_sac_forward_units" not in vars(dense.mlp)
    assert vars(moe.mlp.gate)["_sac_forward_units"] == ("moe_gate",)
    assert_bitwise_equal(model, reference)


def test_a_derived_map_is_logged_once(caplog):
    huggingface._logged_derived_maps.discard(transformers.Qwen3ForCausalLM)
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        for _ in range(2):
            huggingface.apply_recompute_config(build("qwen3"), RecomputeConfig(kept_units=["attn"]))
    derived = [r.getMessage() for r in caplog.records if "derived from" in r.getMessage()]
    assert derived == [
        "Qwen3ForCausalLM: no shipped target map for model_type 'qwen3'; derived from "
        "Qwen3DecoderLayer: attn -> self_attn; mlp -> mlp; norm -> input_layernorm, "
        "post_attention_layernorm"
    ]


def test_without_checkpointable_layers_the_layers_are_the_class_repeated_in_a_module_list():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    model = torch.nn.Module()
    model.embed = torch.nn.ModuleList([torch.nn.Embedding(8, 4)])
    model.blocks = torch.nn.ModuleList([Block(), Block(), Block()])
    assert huggingface.decoder_layers(model) == list(model.blocks)


def test_the_layers_of_an_encoder_are_its_blocks_not_its_embeddings():
    model = build("bert")
    assert [type(layer).__name__ for layer in huggingface.decoder_layers(model)] == ["BertLayer"] * LAYERS
    assert "BertEmbeddings" in model._no_split_modules


@pytest.mark.parametrize("sites", ["found", "given"])
def test_bert_through_gradient_checkpointing_kwargs(sites):
    model = build("bert")
    reference = copy.deepcopy(model)
    wrap_sites = None if sites == "found" else list(model.bert.encoder.layer)
    kwargs = huggingface.gradient_checkpointing_kwargs(
        model, RecomputeConfig(kept_units=["attn"]), wrap_sites=wrap_sites
    )
    enable_transformers_checkpointing(model, kwargs)
    audit = assert_bitwise_equal(model, reference)
    # Per layer: the query, key, value and output projections of the attention are kept.
    assert audit.hits("aten::addmm") == 4 * LAYERS


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_a_budget_is_planned_per_layer_and_bitwise(model_type):
    model = build(model_type)
    reference = copy.deepcopy(model)
    huggingface.apply_recompute_config(model, RecomputeConfig(budget=0.3), example_inputs=batch())
    layers = huggingface.decoder_layers(model)
    plans = [layer._sac_plan for layer in layers]
    budget = int(0.3 * sum(p.profile.no_checkpoint_bytes for p in plans))
    assert sum(p.held_bytes for p in plans) <= budget
    assert all(layer._sac_policy is plan.policy for layer, plan in zip(layers, plans))
    # DeepSeek-V3's dense and MoE layers are two planning problems; Llama's two layers are one.
    assert (plans[0].profile is plans[1].profile) == (model_type == "llama")
    assert_bitwise_equal(model, reference)


def test_a_budget_needs_an_example_batch():
    model = build("llama")
    with pytest.raises(
        ConfigError,
        match=r"^recompute config: a budget for a transformers model is planned on an "
        r"example batch: pass example_inputs=batch",
    ):
        huggingface.apply_recompute_config(model, RecomputeConfig(budget=0.3))
    assert not any("_sac_policy" in vars(module) for module in model.modules())


def test_trainer_three_steps_are_bitwise(tmp_path):
    pytest.importorskip(
        "accelerate", reason="accelerate is not installed (tools/setup.sh installs it); transformers' Trainer needs it"
    )

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            tokens = torch.randint(3, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": tokens, "labels": tokens}

    # transformers 5 renamed the gradient_checkpointing arguments (deprecated until v6).
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    switch = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"

    def train(model, checkpointing_kwargs, name, model_init=None):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name),
            max_steps=3,
            per_device_train_batch_size=2,
            **{switch: checkpointing_kwargs is not None, f"{switch}_kwargs": checkpointing_kwargs},
            report_to=[],
            use_cpu=True,
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
            save_strategy="no",
            logging_steps=1,
        )
        trainer = transformers.Trainer(model=model, model_init=model_init, args=args, train_dataset=Tokens())
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer.model

    model = build("qwen3")
    reference = copy.deepcopy(model)
    kwargs = huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(kept_units=["attn"]))
    with sac_plugin.audit() as audit:
        losses, _ = train(model, kwargs, "sac")
    # Each step's recompute is served the attention's kept calls (SDPA and projections).
    assert audit.hits(SDPA_CPU) == 3 * LAYERS
    expected, _ = train(reference, None, "reference")
    assert len(losses) == 3 and losses == expected
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    # Trainer(model_init=...) trains a model it builds, with kwargs built on another instance:
    # they keep their selection there.
    with sac_plugin.audit() as audit:
        losses, trained = train(None, kwargs, "model_init", model_init=lambda: build("qwen3"))
    assert trained is not model and audit.hits(SDPA_CPU) == 3 * LAYERS
    assert losses == expected


# --- derived maps of models whose layers are built differently ----------------------------------

_GRANITE = dict(
    _DECODER, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32, attention_dropout=0.0
)
DERIVED = {
    # JetMoE: the attention holds experts of its own (mixture of attention heads); the MoE block,
    # `mlp`, holds a router and two expert linears, no `experts` module.
    "jetmoe": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=64,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attention_dropout=0.0,
    ),
    # Granite: a shared MLP beside the MoE block, run on every token.
    "granitemoeshared": _GRANITE,
    "granitemoehybrid": dict(_GRANITE, layer_types=["attention"] * LAYERS, mamba_n_heads=4, mamba_d_head=16),
    # T5: a block's sublayers are items of one ModuleList (`layer`), whose own forward never runs.
    "t5": dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=LAYERS,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
}


def build_derived(model_type):
    attention = "eager" if model_type == "jetmoe" else "sdpa"  # JetMoE has no SDPA
    config = transformers.AutoConfig.for_model(model_type, attn_implementation=attention, **DERIVED[model_type])
    torch.manual_seed(0)
    auto = transformers.AutoModelForSeq2SeqLM if model_type == "t5" else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    model.train()
    return model


# Each unit's paths in the first layer, and what it serves from the forward: the calls its
# submodules run (the recompute stops early, before a layer's last matmul, which it never needs).
DERIVED_UNITS = {
    "jetmoe": {
        "paths": {
            "attn": ["self_attention"],
            "mlp": ["mlp.input_linear", "mlp.output_linear"],
            "moe_gate": ["mlp.router"],
        },
        # the expert linears' matmuls (4 experts, in and out, 2 layers), no routing op
        "mlp": {"aten::mm": 16, "aten::cat": 4},
        # the router: its projection, top-k and what sorts the tokens by expert
        "moe_gate": {"aten::mm": 2, "aten::topk": 2, "aten::sort": 2},
    },
    "granitemoeshared": {
        "paths": {
            "attn": ["self_attn"],
            "mlp": ["block_sparse_moe.experts", "shared_mlp"],
            "moe_gate": ["block_sparse_moe.router"],
        },
        # the experts' grouped matmuls and the shared MLP's input projection
        "mlp": {"aten::_grouped_mm": 4, "aten::mm": 2},
        "moe_gate": {"aten::mm": 2, "aten::topk": 2},
    },
    "granitemoehybrid": {
        "paths": {
            "attn": ["self_attn"],
            "mlp": ["block_sparse_moe.experts", "shared_mlp"],
            "moe_gate": ["block_sparse_moe.router"],
        },
        "mlp": {"aten::_grouped_mm": 4, "aten::mm": 2},
        "moe_gate": {"aten::mm": 2, "aten::topk": 2},
    },
    "t5": {
        # encoder blocks (self-attention, feed-forward) come first
        "paths": {"attn": ["layer.0"], "mlp": ["layer.1"]},
        # the attention of 2 encoder and 2 decoder blocks (the decoder's self and cross), 4 of
        # whose 8 kept bmm outputs it writes in place (served from copies), and each
        # feed-forward's input projection and ReLU
        "attn": {SDPA_CPU: 2, "aten::bmm": 8},
        "mlp": {"aten::mm": 4, "aten::relu": 4},
    },
}


@pytest.mark.parametrize("model_type", list(DERIVED))
def test_a_derived_map_finds_what_each_unit_names(model_type):
    model = build_derived(model_type)
    layer = huggingface.decoder_layers(model)[0]
    target_map = huggingface.target_map_for(model)
    expected = DERIVED_UNITS[model_type]
    names = {id(module): name for name, module in layer.named_modules()}
    found = {
        unit.value: [names[id(getattr(owner, name))] for owner, name in target.find(layer)]
        for unit, target in target_map.items()
        if unit.value in expected["paths"]
    }
    assert found == expected["paths"]


@pytest.mark.parametrize(("model_type", "unit"), [(t, u) for t, e in DERIVED_UNITS.items() for u in e if u != "paths"])
def test_a_derived_unit_keeps_what_it_names_bitwise(model_type, unit):
    model = build_derived(model_type)
    reference = copy.deepcopy(model)
    # Routing is not pinned here, so that a unit is seen to serve exactly what it names; with it
    # pinned (the default) every router's top-k and sort are served as well.
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=[unit], pin_routing=False))
    audit = assert_bitwise_equal(model, reference)
    expected = dict(DERIVED_UNITS[model_type][unit])
    assert {op: audit.hits(op) for op in expected} == expected
    if model_type == "jetmoe" and unit == "mlp":
        assert audit.hits("aten::topk") == 0  # the attention's own router is not the MLP


def test_a_unit_whose_module_never_runs_is_refused_naming_both():
    model = build_derived("t5")
    target_map = sac_plugin.RecomputeTargetMap("t5 (mine)", {"mlp": sac_plugin.KeptCallables(["layer"])})
    with pytest.raises(ConfigError) as error:
        huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["mlp"]), target_map=target_map)
    assert str(error.value) == (
        "recompute config: kept_units[0]: unit 'mlp' of t5 (mine) is T5Block.layer, a ModuleList, whose forward never "
        "runs (its items are called one by one), so the unit would keep nothing; name the submodules that run in "
        "target_map=RecomputeTargetMap(...)"
    )
    assert not any("_sac_policy" in vars(m) or "_sac_forward_units" in vars(m) for m in model.modules())


def test_albert_is_refused_in_transformers_words():
    config = transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=64,
    )
    model = transformers.AlbertForMaskedLM(config)
    with pytest.raises(ValueError) as theirs:
        model.activation_checkpointing_enable()
    for entry in (huggingface.apply_recompute_config, huggingface.gradient_checkpointing_kwargs):
        with pytest.raises(TypeError) as ours:
            entry(model, RecomputeConfig(kept_units=["attn"]))
        assert str(ours.value) == (
            f"sac_plugin: huggingface.{entry.__name__}: {str(theirs.value).rstrip('.')} (transformers' own refusal: "
            "its layers, AlbertLayerGroup, have no checkpointing hook); call sac_plugin.apply_selective_checkpointing "
            "on the layers to checkpoint them anyway"
        )


# Zamba2: a hybrid of Mamba layers and Mamba layers with a shared attention block beside them.
ZAMBA2 = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_head_dim=8,
    mamba_d_state=8,
    mamba_headdim=8,
    n_mamba_heads=8,
    intermediate_size=64,
    max_position_embeddings=32,
    layers_block_type=["mamba", "hybrid"],
    hybrid_layer_ids=[1],
    use_mem_eff_path=False,
    pad_token_id=0,
    attention_dropout=0.0,
)


@pytest.mark.parametrize("model_type", ["jetmoe", "t5", "zamba2"])
def test_hybrid_mixture_of_attention_and_encoder_decoder_models_take_a_config_in_one_call(model_type):
    # One call, as for any decoder: no kwargs refused on a layer type, no "does not support
    # activation checkpointing"; the attention served, bitwise.
    if model_type == "zamba2":
        config = transformers.AutoConfig.for_model("zamba2", **ZAMBA2)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).train()
    else:
        model = build_derived(model_type)
    reference = reference_for(model_type, model)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    audit = assert_bitwise_equal(model, reference)
    assert sum(row.hits for row in audit.rows()) > 0 and audit.never_served() == 0
