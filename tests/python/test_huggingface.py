"""Hugging Face transformers: the shipped target maps checkpoint tiny random-init models (no
download) with loss and every gradient bitwise equal to the unmodified model's, and keep exactly
what their units name (audit hits)."""

import collections
import logging
import copy
import re
import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, RecomputeConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
from sac_plugin.integrations import huggingface  # noqa: E402
from sac_plugin.integrations._huggingface_contexts import _checkpoint_layer  # noqa: E402
from support.transformers_models import enable_transformers_checkpointing, reference_for  # noqa: E402

LAYERS = 2
_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
CONFIGS = {
    "llama": _COMMON,
    "mistral": _COMMON,
    "qwen2": _COMMON,
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0),
}
# Calls of mm/addmm in one layer's attention module: the q, k, v and output projections (GPT-2
# fuses q, k and v into one Conv1D).
ATTENTION_PROJECTIONS = {"llama": 4, "mistral": 4, "qwen2": 4, "mixtral": 4, "qwen2_moe": 4, "gpt2": 2}
SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def build(model_type: str, attention: str, dropout: bool):
    kwargs = dict(CONFIGS[model_type])
    p = 0.1 if dropout else 0.0
    if model_type == "gpt2":
        kwargs.update(attn_pdrop=p, resid_pdrop=p, embd_pdrop=p)
    else:
        kwargs.update(attention_dropout=p)
    config = transformers.AutoConfig.for_model(model_type, attn_implementation=attention, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def step(model, seed=3):
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss


def assert_bitwise_equal(model, reference):
    with sac_plugin.audit() as audit:
        loss = step(model)
    expected = step(reference)
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    return audit


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
# Eager attention runs in the native-engine pass only (slow): the other two passes cover sdpa.
@pytest.mark.parametrize("attention", [pytest.param("eager", marks=pytest.mark.slow), "sdpa"])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_attn_unit_is_bitwise_and_keeps_the_attention(model_type, attention, dropout, caplog):
    model = build(model_type, attention, dropout)
    reference = reference_for(model_type, model)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    caplog.set_level(logging.INFO, logger="sac_plugin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit = assert_bitwise_equal(model, reference)
    projections = audit.hits("aten::mm") + audit.hits("aten::addmm")
    assert projections == ATTENTION_PROJECTIONS[model_type] * LAYERS
    sdpa_hits = audit.hits(SDPA_CPU)
    sac_warnings = [str(w.message) for w in caught if str(w.message).startswith("sac")]
    if attention == "sdpa" and model_type != "gpt2":
        # With dropout, CPU SDPA takes its math path (no fused op to keep).
        assert sdpa_hits == (0 if dropout else LAYERS)
    # Nothing the user can act on is a warning: the dropout's in-place writes in the kept unit are
    # recomputed by design, said at INFO once per checkpointed layer (a checkpoint site each).
    assert sac_warnings == []
    said = [record.getMessage() for record in caplog.records if "inside kept unit" in record.getMessage()]
    if dropout:
        assert said and set(collections.Counter(said).values()) == {LAYERS}
        for message in said:
            assert re.fullmatch(
                r"sac: aten::\w+\.?\w* mutates an input inside kept unit 'attn'; it is recomputed "
                r"rather than kept \(said once per checkpoint site\)",
                message,
            ), message
    else:
        assert said == []


# mixtral's experts write a tensor its kept units produced (index_put_ into the routed buffer):
# both engines copy that kept output before the write (NOTE: [Kept outputs written in the forward]).
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_unit_of_the_target_map(model_type):
    model = build(model_type, "sdpa", dropout=False)
    reference = reference_for(model_type, model)
    units = [unit.value for unit in huggingface.HF_TARGET_MAPS[model_type]]
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=units, every_nth_layer=2, first_layer=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit = assert_bitwise_equal(model, reference)
    # No unit check fires: every unit of the map opens and keeps something.
    assert [str(w.message) for w in caught if str(w.message).startswith("sac_plugin:")] == []
    layers = huggingface.decoder_layers(model)
    assert ["_sac_policy" in vars(layer) for layer in layers] == [False, True]
    if "moe_dispatch" in units:
        # The checkpointed layer's routing (sort and counts) is served, never run again.
        assert audit.hits("aten::sort") == audit.hits("aten::histc") == 1
        assert audit.count("aten::sort", "recompute") == audit.count("aten::histc", "recompute") == 0


def test_the_core_apply_recompute_config_takes_a_transformers_model():
    model = build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(model)
    sac_plugin.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    audit = assert_bitwise_equal(model, reference)
    assert audit.hits(SDPA_CPU) == LAYERS


def test_the_cache_is_off_in_training_and_on_in_eval():
    model = build("llama", "sdpa", dropout=False)
    huggingface.apply_recompute_config(model)
    step(model)  # a cache written in the forward and again in the recompute would fail here
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(64, (1, 4)), use_cache=True)
    assert out.past_key_values is not None


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_gradient_checkpointing_kwargs_recipe(model_type):
    model = build(model_type, "sdpa", dropout=True)
    reference = copy.deepcopy(model)
    enable_transformers_checkpointing(
        model, huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(kept_units=["mlp"]))
    )
    audit = assert_bitwise_equal(model, reference)
    assert audit.hits("aten::silu") == LAYERS  # the MLP's (the experts') activation, one call per layer


def test_bad_input_is_named():
    with pytest.raises(ConfigError) as error:
        huggingface.target_map_for(torch.nn.Linear(2, 2))
    assert str(error.value) == (
        "Linear has no layers sac_plugin can find (no GradientCheckpointingLayer, no ModuleList "
        "of one class); pass wrap_sites=[the layers to checkpoint]"
    )
    model = build("llama", "sdpa", False)
    with pytest.raises(ConfigError) as error:
        huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(every_nth_layer=2))
    assert str(error.value).startswith(
        "recompute config: transformers' gradient checkpointing checkpoints every decoder layer"
    )
    with pytest.raises(
        ConfigError,
        match=r"^recompute config: kept_units\[0\]: llama \(Hugging Face\) declares no unit "
        r"'moe_gate' \(it declares attn, mlp, norm\)$",
    ):
        huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["moe_gate"]))
    huggingface.apply_recompute_config(model)
    with pytest.raises(ValueError, match="is already checkpointed by sac_plugin; apply a config once per model$"):
        huggingface.apply_recompute_config(model)
    other = build("llama", "sdpa", False)
    enable_transformers_checkpointing(other, {"use_reentrant": False})
    with pytest.raises(
        ValueError,
        match="has transformers' gradient checkpointing enabled; call "
        r"model.gradient_checkpointing_disable\(\) first",
    ):
        huggingface.apply_recompute_config(other)


def test_a_budget_through_the_core_entry_point_is_planned_and_bitwise():
    model = build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(model)
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    sac_plugin.apply_recompute_config(
        model, RecomputeConfig(budget=0.3), example_inputs={"input_ids": tokens, "labels": tokens}
    )
    layers = huggingface.decoder_layers(model)
    assert all(layer._sac_policy is layer._sac_plan.policy for layer in layers)
    assert_bitwise_equal(model, reference)


def test_a_budget_is_refused_by_gradient_checkpointing_kwargs():
    model = build("llama", "sdpa", dropout=False)
    with pytest.raises(ConfigError) as error:
        huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(budget=0.3))
    assert str(error.value).startswith(
        "recompute config: gradient_checkpointing_kwargs hands every layer one policy, and a budget plans one per layer"
    )
    assert not any("_sac_policy" in vars(module) for module in model.modules())


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe"])
def test_offloaded_units_pass_through_and_serve_what_kept_units_serve(model_type):
    # On the CPU offloading is keeping (one warning), so an offloaded selection serves exactly the
    # calls the kept one does, bitwise.
    units = [unit.value for unit in huggingface.HF_TARGET_MAPS[model_type] if unit.value != "norm"][:2]
    served = {}
    for field in ("kept_units", "offloaded_units"):
        model = build(model_type, "sdpa", dropout=False)
        reference = reference_for(model_type, model)
        huggingface.apply_recompute_config(model, RecomputeConfig(**{field: units}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            audit = assert_bitwise_equal(model, reference)
        policy = huggingface.decoder_layers(model)[0]._sac_policy
        assert (
            (policy.offloaded_units or policy.offloaded_ops) if field == "offloaded_units" else policy.offloads_nothing
        )
        served[field] = {row.op: row.hits for row in audit.rows() if row.hits}
    assert served["kept_units"] and served["offloaded_units"] == served["kept_units"]


# --- instance forwards already installed (accelerate's hooks, a user's patch) ----------------------


def _scaling_hook():
    """An accelerate hook that changes what its module computes (its input scaled by 2), counting
    its calls: accelerate's add_hook_to_module installs it as the module's instance forward, as
    device_map and CPU offload do."""
    from accelerate.hooks import ModelHook

    class Scale(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Scale.calls += 1
            return tuple(a * 2 if torch.is_tensor(a) and a.is_floating_point() else a for a in args), kwargs

    return Scale()


def _patched(module, how: str):
    if how == "accelerate":
        from accelerate.hooks import add_hook_to_module

        hook = _scaling_hook()
        add_hook_to_module(module, hook)
        return hook
    forward = module.forward
    module.forward = lambda x: forward(x * 2)  # a user's patch
    return None


@pytest.mark.parametrize("how", ["accelerate", "patch"])
def test_an_instance_forward_runs_inside_the_checkpoint_and_is_restored(how):
    pytest.importorskip("accelerate", reason="accelerate is not installed (tools/setup.sh installs it)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    hook, _ = _patched(model, how), _patched(reference, how)
    installed = vars(model)["forward"]
    x = torch.randn(4, 8, requires_grad=True)
    expected = reference(x)
    expected.sum().backward()
    sac_plugin.apply_selective_checkpointing(model, sac_plugin.Policy(kept_ops=["aten::addmm"]))
    calls_before = type(hook).calls if hook else 0
    with sac_plugin.audit() as audit:
        out = model(x)
        out.sum().backward()
    assert torch.equal(out, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    # The first Linear's kept output is served; the recompute stops before the second (early stop).
    assert audit.hits("aten::addmm") == 1
    if hook:  # inside the checkpoint: it runs again in the recompute
        assert type(hook).calls - calls_before == 2
    sac_plugin.remove_checkpointing(model)
    assert vars(model)["forward"] is installed
    assert torch.equal(model(x), expected)


def test_an_accelerate_hook_on_a_unit_runs_inside_it():
    pytest.importorskip("accelerate", reason="accelerate is not installed (tools/setup.sh installs it)")
    model = build("llama", "sdpa", dropout=False)
    for layer in huggingface.decoder_layers(model):
        _patched(layer.self_attn, "accelerate")
    reference = copy.deepcopy(model)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    audit = assert_bitwise_equal(model, reference)
    assert audit.hits(SDPA_CPU) == LAYERS
    sac_plugin.remove_checkpointing(model)
    assert all(
        type(vars(layer.self_attn)["forward"]).__name__ == "partial" for layer in huggingface.decoder_layers(model)
    )


# --- transformers' entry point: activation_checkpointing_enable(kwargs, every_n_layers, offload) ---


def _assert_the_first_of_two_layers_is_checkpointed_until_removed(model, reference):
    """every_nth_layer=2 of a two-layer model: the first layer alone is checkpointed, bitwise, and
    remove_checkpointing leaves no checkpoint function on any module."""
    layers = huggingface.decoder_layers(model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert "_gradient_checkpointing_func" not in vars(layers[1])
    audit = assert_bitwise_equal(model, reference)
    assert audit.hits(SDPA_CPU) == 1
    sac_plugin.remove_checkpointing(model)
    assert not any("_gradient_checkpointing_func" in vars(module) for module in model.modules())


def test_apply_recompute_config_goes_through_transformers_entry_point(monkeypatch):
    model = build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(model)
    calls = []
    enable = type(model).activation_checkpointing_enable

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("every_n_layers"))
        return enable(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "activation_checkpointing_enable", spy)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"], every_nth_layer=2))
    assert calls == [2]
    _assert_the_first_of_two_layers_is_checkpointed_until_removed(model, reference)
    assert not model.is_activation_checkpointing and "_require_grads_hook" not in vars(model)


def test_apply_recompute_config_goes_through_gradient_checkpointing_enable_before_the_rename(monkeypatch):
    # transformers before activation_checkpointing_enable: its one entry point, which knows no
    # every_n_layers, checkpoints every layer, and the config's selection is what stays on.
    model = build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(model)
    calls = []

    def old_enable(self, gradient_checkpointing_kwargs=None):
        calls.append(gradient_checkpointing_kwargs)
        self._activation_checkpointing_enable(gradient_checkpointing_kwargs)

    monkeypatch.delattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable", old_enable)
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"], every_nth_layer=2))
    assert calls == [{"use_reentrant": False}]
    _assert_the_first_of_two_layers_is_checkpointed_until_removed(model, reference)


def _refuse_save_on_cpu(monkeypatch):
    import transformers.modeling_utils as modeling_utils

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' save_on_cpu wrapped the plugin's checkpoint")

    monkeypatch.setattr(modeling_utils, "save_on_cpu", refuse)


@pytest.mark.parametrize("every_n_layers", [1, 2])
def test_offload_true_offloads_through_the_plugin_and_every_n_layers_is_honoured(every_n_layers, monkeypatch):
    _refuse_save_on_cpu(monkeypatch)
    model = build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(model)
    kwargs = huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(kept_units=["attn"]))
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers, offload=True
    )
    layers = huggingface.decoder_layers(model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, every_n_layers == 1]
    policy = layers[0]._gradient_checkpointing_func.keywords["context_fn"].policy
    assert policy.offloaded_units == frozenset({"attn"}) and not policy.kept_units
    # The layers' inputs are offloaded too, through the plugin's checkpoint (on the CPU a no-op).
    assert policy.offload_inputs and layers[0]._gradient_checkpointing_func.func is _checkpoint_layer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on the CPU offloading is keeping, said once
        audit = assert_bitwise_equal(model, reference)
    assert audit.hits(SDPA_CPU) == LAYERS // every_n_layers
    # Without offload the same kwargs keep.
    model = build("llama", "sdpa", dropout=False)
    kwargs = huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(kept_units=["attn"]))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    policy = huggingface.decoder_layers(model)[0]._gradient_checkpointing_func.keywords["context_fn"].policy
    assert policy.kept_units == frozenset({"attn"}) and not policy.offloaded_units and not policy.offload_inputs


def test_kwargs_built_on_one_instance_keep_their_selection_on_another():
    built_on, used_on = build("llama", "sdpa", dropout=False), build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(used_on)
    kwargs = huggingface.gradient_checkpointing_kwargs(built_on, RecomputeConfig(kept_units=["attn"]))
    used_on.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    audit = assert_bitwise_equal(used_on, reference)
    assert audit.hits(SDPA_CPU) == LAYERS


def test_transformers_offload_on_another_instance_offloads_through_the_plugin():
    # Trainer(model_init=...): the kwargs were built on one instance, and transformers' own
    # activation_checkpointing_enable(..., offload=True) runs on the one it trains.
    built_on, used_on = build("llama", "sdpa", dropout=False), build("llama", "sdpa", dropout=False)
    reference = copy.deepcopy(used_on)
    kwargs = huggingface.gradient_checkpointing_kwargs(built_on, RecomputeConfig(kept_units=["attn"]))
    type(used_on).activation_checkpointing_enable(used_on, activation_checkpointing_kwargs=kwargs)

    def transformers_offload(checkpoint_func):
        # What transformers' offload=True makes of a layer's checkpoint (save_on_cpu on the compute
        # stream; it pins only where there is an accelerator, so unpinned here).
        def offloaded(function, *args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                return checkpoint_func(function, *args, **kwargs)

        return offloaded

    for layer in huggingface.decoder_layers(used_on):
        layer._gradient_checkpointing_func = transformers_offload(layer._gradient_checkpointing_func)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on the CPU offloading is keeping, said once
        audit = assert_bitwise_equal(used_on, reference)
    assert audit.hits(SDPA_CPU) == LAYERS  # the units' selection holds, offloaded
    for layer in huggingface.decoder_layers(used_on):
        func = layer._gradient_checkpointing_func
        assert func.func is _checkpoint_layer  # no save_on_cpu from the second step on
        policy = func.keywords["context_fn"].policy
        assert policy.offloaded_units == frozenset({"attn"}) and not policy.kept_units and policy.offload_inputs


def test_kwargs_on_a_model_without_their_units_raise_naming_it():
    kwargs = huggingface.gradient_checkpointing_kwargs(
        build("llama", "sdpa", dropout=False), RecomputeConfig(kept_units=["attn"])
    )
    other = build("gpt2", "sdpa", dropout=False)  # its attention is `attn`, not `self_attn`
    other.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    with pytest.raises(ConfigError) as error:
        step(other)
    assert str(error.value) == (
        "recompute config: gradient_checkpointing_kwargs were built for llama (Hugging Face), "
        "and the layer checkpointed now (GPT2Block) has none of the units ['attn']; build the "
        "kwargs on the model they are used with"
    )
