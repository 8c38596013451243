"""Applying a recompute config to a model's layers: finding its wrap sites, installing each unit's
callables, checking the config against every selected layer, checkpointing them. The core of
sac_plugin.apply_recompute_config for any model; integrations reuse the pieces."""

from __future__ import annotations

import logging

from torch import nn

from ._forwards import run_in_unit
from ._logging import describe_layers, logger
from .checkpointing import apply_selective_checkpointing, check_checkpointable, check_not_nested, mark_descendants
from ._config_policy import check_target_map, policy_for
from .config import RECOMPUTE_UNIT_PREFIX, ConfigError, RecomputeConfig
from ._wrap_sites import given_or_declared
from .policy import Policy
from .targets import KeptCallables, KeptOps, RecomputeTargetMap, default_target_map

__all__ = ["apply_to_layers", "check_sites_checkpointable", "describe_application", "prepare_layers", "wrap_sites"]


def apply_to_layers(
    model: nn.Module,
    config: RecomputeConfig,
    *,
    target_map: RecomputeTargetMap | None,
    wrap_sites_given,
    example_inputs,
    step=None,
) -> nn.Module:
    """apply_recompute_config for a model no integration handles; arguments already checked."""
    config = RecomputeConfig() if config is None else config
    if config.peak_bytes is not None:
        from .planner import plan_step

        if step is None:
            raise ConfigError(
                "apply_recompute_config: peak_bytes bounds a training step's peak, which "
                "sac_plugin.plan_step plans by running the step: pass step=<a callable that runs one "
                "forward, loss and backward of the model, called with no arguments>"
            )
        if example_inputs is not None:
            raise ConfigError(
                "apply_recompute_config: example_inputs are for planning a budget; peak_bytes plans from the step"
            )
        sites = wrap_sites(model, wrap_sites_given)
        # offload_inputs lets the plan offload (the layers' inputs among what it may offload).
        plan_step(
            model,
            step,
            peak_bytes=config.peak_bytes,
            layers=[sites[i] for i in config.selected_layers(len(sites))],
            offload=config.offload_inputs,
            preserve_rng_state=config.preserve_rng_state,
        )
        return model
    if example_inputs is not None and config.budget is None:
        raise ConfigError("apply_recompute_config: example_inputs are for planning a budget; the config sets no budget")
    if config.budget is not None:
        from .planner._apply import apply_budget

        sites = wrap_sites(model, wrap_sites_given)
        selected = [sites[i] for i in config.selected_layers(len(sites))]
        check_sites_checkpointable(model, sites, config.selected_layers(len(sites)))
        apply_budget(model, selected, config.budget, example_inputs, preserve_rng_state=config.preserve_rng_state)
        return model
    target_map = default_target_map(model) if target_map is None else target_map
    sites = wrap_sites(model, wrap_sites_given)
    selected = config.selected_layers(len(sites))
    policy = prepare_layers(model, config, target_map, sites, selected, checkpointed=True)
    for index in selected:
        apply_selective_checkpointing(sites[index], policy, preserve_rng_state=config.preserve_rng_state)
    skipped = sorted(set(range(len(sites))) - set(selected))
    if skipped:
        logger.debug(
            "%s: wrap sites %s are not checkpointed (the layer selection leaves them out)",
            type(model).__name__,
            skipped,
        )
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", describe_application(type(model).__name__, selected, len(sites), policy, config, target_map))
    return model


def prepare_layers(
    model: nn.Module,
    config: RecomputeConfig,
    target_map: RecomputeTargetMap,
    sites,
    selected,
    *,
    checkpointed: bool = False,
) -> Policy:
    """Checks the config against the selected wrap sites, then makes each callable unit (and each
    force-recomputed module) of those sites run in its unit; returns the policy. Nothing is
    changed unless every check passes. `checkpointed`: the sites are about to be checkpointed by
    apply_selective_checkpointing, so they are checked for that too."""
    # Each unit must mean something in at least one selected layer (a MoE unit in the MoE layers
    # of a stack that also has dense ones); where a layer lacks it, nothing is installed there.
    if checkpointed:
        check_sites_checkpointable(model, sites, selected)
    check_target_map(target_map, [sites[index] for index in selected])
    policy = policy_for(config, target_map)

    # Plan: every (owner, attribute, unit) to run in a unit, per selected site.
    plan = []
    for index in selected:
        site = sites[index]
        in_units = []
        for unit in config.selected_units:
            target = target_map[unit]
            if isinstance(target, KeptCallables):
                for owner, name in target.find(site):
                    check_forward_runs(target_map, unit, owner, name, config.field_of(unit))
                    in_units.append((owner, name, unit.value))
        for i, path in enumerate(config.force_recompute_modules):
            found = KeptCallables([path]).find(site)
            if not found:
                raise ConfigError(
                    f"recompute config: force_recompute_modules[{i}]: '{path}' matches nothing in "
                    f"{type(site).__name__} (layer {index})"
                )
            in_units.extend((owner, name, RECOMPUTE_UNIT_PREFIX + path) for owner, name in found)
        plan.append((index, site, in_units))

    names = {id(module): name for name, module in model.named_modules()}
    for index, site, in_units in plan:
        # The Hugging Face integration checkpoints its layers through transformers' hook, not
        # apply_selective_checkpointing: marked here, a module inside one is refused too.
        mark_descendants(site)
        for owner, name, unit in in_units:
            run_in_unit(owner, name, unit)
            logger.debug(
                "%s (wrap site %d): %s.%s runs in unit '%s'",
                names.get(id(site), type(site).__name__),
                index,
                names.get(id(owner), type(owner).__name__) or "<layer>",
                name,
                unit,
            )
    return policy


def check_sites_checkpointable(model: nn.Module, sites, selected) -> None:
    """Raises unless apply_selective_checkpointing can checkpoint each selected site, and no
    selected site holds another (NOTE: [A module is checkpointed once] in checkpointing.py); the
    messages name modules by their qualified names in `model`. Changes nothing."""
    names = {id(module): name for name, module in model.named_modules()}
    chosen = {id(sites[index]): index for index in selected}
    for index in selected:
        site = sites[index]
        check_checkpointable(site, f"apply_recompute_config: wrap site {index}")
        check_not_nested(site, names)
        for path, submodule in site.named_modules():
            if submodule is not site and id(submodule) in chosen:
                inner = names.get(id(submodule)) or path
                raise ValueError(
                    f"sac_plugin: apply_recompute_config: wrap site {index} ({type(site).__name__} "
                    f"'{names.get(id(site), '')}') holds wrap site {chosen[id(submodule)]} "
                    f"({type(submodule).__name__} '{inner}'), so that one would be checkpointed twice; list "
                    "either the outer module or the layers inside it in wrap_sites, not both"
                )


def check_forward_runs(target_map: RecomputeTargetMap, unit, owner, name: str, field: str) -> None:
    """Refuses a unit's callable whose forward never runs: a ModuleList or ModuleDict (its items
    are called one by one, never the container), or any module without a forward of its own. Run
    inside a unit it would open nothing, and the unit would keep nothing."""
    target = getattr(owner, name)
    if isinstance(target, nn.Module) and type(target).forward is nn.Module.forward:
        raise ConfigError(
            f"recompute config: {field}: unit '{getattr(unit, 'value', unit)}' of {target_map.model_name} is "
            f"{type(owner).__name__}.{name}, a {type(target).__name__}, whose forward never runs (its items are "
            "called one by one), so the unit would keep nothing; name the submodules that run in "
            "target_map=RecomputeTargetMap(...)"
        )


def describe_application(
    model_name: str,
    selected,
    count: int,
    policy: Policy,
    config: RecomputeConfig,
    target_map: RecomputeTargetMap | None,
) -> str:
    """The INFO line for one checkpointed model: its sites, its policy, what each unit means."""
    if config.layer_ratio is not None:
        rule = f"layer_ratio={config.layer_ratio}"
    else:
        rule = f"every_nth_layer={config.every_nth_layer}, first_layer={config.first_layer}"
    units = []
    for unit in config.selected_units:
        target = target_map[unit] if target_map is not None else None
        if isinstance(target, KeptOps):
            units.append(f"{unit.value} -> {len(target.resolve())} ops")
        elif isinstance(target, KeptCallables):
            units.append(f"{unit.value} -> {', '.join(target.paths)}")
    what = "full recompute" if policy.keeps_nothing else repr(policy)
    return (
        f"{model_name}: checkpointed {describe_layers(selected, count)} wrap sites ({rule}) with "
        f"{what}"
        + (f"; units: {'; '.join(units)}" if units else "")
        + (f"; recomputed: {', '.join(config.force_recompute_modules)}" if config.force_recompute_modules else "")
    )


def wrap_sites(model: nn.Module, wrap_sites) -> list[nn.Module]:
    """The layers apply_recompute_config checkpoints: `wrap_sites`, or the model's declared ones."""
    sites, _ = given_or_declared(
        model,
        wrap_sites,
        caller="apply_recompute_config",
        argument="wrap_sites",
        noun="wrap sites",
        elements="nn.Module",
        undeclared=ConfigError,
    )
    if not sites:
        raise ConfigError(f"{type(model).__name__} has no wrap sites to checkpoint")
    return sites
