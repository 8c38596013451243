"""The vocabulary of recompute units, and how each model declares what a unit means for it.

A unit is resolved, per model, either to op names (KeptOps: they survive compilation, since a
compiled region keeps ops by name) or to callables (KeptCallables: submodules or methods that
are run inside the unit, so every op they issue is kept). A RecomputeTargetMap binds a model's
units to either kind.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from ._validation import describe_value
from .policy import resolve_kept_ops
from .units import RecomputeUnit

__all__ = ["ATTENTION_OPS", "KeptCallables", "KeptOps", "RecomputeTargetMap"]


@dataclass(frozen=True)
class KeptOps:
    """A unit resolved to op names. Spellings a build lacks are skipped (list the flash-attention
    v2 and v3 spellings together); at least one must resolve.

    Args:
        ops: Op names, as `Policy(kept_ops=...)` spells them ("aten::mm", "aten::mm.default").

    Raises:
        TypeError: `ops` is a single str or not a collection of non-empty strs.
    """

    ops: tuple[str, ...]

    def __init__(self, ops: Iterable[str]):
        object.__setattr__(self, "ops", _strings(ops, "KeptOps: ops", "['aten::mm']"))

    def resolve(self) -> frozenset[str]:
        """The op names this build registers.

        Returns:
            The names of `ops` that resolve here; empty when `ops` is.

        Raises:
            ValueError: `ops` is not empty and none of its names resolves.
        """
        return resolve_kept_ops(self.ops) if self.ops else frozenset()


@dataclass(frozen=True)
class KeptCallables:
    """A unit resolved to callables, by path from a wrap site (a layer): "feed_forward" (a
    submodule: its forward runs inside the unit), "moe.dispatch" (a method), "moe.experts.*"
    (every child of a container; fnmatch patterns per segment).

    Args:
        paths: Dotted paths from the wrap site to the callables.

    Raises:
        TypeError: `paths` is a single str or not a collection of non-empty strs.
    """

    paths: tuple[str, ...]

    def __init__(self, paths: Iterable[str]):
        object.__setattr__(self, "paths", _strings(paths, "KeptCallables: paths", "['feed_forward']"))

    def find(self, site: nn.Module) -> list[tuple[object, str]]:
        """The callables the paths name under `site`.

        Args:
            site: The wrap site (a layer) the paths start from.

        Returns:
            `(owner, attribute)` of each callable found; a path that matches nothing adds none.
        """
        found = []
        for path in self.paths:
            found.extend(_find(site, path.split(".")))
        return found


UnitTarget = KeptOps | KeptCallables


class RecomputeTargetMap(Mapping):
    """A model's table: unit -> KeptOps or KeptCallables; a read-only mapping keyed by unit.

    Args:
        model_name: What error messages call the model ("Llama").
        targets: What each unit means for the model. Keys are RecomputeUnit members or their
            values ("attn").

    Raises:
        TypeError: `model_name` is not a non-empty str, or a target is neither KeptOps nor KeptCallables.
        ValueError: A key is not a unit.
    """

    def __init__(self, model_name: str, targets: Mapping[RecomputeUnit, UnitTarget]):
        if not isinstance(model_name, str) or not model_name:
            raise TypeError(
                f"sac_plugin: RecomputeTargetMap: model_name must be a non-empty str, got {describe_value(model_name)}"
            )
        if not isinstance(targets, Mapping):
            raise TypeError(
                "sac_plugin: RecomputeTargetMap: targets must map units to KeptOps or KeptCallables, "
                f"got {describe_value(targets)}"
            )
        self.model_name = model_name
        self._targets = {}
        for unit, target in targets.items():
            if not isinstance(target, (KeptOps, KeptCallables)):
                raise TypeError(
                    f"sac_plugin: RecomputeTargetMap: targets[{unit!r}] must be KeptOps or KeptCallables, "
                    f"got {describe_value(target)}"
                )
            self._targets[_unit_of(unit, "RecomputeTargetMap: targets key")] = target

    def __getitem__(self, unit) -> UnitTarget:
        try:
            return self._targets[RecomputeUnit(unit)]
        except ValueError:  # not a unit at all: a Mapping answers KeyError (so `in` works)
            raise KeyError(unit) from None

    def __iter__(self):
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __repr__(self) -> str:
        return f"RecomputeTargetMap({self.model_name!r}, {self._targets!r})"


def _strings(values, where: str, example: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or isinstance(values, Mapping) or not isinstance(values, Iterable):
        raise TypeError(f"sac_plugin: {where} must be a list of names such as {example}, got {describe_value(values)}")
    values = tuple(values)
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value:
            raise TypeError(f"sac_plugin: {where}[{i}] must be a non-empty str, got {describe_value(value)}")
    return values


def _unit_of(unit, where: str) -> RecomputeUnit:
    try:
        return RecomputeUnit(unit)
    except ValueError:
        known = ", ".join(u.value for u in RecomputeUnit)
        raise ValueError(f"sac_plugin: {where}: unknown unit {describe_value(unit)}; known units: {known}") from None


def _find(owner, segments: list[str]) -> list[tuple[object, str]]:
    head, rest = segments[0], segments[1:]
    if isinstance(owner, nn.Module):
        names = [name for name, _ in owner.named_children()] if any(c in head for c in "*?[") else [head]
        names = [name for name in names if fnmatch.fnmatchcase(name, head)]
    else:
        names = [head]
    found = []
    for name in names:
        child = getattr(owner, name, None)
        if child is None:
            continue
        if rest:
            found.extend(_find(child, rest))
        elif isinstance(child, nn.Module) or callable(child):
            found.append((owner, name))
    return found


# Every spelling of attention a build may have; resolve_kept_ops keeps the ones that exist.
ATTENTION_OPS = KeptOps(
    [
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    ]
)
"""Attention as ops: every spelling of scaled dot-product attention a build may have (the ones a
build lacks are skipped), for a target map's attention unit."""


def default_target_map(model: nn.Module) -> RecomputeTargetMap:
    """The target map a model declares as its `recompute_targets` attribute (the reference models
    in sac_plugin.models do), or ValueError saying how to give one."""
    declared = getattr(model, "recompute_targets", None)
    if isinstance(declared, RecomputeTargetMap):
        return declared
    raise ValueError(
        f"sac_plugin: {type(model).__name__} declares no recompute target map; pass target_map=RecomputeTargetMap(...) "
        "or give the model a `recompute_targets` attribute"
    )
