"""Policies: which ops keep their outputs for backward, and which recompute units are kept."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
    every_nth_op: {op: n}: keep calls 1, n+1, 2n+1, ... of the op in each region; {"aten::mm": 2}
        is torchtitan's "every other matmul" rule.
    recomputed_units: units whose ops are always recomputed, whatever else would keep them.

    Unknown ops, collectives, random and mutating ops raise ValueError here, at declaration.
    """

    __slots__ = ("_handle", "_kept_ops", "_kept_units", "_spellings", "_every_nth", "_recomputed_units")

    def __init__(self, kept_ops: Iterable = (), kept_units: Iterable[str] = (), *,
                 every_nth_op: Mapping | None = None, recomputed_units: Iterable[str] = ()):
        spellings = [op_spelling(op) for op in _names(kept_ops, "kept_ops")]
        units = _unit_names(kept_units, "kept_units")
        recomputed = _unit_names(recomputed_units, "recomputed_units")
        every_nth = {op_spelling(op): n for op, n in (every_nth_op or {}).items()}
        for spelling, n in every_nth.items():
            if not isinstance(n, int) or isinstance(n, bool):
                raise TypeError(f"sac_plugin: every_nth_op['{spelling}'] must be an int, got {n!r}")
        self._handle = torch.classes.sac.Policy(spellings, units, list(every_nth), list(every_nth.values()), recomputed)
        self._spellings = tuple(spellings)
        self._every_nth = dict(every_nth)
        self._kept_ops = frozenset(self._handle.kept_ops())
        self._kept_units = frozenset(self._handle.kept_units())
        self._recomputed_units = frozenset(self._handle.recomputed_units())

    @property
    def kept_ops(self) -> frozenset[str]:
        """Every kept overload, as "aten::mm" (default overload) or "aten::mm.out"."""
        return self._kept_ops

    @property
    def kept_units(self) -> frozenset[str]:
        return self._kept_units

    @property
    def recomputed_units(self) -> frozenset[str]:
        return self._recomputed_units

    @property
    def every_nth_op(self) -> dict[str, int]:
        """Every-nth rules by kept overload name ("aten::mm": 2)."""
        ops, every = self._handle.every_nth_ops()
        return dict(zip(ops, every))

    @property
    def keeps_nothing(self) -> bool:
        return not self._kept_ops and not self._kept_units and not self._every_nth

    def kept_overloads(self) -> list[torch._ops.OpOverload]:
        """The kept ops as OpOverload objects (what torch.compile's policy functions see)."""
        return [overload_of(name) for name in sorted(self._kept_ops)]

    def _identity(self):
        return (self._kept_ops, self._kept_units, tuple(sorted(self.every_nth_op.items())), self._recomputed_units)

    def __repr__(self) -> str:
        parts = [f"kept_ops={sorted(self._spellings)!r}", f"kept_units={sorted(self._kept_units)!r}"]
        if self._every_nth:
            parts.append(f"every_nth_op={self._every_nth!r}")
        if self._recomputed_units:
            parts.append(f"recomputed_units={sorted(self._recomputed_units)!r}")
        return f"Policy({', '.join(parts)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    # A policy is immutable: copies share it, pickles rebuild it from its names.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_rebuild_policy, (self._spellings, tuple(sorted(self._kept_units)), self._every_nth,
                                  tuple(sorted(self._recomputed_units))))


def _rebuild_policy(kept_ops, kept_units, every_nth_op, recomputed_units):
    return Policy(kept_ops, kept_units, every_nth_op=every_nth_op, recomputed_units=recomputed_units)


def overload_of(name: str) -> torch._ops.OpOverload:
    """torch.ops.aten.mm.out for "aten::mm.out", torch.ops.aten.mm.default for "aten::mm"."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")


def _unit_names(values, what: str) -> list[str]:
    units = _names(values, what)
    for unit in units:
        if not isinstance(unit, str):
            raise TypeError(f"sac_plugin: {what} must hold unit names (str), got {unit!r}")
    return [str(unit) for unit in units]  # a StrEnum member becomes its plain value


def resolve_kept_ops(names: Iterable) -> frozenset[str]:
    """The names among `names` that name a registered op; the rest are skipped.

    Lets a model list every spelling of an op (say flash-attention v2 and v3) and keep the ones
    this installation has. Raises ValueError when none of them resolves.
    """
    spellings = [op_spelling(op) for op in _names(names, "names")]
    return frozenset(torch.ops.sac.resolvable_op_names(spellings))
