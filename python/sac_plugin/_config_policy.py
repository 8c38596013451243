"""What a RecomputeConfig means for a model: its target map checked (each unit resolves to ops or
to callables under the wrap sites), and the Policy its fields and units make, a Policy error
named by the config field it comes from."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .config import RECOMPUTE_UNIT_PREFIX, ConfigError, RecomputeConfig
from .policy import Policy
from ._validation import without_library_prefix
from .targets import KeptCallables, KeptOps, RecomputeTargetMap
from .units import RecomputeUnit

__all__ = ["check_target_map", "policy_for"]


def check_target_map(target_map: RecomputeTargetMap, site: nn.Module | Sequence[nn.Module] | None = None) -> None:
    """Every unit of the map resolves to at least one registered op or, given wrap sites (one
    module or several: the selected layers of a stack that mixes dense and MoE layers), one
    callable under at least one of them; a KeptOps unit names no collective (Policy refuses it)."""
    sites = [] if site is None else [site] if isinstance(site, nn.Module) else list(site)
    for unit, target in target_map.items():
        where = f"target map of {target_map.model_name}: unit '{unit.value}'"
        if isinstance(target, KeptOps):
            try:
                ops = target.resolve()
                Policy(kept_ops=ops)
            except ValueError as error:
                raise ConfigError(f"{where}: {without_library_prefix(error).removeprefix('kept_ops: ')}") from None
            if not ops:
                raise ConfigError(f"{where} is empty: it names no op")
        elif isinstance(target, KeptCallables):
            if not target.paths:
                raise ConfigError(f"{where} is empty: it names no callable")
            if sites and not any(target.find(layer) for layer in sites):
                names = sorted({type(layer).__name__ for layer in sites})
                raise ConfigError(f"{where}: {list(target.paths)} match nothing in {', '.join(names)}")
        else:
            raise ConfigError(f"{where}: expected KeptOps or KeptCallables, got {type(target).__name__}")


def _ops_and_units(field: str, units, target_map: RecomputeTargetMap) -> tuple[set[str], list[str]]:
    """The ops (catalog units the map resolves to KeptOps) and unit names (the map's KeptCallables
    units, and every name or pattern outside the catalog, as written) that `units` mean."""
    ops, names = set(), []
    for i, unit in enumerate(units):
        if not isinstance(unit, RecomputeUnit):
            names.append(unit)
            continue
        if unit not in target_map:
            declared = ", ".join(u.value for u in target_map)
            raise ConfigError(
                f"recompute config: {field}[{i}]: {target_map.model_name} declares no unit '{unit.value}' "
                f"(it declares {declared})"
            )
        target = target_map[unit]
        if isinstance(target, KeptOps):
            ops |= target.resolve()
        else:
            names.append(unit.value)
    return ops, names


def policy_for(config: RecomputeConfig, target_map: RecomputeTargetMap) -> Policy:
    """The policy a config means for a model with this target map. The config and Policy name
    their fields alike, so a Policy error names the config's field as it is."""
    unit_ops, kept_units = _ops_and_units("kept_units", config.kept_units, target_map)
    offloaded_unit_ops, offloaded_units = _ops_and_units("offloaded_units", config.offloaded_units, target_map)
    recomputed = [RECOMPUTE_UNIT_PREFIX + path for path in config.force_recompute_modules]
    try:
        return Policy(
            kept_ops=sorted(set(config.kept_ops) | unit_ops),
            kept_units=kept_units,
            every_nth_op=config.every_nth_op,
            recomputed_units=recomputed + list(config.recomputed_units),
            offloaded_ops=sorted(set(config.offloaded_ops) | offloaded_unit_ops),
            offloaded_units=offloaded_units,
            offload_min_bytes=config.offload_min_bytes,
            host_memory_limit=config.host_memory_limit,
            pin_routing=config.pin_routing,
            offload_inputs=config.offload_inputs,
        )
    except ValueError as error:
        raise ConfigError(f"recompute config: {without_library_prefix(error)}") from None
