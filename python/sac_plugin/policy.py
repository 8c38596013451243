"""Policies: which ops keep their outputs for backward, and which recompute units are kept."""

from __future__ import annotations

from collections.abc import Iterable

import torch

OpLike = "str | torch._ops.OpOverload | torch._ops.OpOverloadPacket"


def op_spelling(op) -> str:
    """The plugin's spelling of an op: "aten::mm.default" for an overload, "aten::mm" for a packet."""
    if isinstance(op, str):
        return op
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise TypeError(
        f"sac_plugin: expected an op name such as 'aten::mm.default' or an op such as "
        f"torch.ops.aten.mm.default, got {type(op).__name__}: {op!r}"
    )


def _names(values, what: str) -> list[str]:
    if isinstance(values, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"sac_plugin: {what} must be a collection of names, not a single {type(values).__name__}")
    return list(values)


class Policy:
    """Which ops a checkpointed region keeps.

    kept_ops: op overloads whose outputs are kept ("aten::mm" for every overload,
        "aten::mm.default", or torch.ops.aten.mm.default).
    kept_units: names of recompute units (see `recompute_unit`) inside which every op is kept.

    Unknown ops, collectives, random and mutating ops raise ValueError here, at declaration.
    """

    __slots__ = ("_handle", "_kept_ops", "_kept_units", "_spellings")

    def __init__(self, kept_ops: Iterable = (), kept_units: Iterable[str] = ()):
        spellings = [op_spelling(op) for op in _names(kept_ops, "kept_ops")]
        units = _names(kept_units, "kept_units")
        for unit in units:
            if not isinstance(unit, str):
                raise TypeError(f"sac_plugin: kept_units must hold unit names (str), got {unit!r}")
        self._handle = torch.classes.sac.Policy(spellings, units)
        self._spellings = tuple(spellings)
        self._kept_ops = frozenset(self._handle.kept_ops())
        self._kept_units = frozenset(self._handle.kept_units())

    @property
    def kept_ops(self) -> frozenset[str]:
        """Every kept overload, as "aten::mm" (default overload) or "aten::mm.out"."""
        return self._kept_ops

    @property
    def kept_units(self) -> frozenset[str]:
        return self._kept_units

    @property
    def keeps_nothing(self) -> bool:
        return not self._kept_ops and not self._kept_units

    def kept_overloads(self) -> list[torch._ops.OpOverload]:
        """The kept ops as OpOverload objects (what torch.compile's policy functions see)."""
        overloads = []
        for name in sorted(self._kept_ops):
            namespace, _, rest = name.partition("::")
            op_name, _, overload = rest.partition(".")
            packet = getattr(getattr(torch.ops, namespace), op_name)
            overloads.append(getattr(packet, overload or "default"))
        return overloads

    def __repr__(self) -> str:
        return f"Policy(kept_ops={sorted(self._spellings)!r}, kept_units={sorted(self._kept_units)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and (self._kept_ops, self._kept_units) == (other._kept_ops, other._kept_units)

    def __hash__(self) -> int:
        return hash((self._kept_ops, self._kept_units))

    # A policy is immutable: copies share it, pickles rebuild it from its names.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (Policy, (self._spellings, tuple(sorted(self._kept_units))))


def resolve_kept_ops(names: Iterable) -> frozenset[str]:
    """The names among `names` that name a registered op; the rest are skipped.

    Lets a model list every spelling of an op (say flash-attention v2 and v3) and keep the ones
    this installation has. Raises ValueError when none of them resolves.
    """
    spellings = [op_spelling(op) for op in _names(names, "names")]
    return frozenset(torch.ops.sac.resolvable_op_names(spellings))
