"""The keep rule, asked of the C++ library: one decision per call, with its reason.

Why this module exists: the rule that decides whether a call's outputs are kept or recomputed is
written once, in C++ (`Policy::decide`, NOTE: [The keep rule] in csrc/policy/policy.cpp). The
native fallback calls it directly; the Python front doors (torch.compile's policy function, the
dispatch-mode engine, the memory-budget planner) call it here, through the extension module's
CallDecider and policy_decide (csrc/bindings/rule_calls.h), so none of them restates the rule. One
C call per op.

    decider = CallDecider(policy)          # one per region: counts every-nth / kept-call indices
    decider.decide(torch.ops.aten.mm.default, recompute=False, unit_names=["attn"])
    decide_call(policy, "aten::mm", ["attn"], call_index=3)   # the planner: it knows the index
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import _native, _scopes
from ._native import (
    DECISION_MUTATING_IN_KEPT_UNIT,
    DECISION_RANDOM_CALL_OF_KEPT_OP,
    FACT_CASTS_A_PARAMETER,
    FACT_DRAWS_RANDOM,
    FACT_ROUTES_TOKENS,
    FACT_ROUTING_FROM_OP,
    Outcome,
    Reason,
)

__all__ = ["CallDecider", "Decision", "Outcome", "Reason", "RegionOpening", "decide_call", "op_entry", "region_opening"]


class Decision(NamedTuple):
    outcome: Outcome
    reason: Reason
    # The kept or offloaded unit that selected the call (among the names passed), or None.
    unit: str | None
    # Worth a warning (once per policy and op): a mutating op inside a kept unit; a call of a kept
    # op that draws random numbers (attention with dropout_p > 0).
    mutating_in_kept_unit: bool = False
    random_call_of_kept_op: bool = False

    @property
    def keep(self) -> bool:
        return self.outcome == Outcome.KEEP

    @property
    def held(self) -> bool:
        """Whether the outputs are held for the recompute: kept or offloaded."""
        return self.outcome != Outcome.RECOMPUTE


_op_entry = _native.C.op_entry
_policy_decide = _native.C.policy_decide


def _facts(draws_random: bool, casts_a_parameter: bool, routes_tokens: bool | None) -> int:
    routing = FACT_ROUTING_FROM_OP if routes_tokens is None else (FACT_ROUTES_TOKENS if routes_tokens else 0)
    return (FACT_DRAWS_RANDOM if draws_random else 0) | (FACT_CASTS_A_PARAMETER if casts_a_parameter else 0) | routing


_entries: dict = {}
_unit_stacks: dict = {}


def op_entry(op) -> int:
    """The library's entry (a _C.OpEntry) for one op overload: a torch OpOverload, or a name of one
    overload ("aten::mm.default", "aten.mm.default", or the profile's "aten::mm" for the default
    overload). Cached per op; raises ValueError for a name that names no single overload."""
    entry = _entries.get(op)
    if entry is None:
        if isinstance(op, torch._ops.OpOverload):
            name = f"{op._schema.name}.{op._overloadname}"
        elif isinstance(op, str):
            name = op
        else:
            raise TypeError(
                f"sac_plugin: op_entry: expected an op overload such as torch.ops.aten.mm.default or a name "
                f"such as 'aten::mm.default', got {type(op).__name__}"
            )
        entry = _entries[op] = _op_entry(name)
    return entry


# The bits of kRegionOpeningBit and kRegionRecomputesBit in csrc/policy/unit_stack.h; the library
# checks each id it is given, so a mismatch is refused there rather than misread.
_REGION_OPENING_BIT = 1 << 29
_REGION_RECOMPUTES_BIT = 1 << 30


def region_opening(id_plus_one: int, recompute: bool) -> int:
    """The id (+ 1, as the library takes it) of an opening of unit `id_plus_one` by a torch_remat
    region with its recompute= flag (NOTE: [Region openings carry their flag] in
    csrc/policy/unit_stack.h)."""
    opening = (id_plus_one - 1) | _REGION_OPENING_BIT | (_REGION_RECOMPUTES_BIT if recompute else 0)
    return opening + 1


class RegionOpening(NamedTuple):
    """An open unit that a torch_remat region opened, with its flag: what the rule reads to follow
    the flag when no list names the unit. A plain open unit is its name (a str)."""

    name: str
    recompute: bool


def _open_unit_id(unit) -> int:
    if type(unit) is RegionOpening:
        return region_opening(_scopes.unit_id(unit.name), unit.recompute)
    return _scopes.unit_id(unit)


class _UnitStack:
    # One stack of open units as the library takes it (a tuple of unit ids + 1), and the
    # decisions already decoded for it: a model opens a few unit stacks over and over, and a
    # result (outcome, reason, flags, unit) repeats, so each is decoded once. The decision names
    # the unit's own id, a region opening's too.
    __slots__ = ("ids", "names", "decoded")

    def __init__(self, units: tuple):
        names = [unit.name if type(unit) is RegionOpening else unit for unit in units]
        ids = [_open_unit_id(unit) for unit in units]
        self.ids = tuple(ids)
        self.names = {_scopes.unit_id(name): name for name in names}
        self.decoded: dict[int, Decision] = {}

    def decode(self, result: int) -> Decision:
        decision = self.decoded.get(result)
        if decision is None:
            unit_plus_one = result >> 32
            decision = Decision(
                Outcome(result & 0xFF),
                Reason((result >> 8) & 0xFF),
                self.names.get(unit_plus_one) if unit_plus_one else None,
                bool(result & DECISION_MUTATING_IN_KEPT_UNIT),
                bool(result & DECISION_RANDOM_CALL_OF_KEPT_OP),
            )
            self.decoded[result] = decision
        return decision


def _units(unit_names: Sequence[str]) -> _UnitStack:
    key = unit_names if type(unit_names) is tuple else tuple(unit_names)
    stack = _unit_stacks.get(key)
    if stack is None:
        stack = _unit_stacks[key] = _UnitStack(key)
    return stack


class CallDecider:
    """Decides the calls of one region, counting every-nth and kept-call indices per pass (forward,
    recompute) exactly as the native fallback counts them. Owns the C++ decider (a _C.CallDecider)."""

    __slots__ = ("_decide",)

    def __init__(self, policy):
        self._decide = _native.C.CallDecider(_policy_handle(policy, "CallDecider")).decide

    def decide(
        self,
        op,
        recompute: bool,
        unit_names: Sequence[str] = (),
        draws_random: bool = False,
        casts_a_parameter: bool = False,
        routes_tokens: bool | None = None,
    ) -> Decision:
        """The decision for one call of `op` (an OpOverload or a name, see op_entry) in the forward
        (recompute=False) or the recompute, with `unit_names` open (outermost first): names, or
        RegionOpening for a unit a torch_remat region opened. `routes_tokens`:
        whether the call routes tokens or copies to the host; None lets the op alone say."""
        units = _units(unit_names)
        entry = _entries.get(op) or op_entry(op)
        facts = _facts(draws_random, casts_a_parameter, routes_tokens)
        return units.decode(self._decide(entry, 1 if recompute else 0, units.ids, facts))


def decide_call(
    policy,
    op_name,
    unit_names: Sequence[str],
    call_index: int,
    draws_random: bool = False,
    casts_a_parameter: bool = False,
    routes_tokens: bool | None = None,
) -> Decision:
    """The decision for the call of `op_name` with 0-based `call_index` among the region's counted
    calls of it, with `unit_names` open: for the planner, which knows each call's index."""
    handle = _policy_handle(policy, "decide_call")
    units = _units(unit_names)
    facts = _facts(draws_random, casts_a_parameter, routes_tokens)
    return units.decode(_policy_decide(handle, op_entry(op_name), units.ids, call_index, facts))


def _policy_handle(policy, what: str):
    handle = getattr(policy, "_handle", None)
    if not isinstance(handle, _native.C.Policy):
        raise TypeError(f"sac_plugin: {what} needs a sac_plugin.Policy, got {type(policy).__name__}")
    return handle
