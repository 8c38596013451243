"""Fine-tuning a transformers model checkpointed by sac_plugin: PEFT (LoRA) models take every entry
point, with gradients bitwise equal to the same PEFT model unchecked; transformers' Trainer keeps
the plugin's policy when it enables checkpointing itself, and saves checkpoints with the plugin's
kwargs in its TrainingArguments; a configured model pickles whole; `import sac_plugin` leaves
torch._dynamo unimported."""

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import RecomputeConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
from sac_plugin.integrations import huggingface  # noqa: E402
from support.transformers_models import enable_transformers_checkpointing  # noqa: E402

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
    huggingface.apply_recompute_config(model, RecomputeConfig(units=["attn"]))


def _through_the_core(model):
    sac_plugin.apply_recompute_config(model, RecomputeConfig(units=["attn"]))


def _through_kwargs(model):
    enable_transformers_checkpointing(
        model, huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(units=["attn"]))
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


def _training_arguments(output_dir, **kwargs):
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
        return transformers.TrainingArguments(**{**defaults, **kwargs})


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
    huggingface.apply_recompute_config(model, RecomputeConfig(units=["attn"]))
    expected = _hits_of_one_step(copy.deepcopy(model))
    audit = _train(model, _training_arguments(tmp_path, gradient_checkpointing=True))
    assert audit.hits(SDPA_CPU) == expected == LAYERS
    assert all(layer._sac_policy.kept_units == frozenset({"attn"}) for layer in huggingface.decoder_layers(model))


def test_enabling_transformers_checkpointing_asking_for_more_raises_naming_the_fix():
    model = build()
    huggingface.apply_recompute_config(model, RecomputeConfig(units=["attn"]))
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
    kwargs = huggingface.gradient_checkpointing_kwargs(model, RecomputeConfig(units=["attn"]))
    args = _training_arguments(
        tmp_path,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=kwargs,
        save_strategy="steps",
        save_steps=1,
    )
    assert json.loads(args.to_json_string())["gradient_checkpointing_kwargs"]["context_fn"].startswith(
        "sac_plugin policy for llama (Hugging Face): units=['attn']"
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
    huggingface.apply_recompute_config(model, RecomputeConfig(units=["attn"]))
    reference = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    audit = assert_trainable_gradients_bitwise_equal(loaded, reference)
    assert audit.hits(SDPA_CPU) == LAYERS


# --- import cost ------------------------------------------------------------------------------------


def test_importing_sac_plugin_leaves_torch_dynamo_unimported():
    code = "import sys, torch; import sac_plugin; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    code = "import sac_plugin; print(sac_plugin.plan.__module__, sac_plugin.Plan.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert result.stdout.strip() == "sac_plugin.planner._plan Plan", result.stderr
