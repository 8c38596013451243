"""A config made ready on a transformers model's layers: each selected layer's units checked and
installed, the policy built; or, for a budget, each distinct layer profiled on the inputs one
forward of an example batch gives it and the budget split over the layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from .. import _layers
from .._config_policy import check_target_map, policy_for
from .._logging import describe_layers
from .._logging import logger as _logger
from ..config import ConfigError, RecomputeConfig
from ..units import RecomputeUnit
from ..targets import KeptCallables, KeptOps, RecomputeTargetMap

if TYPE_CHECKING:
    from ..planner import Plan


# The cache arguments transformers drops from a layer's call when it checkpoints the layer
# (GradientCheckpointingLayer): a layer planned on captured inputs runs without them too.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _units_by_layer(config: RecomputeConfig, target_map: RecomputeTargetMap, layers, selected) -> dict:
    """The config's units each selected layer has. A unit may be absent from some layers (a mixed
    stack: DeepSeek-V3's dense first layer has no router); one absent from every selected layer
    is an error naming it."""
    present = {index: [] for index in selected}
    for unit in config.selected_units:
        target = target_map[unit]
        found_in = [index for index in selected if isinstance(target, KeptOps) or target.find(layers[index])]
        if not found_in:
            kinds = sorted({type(layers[index]).__name__ for index in selected})
            raise ConfigError(
                f"recompute config: {config.field_of(unit)}: unit '{unit.value}' of {target_map.model_name} "
                f"({', '.join(target.paths)}) matches nothing in any of the {len(selected)} selected layers "
                f"({', '.join(kinds)})"
            )
        if len(found_in) < len(selected):
            _logger.debug(
                "unit '%s' (%s) is in layers %s only",
                unit.value,
                target_map.model_name,
                describe_layers(found_in, len(layers)),
            )
        for index in found_in:
            if isinstance(target, KeptCallables):
                for owner, name in target.find(layers[index]):
                    _layers.check_forward_runs(target_map, unit, owner, name, config.field_of(unit))
            present[index].append(unit)
    for index in selected:
        for j, path in enumerate(config.force_recompute_modules):
            if not KeptCallables([path]).find(layers[index]):
                raise ConfigError(
                    f"recompute config: force_recompute_modules[{j}]: '{path}' matches nothing in "
                    f"{type(layers[index]).__name__} (layer {index})"
                )
    return present


def _prepare(model: nn.Module, config: RecomputeConfig, target_map: RecomputeTargetMap, layers, selected):
    """Checks the config against the selected layers, then installs each layer's units; returns
    the policy. Nothing is changed unless every check passes."""
    check_target_map(target_map)
    policy = policy_for(config, target_map)
    present = _units_by_layer(config, target_map, layers, selected)
    for index in selected:
        # Each layer is prepared with the units it has (all checked above, so none raises).
        units = present[index]
        layer_map = RecomputeTargetMap(target_map.model_name, {unit: target_map[unit] for unit in units})
        # The catalog units this layer lacks are left out; names outside the catalog pass as written.
        layer_config = dataclasses.replace(
            config,
            kept_units=[u for u in config.kept_units if u in units or not isinstance(u, RecomputeUnit)],
            offloaded_units=[u for u in config.offloaded_units if u in units or not isinstance(u, RecomputeUnit)],
        )
        _layers.prepare_layers(model, layer_config, layer_map, [layers[index]], [0])
    return policy


def _keyword_batch(example_inputs):
    """A transformers model takes a keyword batch ({"input_ids": ..., "labels": ...})."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return example_inputs


def _plan_layers(model: nn.Module, config: RecomputeConfig, layers: list[nn.Module], example_inputs) -> list[Plan]:
    """One plan per layer within config.budget: each distinct layer (class, parameters, input
    shapes) profiled once on the inputs it gets from one forward of example_inputs, the budget
    split over the layers."""
    if example_inputs is None:
        raise ConfigError(
            "recompute config: a budget for a transformers model is planned on an example batch: pass "
            "example_inputs=batch (the keyword batch the model takes, such as {'input_ids': ..., 'labels': ...})"
        )
    # The planner imports torch._dynamo: imported when a budget is planned, not with this module.
    from ..planner import plan
    from ..planner._apply import _capture_inputs, layer_signature
    from ..planner._split import split, total_budget_bytes

    inputs = _capture_inputs(model, layers, _keyword_batch(example_inputs))
    plans, by_signature = [], {}
    for layer, (args, kwargs) in zip(layers, inputs):
        kwargs = {
            name: (False if name == "use_cache" else None if name in _CACHE_ARGUMENTS else value)
            for name, value in kwargs.items()
        }
        signature = layer_signature(layer, args, kwargs)
        if signature not in by_signature:
            by_signature[signature] = plan(layer, *args, budget=1.0, **kwargs)
        plans.append(by_signature[signature])
    total = total_budget_bytes(config.budget, plans)
    chosen = split(plans, total)
    _logger.info(
        "%s: budget %r = %.2f MiB over %d layers (%d distinct): they hold %.2f MiB",
        type(model).__name__,
        config.budget,
        total / 2**20,
        len(layers),
        len(by_signature),
        sum(p.held_bytes for p in chosen) / 2**20,
    )
    return chosen
