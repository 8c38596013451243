"""What a RecomputeConfig means for a model: its target map checked (each unit resolves to ops or
to callables under the wrap sites), and the Policy its fields and units make, a Policy error
named by the config field it comes from."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

from torch import nn

from .config import RECOMPUTE_UNIT_PREFIX, ConfigError, RecomputeConfig
from .policy import Policy
from .targets import KeptCallables, KeptOps, RecomputeTargetMap

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
                raise ConfigError(f"{where}: {_policy_error_text(error)}") from None
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


# A Policy error opens with the library's prefix and the Policy argument it concerns ("sac:
# kept_ops: ..."); a config error names the config's own field instead, so that it reads with one prefix.
_POLICY_ERROR_PREFIX = re.compile(
    r"^(?:sac_plugin|sac): (?:(?:" + "|".join(name for name in inspect.signature(Policy).parameters) + r"): )?"
)


def _policy_error_text(error: Exception) -> str:
    """What a Policy error says, without the prefixes a config error replaces."""
    return _POLICY_ERROR_PREFIX.sub("", str(error), count=1)


def _ops_and_units(field: str, units, target_map: RecomputeTargetMap) -> tuple[set[str], list[str]]:
    """The ops (KeptOps units) and unit names (KeptCallables units) that `units` mean for the model."""
    ops, names = set(), []
    for i, unit in enumerate(units):
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
    """The policy a config means for a model with this target map."""
    unit_ops, kept_units = _ops_and_units("units", config.units, target_map)
    offloaded_unit_ops, offloaded_units = _ops_and_units("offloaded_units", config.offloaded_units, target_map)
    kept_ops = set(config.ops) | unit_ops
    offloaded_ops = set(config.offloaded_ops) | offloaded_unit_ops
    recomputed = [RECOMPUTE_UNIT_PREFIX + path for path in config.force_recompute_modules]
    try:
        return Policy(
            kept_ops=sorted(kept_ops),
            kept_units=kept_units + list(config.regions),
            every_nth_op=config.every_nth_op,
            recomputed_units=recomputed + list(config.recomputed_regions),
            offloaded_ops=sorted(offloaded_ops),
            offloaded_units=offloaded_units + list(config.offloaded_regions),
            offload_min_bytes=config.offload_min_bytes,
            host_memory_limit=config.host_memory_limit,
            pin_routing=config.pin_routing,
            offload_inputs=config.offload_inputs,
        )
    except ValueError as error:
        text = str(error)
        field = (
            "offloaded_ops"
            if "offloaded_ops" in text
            else "ops"
            if any(op in text for op in config.ops)
            else "every_nth_op"
        )
        raise ConfigError(f"recompute config: {field}: {_policy_error_text(error)}") from None
