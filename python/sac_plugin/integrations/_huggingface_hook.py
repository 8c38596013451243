"""transformers' own checkpointing, which the Hugging Face integration hands its policy: each layer's
hook (GradientCheckpointingLayer), turned on through transformers' entry point and undone again;
and the checks that a model and its layers can take a config that way."""

from __future__ import annotations

import functools

from torch import nn

from .._validation import describe_value
from ..config import RecomputeConfig
from ._huggingface_layers import _is_checkpointing_layer


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
        state.pop("_sac_plan", None)
    if "gradient_checkpointing" in state:
        module.gradient_checkpointing = False
    state.pop("_sac_undo", None)


def _enable_through_transformers(model: nn.Module, config: RecomputeConfig, selected_layers) -> bool:
    """Turns transformers' own checkpointing on first, through its entry point
    (activation_checkpointing_enable; gradient_checkpointing_enable before transformers renamed
    it), with every_n_layers as the config's layer rule says, so that whatever transformers does
    when checkpointing is enabled (the model's own override of it, its flags) is done. The caller then hands each selected layer
    its own policy. Every other module transformers turned on is turned off again: the config's
    selection is what is checkpointed. A model that transformers says cannot be checkpointed but
    whose layers have the hook (JetMoE) is left to that hook alone.

    The forward hook transformers puts on the input embeddings (enable_input_require_grads) is
    removed again: it makes their output require grad for reentrant checkpointing, and the
    plugin's checkpoint is never reentrant. Being a local function, it would also make the model
    unpicklable (torch.save(model)). A hook the model had before is left."""
    if getattr(model, "supports_gradient_checkpointing", None) is not True:
        return
    hooked = "_require_grads_hook" in vars(model)
    every = config.every_nth_layer if config.first_layer == 0 and config.layer_ratio is None else 1
    kwargs = {"use_reentrant": False}  # each selected layer's own function replaces this one
    enable = getattr(type(model), "activation_checkpointing_enable", None)
    if enable is not None:
        enable(model, activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    else:
        type(model).gradient_checkpointing_enable(model, gradient_checkpointing_kwargs=kwargs)
    selected = {id(layer) for layer in selected_layers}
    for module in model.modules():
        if module is model.base_model or id(module) in selected or "_gradient_checkpointing_func" not in vars(module):
            continue
        module.gradient_checkpointing = False
        del vars(module)["_gradient_checkpointing_func"]
        module._sac_undo = functools.partial(_undo, module, True)
    if not hooked and "_require_grads_hook" in vars(model):
        model.disable_input_require_grads()


def _check_model(model, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"sac_plugin: {where}: model must be a transformers PreTrainedModel, got {describe_value(model)}"
        )
    if any("_sac_policy" in vars(module) and not _disabled_by_transformers(module) for module in model.modules()):
        raise ValueError(
            f"sac_plugin: {where}: {type(model).__name__} is already checkpointed by sac_plugin; apply a "
            "config once per model"
        )
    # Read the layers' flag, not model.is_gradient_checkpointing (deprecated in transformers 5).
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        raise ValueError(
            f"sac_plugin: {where}: {type(model).__name__} has transformers' gradient checkpointing enabled; "
            "call model.gradient_checkpointing_disable() first, or use gradient_checkpointing_kwargs(model, config) "
            "to run transformers' checkpointing with the plugin's policy"
        )


def _check_layers(model: nn.Module, layers, where: str, *, hook_needed: bool = True) -> None:
    """The layers must be transformers' GradientCheckpointingLayers, whose hook sac_plugin hands
    its policy (`hook_needed`). A model whose layers are not, and that transformers says cannot
    be checkpointed (ALBERT), is refused in transformers' own words."""
    for i, layer in enumerate(layers):
        if _is_checkpointing_layer(layer):
            continue
        if getattr(model, "supports_gradient_checkpointing", None) is False:
            raise TypeError(
                f"sac_plugin: {where}: {type(model).__name__} does not support activation checkpointing (transformers' "
                f"own refusal: its layers, {type(layer).__name__}, have no checkpointing hook); call "
                "sac_plugin.apply_selective_checkpointing on the layers to checkpoint them anyway"
            )
        if not hook_needed:
            continue
        raise TypeError(
            f"sac_plugin: {where}: decoder layer {i} ({type(layer).__name__}) is not a transformers "
            "GradientCheckpointingLayer (transformers >= 4.52 has them); upgrade transformers, or call "
            "sac_plugin.apply_selective_checkpointing on each layer and pass use_cache=False"
        )
