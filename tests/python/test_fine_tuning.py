"""Fine-tuning a transformers model checkpointed by sac_plugin: PEFT (LoRA) models take every entry
point, with gradients bitwise equal to the same PEFT model unchecked; transformers' Trainer keeps
the plugin's policy when it enables checkpointing itself, and saves checkpoints with the plugin's
kwargs in its TrainingArguments; a configured model pickles whole; `import sac_plugin` leaves
torch._dynamo unimported. The recipes of docs/fine-tuning.md (TRL's SFTTrainer, Lightning's
configure_model, accelerate on the CPU, torch's checkpoint_wrapper) keep the plugin's policy and
train bitwise as the model does unchecked."""

import copy
import functools
import json
import sys
import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import RecomputeConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
from sac_plugin.integrations import huggingface  # noqa: E402
from support.transformers_models import enable_transformers_checkpointing  # noqa: E402
from support.warm_interpreters import run_python  # noqa: E402

LAYERS = 2
SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
# mm calls in one layer's attention: its four projections, and lora_A and lora_B of q and v.
LORA_ATTENTION_MM = 4 + 2 * 2


def build():
    config = transformers.AutoConfig.for_model(
        "llama",
        attn_implementation="sdpa",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def batch():
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": tokens, "labels": tokens}


def step(model, seed=3):
    torch.manual_seed(seed)  # the same dropout masks in both models
    loss = model(**batch()).loss
    loss.backward()
    return loss


def lora(lora_dropout: float):
    peft = pytest.importorskip("peft", reason="peft is not installed (tools/setup.sh installs it)")
    torch.manual_seed(0)
    # init_lora_weights=False: lora_B is random too, so that lora_A has a gradient.
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=lora_dropout, init_lora_weights=False
    )
    return peft.get_peft_model(build(), config)


def assert_trainable_gradients_bitwise_equal(model, reference):
    with sac_plugin.audit() as audit, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' use_cache notice
        loss = step(model)
    assert torch.equal(loss, step(reference))
    trainable = 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            trainable += 1
            assert p.grad is not None and torch.equal(p.grad, q.grad), name
        else:
            assert p.grad is None and q.grad is None, name
    assert trainable
    return audit


# --- PEFT ------------------------------------------------------------------------------------------


def _through_huggingface(model):
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))


def _through_the_core(model):
    sac_plugin.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))


def _through_kwargs(model):
    enable_transformers_checkpointing(
        model, huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(kept_units=["attn"]))
    )


@pytest.mark.parametrize("lora_dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(
    "apply", [_through_huggingface, _through_the_core, _through_kwargs], ids=["huggingface", "core", "kwargs"]
)
def test_a_peft_lora_model_is_checkpointed_in_its_base_models_layers(apply, lora_dropout):
    model = lora(lora_dropout)
    reference = copy.deepcopy(model)
    assert huggingface.is_hf_model(model)
    layers = huggingface.decoder_layers(model)
    assert layers == huggingface.decoder_layers(model.get_base_model()) and len(layers) == LAYERS
    assert all(
        "lora_A" in dict(layer.named_modules(remove_duplicate=False)).get("self_attn.q_proj")._modules
        for layer in layers
    )
    assert huggingface.target_map_for(model) is huggingface.HF_TARGET_MAPS["llama"]
    apply(model)
    audit = assert_trainable_gradients_bitwise_equal(model, reference)
    # The LoRA adapters are in the kept attention: their mm calls are served with the projections'.
    assert audit.hits(SDPA_CPU) == LAYERS
    assert audit.hits("aten::mm") == LORA_ATTENTION_MM * LAYERS
    sac_plugin.remove_checkpointing(model)
    assert not any("_sac_policy" in vars(module) for module in model.modules())


# --- transformers' Trainer ---------------------------------------------------------------------------


def _training_arguments(output_dir, arguments=None, **kwargs):
    """`arguments` (transformers.TrainingArguments by default, or a subclass such as TRL's
    SFTConfig) for a short CPU run into `output_dir`, with `kwargs` on top."""
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        max_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradient_checkpointing is transformers' deprecated alias
        return (arguments or transformers.TrainingArguments)(**{**defaults, **kwargs})


def _train(model, args) -> sac_plugin.Audit:
    tokens = batch()["input_ids"]
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    with sac_plugin.audit() as audit, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return audit


def _hits_of_one_step(model) -> int:
    with sac_plugin.audit() as audit, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(model)
    return audit.hits(SDPA_CPU)


@pytest.mark.parametrize("peft", [False, True], ids=["llama", "lora"])
def test_the_trainers_gradient_checkpointing_keeps_the_applied_config(peft, tmp_path):
    model = lora(0.0) if peft else build()
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    expected = _hits_of_one_step(copy.deepcopy(model))
    audit = _train(model, _training_arguments(tmp_path, gradient_checkpointing=True))
    assert audit.hits(SDPA_CPU) == expected == LAYERS
    assert all(layer._sac_policy.kept_units == frozenset({"attn"}) for layer in huggingface.decoder_layers(model))


def test_enabling_transformers_checkpointing_asking_for_more_raises_naming_the_fix():
    model = build()
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    layers = huggingface.decoder_layers(model)
    functions = [layer._gradient_checkpointing_func for layer in layers]
    for asked in (
        {"every_n_layers": 2},
        {"offload": True},
        {"activation_checkpointing_kwargs": {"use_reentrant": True}},
    ):
        with pytest.raises(ValueError) as error:
            model.activation_checkpointing_enable(**asked)
        message = str(error.value)
        assert message.startswith("sac_plugin: LlamaForCausalLM.activation_checkpointing_enable(")
        assert "sac_plugin.remove_checkpointing(model)" in message and "RecomputeConfig" in message
        assert [layer._gradient_checkpointing_func for layer in layers] == functions
    # Once transformers turned the config off, enabling is transformers' own again.
    model.activation_checkpointing_disable()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert not any("_sac_policy" in vars(module) for module in model.modules())
    assert _hits_of_one_step(model) == 0
    assert "activation_checkpointing_enable" not in vars(model)


def test_the_trainer_saves_a_checkpoint_with_the_plugins_kwargs(tmp_path):
    model = build()
    kwargs = huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(kept_units=["attn"]))
    args = _training_arguments(
        tmp_path,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=kwargs,
        save_strategy="steps",
        save_steps=1,
    )
    assert json.loads(args.to_json_string())["gradient_checkpointing_kwargs"]["context_fn"].startswith(
        "sac_plugin policy for llama (Hugging Face): kept_units=['attn']"
    )
    audit = _train(model, args)
    assert audit.hits(SDPA_CPU) == LAYERS
    saved = tmp_path / "checkpoint-1" / "training_args.bin"
    assert saved.is_file()
    # The saved kwargs keep their selection on a model of their own.
    loaded = torch.load(saved, weights_only=False).gradient_checkpointing_kwargs
    other = build()
    enable_transformers_checkpointing(other, loaded)
    assert _hits_of_one_step(other) == LAYERS


# --- torch.save of the whole model ------------------------------------------------------------------


@pytest.mark.parametrize("peft", [False, True], ids=["llama", "lora"])
def test_a_configured_model_pickles_whole_and_still_trains(peft, tmp_path):
    model = lora(0.0) if peft else build()
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    reference = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    audit = assert_trainable_gradients_bitwise_equal(loaded, reference)
    assert audit.hits(SDPA_CPU) == LAYERS


# --- import cost ------------------------------------------------------------------------------------


def test_importing_sac_plugin_leaves_torch_dynamo_unimported():
    code = "import sys, torch; import sac_plugin; print('torch._dynamo' in sys.modules)"
    result = run_python([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    code = "import sac_plugin; print(sac_plugin.plan.__module__, sac_plugin.Plan.__name__)"
    result = run_python([sys.executable, "-c", code])
    assert result.stdout.strip() == "sac_plugin.planner._plan Plan", result.stderr


# --- recipes: TRL's SFTTrainer, Lightning, accelerate, torch's checkpoint_wrapper -----------------

ATTENTION = RecomputeConfig(kept_units=["attn"])
STEPS = 2


def _assert_steps_bitwise_equal(losses, gradients, reference_losses, reference_gradients):
    assert len(losses) == len(reference_losses) == len(gradients) == len(reference_gradients) == STEPS
    for loss, expected in zip(losses, reference_losses):
        assert torch.equal(torch.as_tensor(loss), torch.as_tensor(expected))
    for step_gradients, expected in zip(gradients, reference_gradients):
        assert step_gradients.keys() == expected.keys() and step_gradients
        for name, gradient in step_gradients.items():
            assert torch.equal(gradient, expected[name]), name


def _sft(model, tmp_path, **checkpointing):
    trl = pytest.importorskip("trl", reason="trl is not installed (the test extra installs it)")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (trl requires it)")
    from support.fine_tuning import GradientRecorder, tiny_tokenizer

    tokens = torch.randint(64, (2 * STEPS, 8), generator=torch.Generator().manual_seed(1))
    args = _training_arguments(tmp_path, trl.SFTConfig, max_steps=STEPS, logging_steps=1, **checkpointing)
    recorder = GradientRecorder()
    datasets.disable_progress_bars()
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": tokens.tolist()}),
        processing_class=tiny_tokenizer(),
        callbacks=[recorder],
    )
    with sac_plugin.audit() as audit, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return audit, losses, recorder.gradients


def _sft_with_the_plugins_kwargs(model):
    return {
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": huggingface.gradient_checkpointing_kwargs(model, ATTENTION),
    }


def _sft_after_the_config(model):
    sac_plugin.apply_recompute_config(model, ATTENTION)
    return {"gradient_checkpointing": True}


@pytest.mark.parametrize("how", [_sft_with_the_plugins_kwargs, _sft_after_the_config], ids=["kwargs", "applied"])
def test_trl_sft_trainer_trains_with_the_plugins_policy_bitwise(how, tmp_path):
    # The reference is the same model trained without checkpointing: the plugin's selection never
    # changes a value, so losses and every step's gradients are the unchecked run's, bitwise.
    _, reference_losses, reference_gradients = _sft(build(), tmp_path / "reference")
    model = build()
    audit, losses, gradients = _sft(model, tmp_path / "checkpointed", **how(model))
    assert audit.hits(SDPA_CPU) == STEPS * LAYERS
    assert audit.hits("aten::mm") == 4 * STEPS * LAYERS  # the attention's four projections, kept
    _assert_steps_bitwise_equal(losses, gradients, reference_losses, reference_gradients)


def _fit_with_lightning(config):
    lightning = pytest.importorskip("lightning", reason="lightning is not installed (the test extra installs it)")
    from support.fine_tuning import lightning_module

    module = lightning_module(lightning, build(), config)
    tokens = torch.randint(64, (2 * STEPS, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in tokens], batch_size=2)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with sac_plugin.audit() as audit, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on workers and the CPU
        trainer.fit(module, loader)
    return audit, module


def test_lightning_applies_the_config_in_configure_model_and_trains_bitwise():
    _, reference = _fit_with_lightning(None)
    audit, module = _fit_with_lightning(ATTENTION)
    layers = huggingface.decoder_layers(module.model)
    assert all(layer._sac_policy.kept_units == frozenset({"attn"}) for layer in layers)
    assert audit.hits(SDPA_CPU) == STEPS * LAYERS
    _assert_steps_bitwise_equal(module.losses, module.gradients, reference.losses, reference.gradients)


def _accelerate_step(model):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (the test extra installs it)")
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    with sac_plugin.audit() as audit, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(**batch()).loss
        accelerator.backward(loss)
    optimizer.step()
    return audit, loss, model


def test_accelerate_on_the_cpu_prepares_a_configured_model_and_steps_bitwise():
    model = sac_plugin.apply_recompute_config(build(), ATTENTION)
    audit, loss, model = _accelerate_step(model)
    _, reference_loss, reference = _accelerate_step(build())
    assert audit.hits(SDPA_CPU) == LAYERS
    assert torch.equal(loss, reference_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad) and torch.equal(p, q), name


def _torchs_wrappers():
    return pytest.importorskip(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", reason="this torch has no torch.distributed"
    )


def _one_context_fn_per_layer(policy):
    def wrap(layer):
        return _torchs_wrappers().checkpoint_wrapper(layer, context_fn=sac_plugin.context_fn(policy))

    return wrap


def _one_context_fn_for_all(policy):
    return functools.partial(_torchs_wrappers().checkpoint_wrapper, context_fn=sac_plugin.context_fn(policy))


@pytest.mark.parametrize(
    "wrapper_fn", [_one_context_fn_per_layer, _one_context_fn_for_all], ids=["per-layer", "partial"]
)
def test_torchs_checkpoint_wrapper_recipe_keeps_the_policys_ops_bitwise(wrapper_fn):
    from sac_plugin.targets import ATTENTION_OPS

    model = build()
    model.config.use_cache = False  # a cache written in the forward would be written again by the recompute
    reference = copy.deepcopy(model)
    _torchs_wrappers().apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=wrapper_fn(sac_plugin.Policy(kept_ops=sorted(ATTENTION_OPS.resolve()))),
        check_fn=lambda module: isinstance(module, transformers.models.llama.modeling_llama.LlamaDecoderLayer),
    )
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in model.model.layers)
    audit = assert_trainable_gradients_bitwise_equal(model, reference)
    assert audit.hits(SDPA_CPU) == LAYERS
    # A layer torch's wrapper checkpoints is not checkpointed by sac_plugin too.
    with pytest.raises(ValueError) as error:
        sac_plugin.apply_selective_checkpointing(model.model)
    assert str(error.value).startswith(
        "sac_plugin: cannot checkpoint LlamaModel: its submodule CheckpointWrapper 'layers.0' is torch's "
        "CheckpointWrapper, which already checkpoints LlamaDecoderLayer;"
    )


def test_a_module_inside_a_configured_layer_is_not_checkpointed_again():
    model = build()
    huggingface.apply_recompute_config(model, ATTENTION)
    attention = model.model.layers[0].self_attn
    with pytest.raises(ValueError) as error:
        sac_plugin.apply_selective_checkpointing(attention)
    assert str(error.value) == (
        "sac_plugin: cannot checkpoint LlamaAttention: it is 'self_attn' inside LlamaDecoderLayer, which sac_plugin "
        "already checkpoints (with Policy(kept_ops=[], kept_units=['attn'])); checkpoint either the outer module or "
        "the layers inside it, not both (sac_plugin.remove_checkpointing(outer module) first to checkpoint the inner "
        "one)"
    )
    # Once the config is removed, the attention is free to checkpoint (without the cache, which
    # transformers turns off only under checkpointing of its own).
    sac_plugin.remove_checkpointing(model)
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    sac_plugin.apply_selective_checkpointing(attention, sac_plugin.Policy(kept_ops=[SDPA_CPU]))
    audit = assert_trainable_gradients_bitwise_equal(model, reference)
    assert audit.hits(SDPA_CPU) == 1
