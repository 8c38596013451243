"""sac_plugin.apply_recompute_config: the one entry point for configs, above the integrations.

The core never imports an integration; this module, above both, chooses: a transformers model goes
to the Hugging Face adapter (transformers layers checkpoint themselves), anything else to the core
(_layers.apply_to_layers)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from . import _layers
from .config import ConfigError, RecomputeConfig
from .integrations import huggingface
from ._validation import describe_value
from .targets import RecomputeTargetMap

__all__ = ["apply_recompute_config"]


def apply_recompute_config(
    model: nn.Module,
    config: RecomputeConfig | None = None,
    *,
    target_map: RecomputeTargetMap | None = None,
    wrap_sites=None,
    example_inputs=None,
    step=None,
) -> nn.Module:
    """Checkpoints the model's wrap sites (its decoder layers, dense or MoE) as `config` says.

    Units that resolve to callables are installed on each checkpointed layer; force-recomputed
    modules are wrapped in their own unit, which the policy always recomputes. Returns the model.
    Everything is resolved and checked before any layer is changed: a refused config leaves the
    model as it was.

    With `config.budget`, each distinct layer (by type, parameter shapes and input shapes) is
    profiled and planned once. Given `example_inputs` (the model's positional arguments as a
    tuple, or (args, kwargs)), the model runs once to capture each layer's inputs, and the total
    budget is split over the layers to save the most recompute time (planner/_split.py).
    Without them each layer is planned on its first call, within its own share of the budget.
    What was chosen is logged on logging.getLogger("sac_plugin").

    With `config.peak_bytes`, `step` (a callable that runs one forward, loss and backward of the
    model, called with no arguments) is planned by sac_plugin.plan_step over the selected layers.

    Args:
        model: The model; a transformers model goes to `integrations.huggingface.apply_recompute_config`.
        config: What to keep and which layers to checkpoint; None keeps nothing (full recompute).
        target_map: What the config's units mean for the model; None: the model's
            `recompute_targets`.
        wrap_sites: The layers, a list of modules; None: the model's `recompute_wrap_sites()`.
        example_inputs: The batch a budget is planned on: positional arguments as a tuple, or
            (args, kwargs).
        step: Runs one forward, loss and backward of the model; needed with `config.peak_bytes`.

    Returns:
        `model`, its selected layers checkpointed.

    Raises:
        TypeError: An argument has the wrong type.
        ConfigError: The config cannot be applied to the model (a unit it does not declare, a
            layer already checkpointed, example_inputs without a budget, step without peak_bytes).
        ValueError: A selected wrap site would be checkpointed twice: it holds a checkpointed
            module or another selected site, or lies inside a checkpointed module (the message
            names both).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"sac_plugin: apply_recompute_config: model must be a torch.nn.Module, got {describe_value(model)}"
        )
    if config is not None and not isinstance(config, RecomputeConfig):
        hint = "; build one with RecomputeConfig.from_dict(...)" if isinstance(config, Mapping) else ""
        raise TypeError(
            f"sac_plugin: apply_recompute_config: config must be a RecomputeConfig or None, got "
            f"{describe_value(config)}{hint}"
        )
    if target_map is not None and not isinstance(target_map, RecomputeTargetMap):
        raise TypeError(
            "sac_plugin: apply_recompute_config: target_map must be a RecomputeTargetMap or None, got "
            f"{describe_value(target_map)}"
        )
    if step is not None and (config is None or config.peak_bytes is None):
        raise ConfigError("apply_recompute_config: step is for planning a peak; the config sets no peak_bytes")
    if huggingface.is_hf_model(model):
        if config is not None and config.peak_bytes is not None:
            raise ConfigError(
                "apply_recompute_config: peak_bytes is not planned for transformers models; call "
                "sac_plugin.plan_step(model, step, peak_bytes=..., layers=[its decoder layers])"
            )
        # transformers layers checkpoint themselves (and drop their KV cache when they do); the
        # adapter hands them the policy and finds the target map and the layers.
        return huggingface.apply_recompute_config(
            model, config, target_map=target_map, wrap_sites=wrap_sites, example_inputs=example_inputs
        )
    config = RecomputeConfig() if config is None else config
    return _layers.apply_to_layers(
        model, config, target_map=target_map, wrap_sites_given=wrap_sites, example_inputs=example_inputs, step=step
    )
