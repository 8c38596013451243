"""Hugging Face transformers: target maps for decoder layers, and one call to checkpoint a model.

    from sac_plugin.integrations import huggingface
    huggingface.apply_recompute_config(model, RecomputeConfig(units=["attn"]))

The target map is chosen from `model.config.model_type` (llama, mistral, qwen2, mixtral,
qwen2_moe, gpt2); the decoder layers are found from the model's `_no_split_modules` (the layer
class transformers itself never splits). Units are submodules of each decoder layer, by their
transformers names, so they hold for every attention implementation (eager, sdpa, flash):

| unit | llama, mistral, qwen2 | mixtral | qwen2_moe | gpt2 |
|---|---|---|---|---|
| attn | self_attn | self_attn | self_attn | attn |
| mlp | mlp | mlp.experts | mlp.experts, mlp.shared_expert | mlp |
| moe_gate | - | mlp.gate | mlp.gate, mlp.shared_expert_gate | - |
| moe_dispatch | - | aten::sort, histc, nonzero | same | - |
| norm | input_layernorm, post_attention_layernorm | same | same | ln_1, ln_2 |

"attn" is the whole attention module: projections, rotary embedding and the attention core.
"moe_dispatch" keeps the routing: the sort of tokens by expert and the per-expert counts
(transformers' grouped_mm experts), or the `nonzero` calls that pick the experts hit and their
tokens (its eager loop; a device sync each on GPU). transformers is not imported by this module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _layers
from .._logging import logger as _logger
from ..checkpointing import context_fn
from ..config import ConfigError, RecomputeConfig
from ..policy import bounded_repr, describe_value
from ..targets import KeptCallables, KeptOps, RecomputeTargetMap, RecomputeUnit

__all__ = ['apply_recompute_config', 'decoder_layers', 'gradient_checkpointing_kwargs', 'is_hf_model', 'target_map_for']

_NORMS = KeptCallables(["input_layernorm", "post_attention_layernorm"])
# Routing: the experts implementations sort tokens by expert and count them (grouped_mm path), or
# pick the experts hit and their tokens with nonzero (the eager loop).
_ROUTING = KeptOps(["aten::sort", "aten::histc", "aten::nonzero"])


def _dense(name: str) -> RecomputeTargetMap:
    return RecomputeTargetMap(name, {
        RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp"]),
        RecomputeUnit.NORM: _NORMS,
    })


HF_TARGET_MAPS: Mapping[str, RecomputeTargetMap] = {
    "llama": _dense("llama (Hugging Face)"),
    "mistral": _dense("mistral (Hugging Face)"),
    "qwen2": _dense("qwen2 (Hugging Face)"),
    "mixtral": RecomputeTargetMap("mixtral (Hugging Face)", {
        RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp.experts"]),
        RecomputeUnit.MOE_GATE: KeptCallables(["mlp.gate"]),
        RecomputeUnit.MOE_DISPATCH: _ROUTING,
        RecomputeUnit.NORM: _NORMS,
    }),
    "qwen2_moe": RecomputeTargetMap("qwen2_moe (Hugging Face)", {
        RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp.experts", "mlp.shared_expert"]),
        RecomputeUnit.MOE_GATE: KeptCallables(["mlp.gate", "mlp.shared_expert_gate"]),
        RecomputeUnit.MOE_DISPATCH: _ROUTING,
        RecomputeUnit.NORM: _NORMS,
    }),
    "gpt2": RecomputeTargetMap("gpt2 (Hugging Face)", {
        RecomputeUnit.ATTN: KeptCallables(["attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp"]),
        RecomputeUnit.NORM: KeptCallables(["ln_1", "ln_2"]),
    }),
}


def is_hf_model(model) -> bool:
    """A transformers model, told without importing transformers."""
    return isinstance(model, nn.Module) and type(model).__module__.startswith("transformers.") \
        and hasattr(model, "config") and isinstance(getattr(model.config, "model_type", None), str)


def target_map_for(model: nn.Module) -> RecomputeTargetMap:
    """The target map for a transformers model, from its config.model_type."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in HF_TARGET_MAPS:
        raise ValueError(
            f"sac_plugin: no Hugging Face target map for model_type {bounded_repr(model_type)} ({type(model).__name__}); "
            f"shipped: {', '.join(sorted(HF_TARGET_MAPS))}. Pass target_map=RecomputeTargetMap(...) naming the "
            "decoder layer's submodules"
        )
    return HF_TARGET_MAPS[model_type]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in order: the modules whose class is in `_no_split_modules`."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} has no decoder layers sac_plugin can find (no module of a class in its "
            f"_no_split_modules {sorted(layer_classes)}); pass wrap_sites=[the layers to checkpoint]"
        )
    return layers


def _disabled_by_transformers(module: nn.Module) -> bool:
    """A layer sac_plugin checkpointed through transformers' hook whose checkpointing transformers
    has since turned off (model.gradient_checkpointing_disable()): it runs unchecked, so a new
    config may be applied to it."""
    return "_sac_undo" in vars(module) and getattr(module, "gradient_checkpointing", False) is False


def _undo(module: nn.Module, checkpointed_layer: bool) -> None:
    """Removes what apply_recompute_config set on one module (sac_plugin.remove_checkpointing,
    or a config applied again after gradient_checkpointing_disable())."""
    state = vars(module)
    if checkpointed_layer:
        state.pop("_gradient_checkpointing_func", None)
        state.pop("_sac_policy", None)
    if "gradient_checkpointing" in state:
        module.gradient_checkpointing = False
    state.pop("_sac_undo", None)


def _check_model(model, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"sac_plugin: {where}: model must be a transformers PreTrainedModel, got {describe_value(model)}")
    if any("_sac_policy" in vars(module) and not _disabled_by_transformers(module) for module in model.modules()):
        raise ValueError(f"sac_plugin: {where}: {type(model).__name__} is already checkpointed by sac_plugin; apply a "
                         "config once per model")
    # Read the layers' flag, not model.is_gradient_checkpointing (deprecated in transformers 5).
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        raise ValueError(
            f"sac_plugin: {where}: {type(model).__name__} has transformers' gradient checkpointing enabled; "
            "call model.gradient_checkpointing_disable() first, or use gradient_checkpointing_kwargs(model, config) "
            "to run transformers' checkpointing with the plugin's policy"
        )


def _refuse_budget(config: RecomputeConfig) -> None:
    # A budget is planned from the layers' own forward (planner/apply.py), which checkpoints the
    # sites itself; transformers layers checkpoint through their own hook, so the two do not
    # compose yet. Refused rather than silently run as full recompute.
    if config.budget is not None:
        raise ConfigError(
            "recompute config: budget is not supported for transformers models yet; choose units or ops for them "
            "(see the README's Hugging Face section), or plan one decoder layer with sac_plugin.plan(layer, ...) and "
            "keep its plan.policy through sac_plugin.context_fn"
        )


def apply_recompute_config(model: nn.Module, config: RecomputeConfig | None = None, *,
                           target_map: RecomputeTargetMap | None = None, wrap_sites=None,
                           example_inputs=None) -> nn.Module:
    """Checkpoints a transformers model's decoder layers as `config` says; returns the model.

    The target map is chosen from model.config.model_type and the decoder layers are found by
    their class (pass target_map= or wrap_sites= to choose). Each selected layer is checkpointed
    through transformers' own per-layer hook (GradientCheckpointingLayer), handed the plugin's
    policy: transformers then also turns the KV cache off in training, as its gradient
    checkpointing does, so that the recompute does not write the cache a second time.
    sac_plugin.apply_recompute_config(model, config) calls this for a transformers model.
    """
    _check_model(model, "huggingface.apply_recompute_config")
    if config is not None and not isinstance(config, RecomputeConfig):
        raise TypeError("sac_plugin: huggingface.apply_recompute_config: config must be a RecomputeConfig or None, "
                        f"got {describe_value(config)}")
    config = RecomputeConfig() if config is None else config
    _refuse_budget(config)
    if example_inputs is not None:
        raise ConfigError("apply_recompute_config: example_inputs are for planning a budget; the config sets no budget")
    target_map = target_map_for(model) if target_map is None else target_map
    layers = decoder_layers(model) if wrap_sites is None else _layers.wrap_sites(model, wrap_sites)
    for i, layer in enumerate(layers):
        if not any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(layer).__mro__):
            raise TypeError(
                f"sac_plugin: huggingface.apply_recompute_config: decoder layer {i} ({type(layer).__name__}) is not a "
                "transformers GradientCheckpointingLayer (transformers >= 4.52 has them); upgrade transformers, or "
                "call sac_plugin.apply_selective_checkpointing on each layer and pass use_cache=False"
            )
    selected = config.selected_layers(len(layers))
    # Layers whose checkpointing transformers turned off lose the stale state first (checked
    # above: nothing else is checkpointed), so disable-then-apply works.
    for module in model.modules():
        if _disabled_by_transformers(module):
            module._sac_undo()
    policy = _layers.prepare_layers(model, config, target_map, layers, selected)
    checkpoint_fn = functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn(policy),
                                      preserve_rng_state=config.preserve_rng_state)
    for index in selected:
        layer = layers[index]
        layer._sac_policy = policy  # marks it checkpointed (reports, a second apply)
        layer._gradient_checkpointing_func = checkpoint_fn
        layer.gradient_checkpointing = True
        layer._sac_undo = functools.partial(_undo, layer, True)
    # The base model turns use_cache off in training while this flag is set: a cache written in
    # the forward would be written again by the recompute.
    model.base_model.gradient_checkpointing = True
    model.base_model._sac_undo = functools.partial(_undo, model.base_model, False)
    if _logger.isEnabledFor(logging.INFO):
        _logger.info("%s", _layers.describe_application(type(model).__name__, selected, len(layers), policy, config,
                                                         target_map))
    return model


def gradient_checkpointing_kwargs(model: nn.Module, config: RecomputeConfig | None = None, *,
                                  target_map: RecomputeTargetMap | None = None) -> dict:
    """The `gradient_checkpointing_kwargs` that make transformers' own checkpointing selective:

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=huggingface.gradient_checkpointing_kwargs(model, config))

    transformers checkpoints every decoder layer, so the config must select every layer. The
    units that are callables are installed on each layer here (as apply_recompute_config does).
    """
    _check_model(model, "huggingface.gradient_checkpointing_kwargs")
    config = RecomputeConfig() if config is None else config
    if not isinstance(config, RecomputeConfig):
        raise TypeError("sac_plugin: huggingface.gradient_checkpointing_kwargs: config must be a RecomputeConfig or "
                        f"None, got {describe_value(config)}")
    _refuse_budget(config)
    if config.every_nth_layer != 1 or config.first_layer != 0 or config.layer_ratio not in (None, 1.0):
        raise ConfigError(
            "recompute config: transformers' gradient checkpointing checkpoints every decoder layer, so "
            "every_nth_layer, first_layer and layer_ratio cannot select fewer; use "
            "huggingface.apply_recompute_config(model, config) to checkpoint some layers"
        )
    target_map = target_map_for(model) if target_map is None else target_map
    layers = decoder_layers(model)
    policy = _layers.prepare_layers(model, config, target_map, layers, list(range(len(layers))))
    return {"use_reentrant": False, "context_fn": context_fn(policy), "preserve_rng_state": config.preserve_rng_state}
