"""The keep rule, asked of the C++ library: one decision per call, with its reason.

Why this module exists: the rule that decides whether a call's outputs are kept or recomputed is
written once, in C++ (`Policy::decide`, NOTE: [The keep rule] in csrc/policy/policy.cpp). The
native fallback calls it directly; the Python front doors (torch.compile's policy function, the
dispatch-mode engine, the memory-budget planner) call it here, through the library's C ABI
(csrc/bindings/c_api.h), so none of them restates the rule. One ctypes call per op, with the GIL
held (PyDLL), as for the scopes in _scopes.py.

    decider = CallDecider(policy)          # one per region: counts every-nth / kept-call indices
    decider.decide(torch.ops.aten.mm.default, recompute=False, unit_names=["attn"])
    decide_call(policy, "aten::mm", ["attn"], call_index=3)   # the planner: it knows the index
"""

from __future__ import annotations

import ctypes
import enum
from typing import NamedTuple, Sequence

import torch

from . import _library, _scopes


class Outcome(enum.IntEnum):
    """What happens to a call's outputs (values as in C++ sac::Outcome)."""

    RECOMPUTE = 0
    KEEP = 1
    # Held like a kept output, in pinned host memory between forward and backward.
    OFFLOAD = 2


class Reason(enum.IntEnum):
    """Why (values and order as in C++ sac::Reason; `text` is the library's prose)."""

    KEPT_OP = 0
    EVERY_NTH_CALL = 1
    KEPT_CALL_INDEX = 2
    KEPT_UNIT = 3
    COLLECTIVE = 4
    NEVER_COUNTED = 5
    RANDOM_DRAW = 6
    MUTATES_INPUT = 7
    VIEW_IN_KEPT_UNIT = 8
    PARAMETER_CAST = 9
    UNINITIALISED_ALLOCATION = 10
    INSIDE_RECOMPUTED_UNIT = 11
    NOT_SELECTED = 12
    OFFLOADED_OP = 13
    OFFLOADED_CALL_INDEX = 14
    OFFLOADED_UNIT = 15
    # Kept: the call routes tokens or copies a value to the host (NOTE: [Routing is served from
    # the forward] in csrc/policy/policy.cpp).
    ROUTES_TOKENS = 16

    @property
    def text(self) -> str:
        return _reason_text(int(self)).decode()


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


_lib = _scopes._lib
_SIGNATURES = {
    "sac_op_entry": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int64]),
    "sac_call_decider_new": (ctypes.c_void_p, [ctypes.c_void_p]),
    "sac_call_decider_release": (None, [ctypes.c_void_p]),
    "sac_call_decider_decide": (
        ctypes.c_int64,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_int64,
            ctypes.c_int32,
        ],
    ),
    "sac_policy_decide": (
        ctypes.c_int64,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int32,
        ],
    ),
    "sac_reason_text": (ctypes.c_char_p, [ctypes.c_int32]),
}
_scopes.declare(_lib, _SIGNATURES)
_op_entry = _lib.sac_op_entry
_decider_new = _lib.sac_call_decider_new
_decider_release = _lib.sac_call_decider_release
_decider_decide = _lib.sac_call_decider_decide
_policy_decide = _lib.sac_policy_decide
_reason_text = _lib.sac_reason_text
if _reason_text(len(Reason) - 1) is None or _reason_text(len(Reason)) is not None:
    raise ImportError(
        f"sac_plugin: {_library.library_path()} names a different set of keep reasons than "
        f"sac_plugin._rule.Reason ({len(Reason)}); rebuild the library from the same source as the package"
    )

# The result of a decision, one int64 (csrc/bindings/c_api.h): outcome, reason, two warning flags,
# and the kept unit's id + 1 (0: none) in the high half.
_DRAWS_RANDOM = 1
_CASTS_A_PARAMETER = 2
_ROUTES_TOKENS = 4
# The caller does not say whether the call routes tokens: C++ answers from the op alone (topk,
# sort, argsort, argmax, nonzero, unique, .item() always route; _to_copy to the CPU needs the
# arguments).
_ROUTING_FROM_OP = 8


def _facts(draws_random: bool, casts_a_parameter: bool, routes_tokens: bool | None) -> int:
    routing = _ROUTING_FROM_OP if routes_tokens is None else (_ROUTES_TOKENS if routes_tokens else 0)
    return (_DRAWS_RANDOM if draws_random else 0) | (_CASTS_A_PARAMETER if casts_a_parameter else 0) | routing


_MUTATING_IN_KEPT_UNIT = 1 << 16
_RANDOM_CALL_OF_KEPT_OP = 1 << 17

_entries: dict = {}
_unit_stacks: dict = {}


def op_entry(op) -> int:
    """The library's entry (an address) for one op overload: a torch OpOverload, or a name of one
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
        encoded = name.encode("utf-8")
        entry = _op_entry(encoded, len(encoded))
        if not entry:
            _scopes.raise_last_error(2)
        _entries[op] = entry
    return entry


class _UnitStack:
    # One stack of open unit names as the C ABI takes it (an int64 array of unit ids + 1), and
    # the decisions already decoded for it: a model opens a few unit stacks over and over, and a
    # result (outcome, reason, flags, unit) repeats, so each is decoded once.
    __slots__ = ("array", "count", "names", "decoded")

    def __init__(self, names: tuple):
        ids = [_scopes.unit_id(name) for name in names]
        self.array = (ctypes.c_int64 * len(ids))(*ids)
        self.count = len(ids)
        self.names = dict(zip(ids, names))
        self.decoded: dict[int, Decision] = {}

    def decode(self, result: int) -> Decision:
        decision = self.decoded.get(result)
        if decision is None:
            if result < 0:
                _scopes.raise_last_error(-result)
            unit_plus_one = result >> 32
            decision = Decision(
                Outcome(result & 0xFF),
                Reason((result >> 8) & 0xFF),
                self.names.get(unit_plus_one) if unit_plus_one else None,
                bool(result & _MUTATING_IN_KEPT_UNIT),
                bool(result & _RANDOM_CALL_OF_KEPT_OP),
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
    recompute) exactly as the native fallback counts them. Owns a reference to the C++ decider."""

    __slots__ = ("_address",)

    def __init__(self, policy):
        address = getattr(policy, "_policy_address", None)
        if not isinstance(address, int) or not address:
            raise TypeError(f"sac_plugin: CallDecider needs a sac_plugin.Policy, got {type(policy).__name__}")
        self._address = _decider_new(address)
        if not self._address:
            _scopes.raise_last_error(1)

    def __del__(self, _release=_decider_release):
        if getattr(self, "_address", None):
            _release(self._address)

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
        (recompute=False) or the recompute, with `unit_names` open (outermost first). `routes_tokens`:
        whether the call routes tokens or copies to the host; None lets the op alone say."""
        units = _units(unit_names)
        entry = _entries.get(op) or op_entry(op)
        facts = _facts(draws_random, casts_a_parameter, routes_tokens)
        return units.decode(
            _decider_decide(self._address, entry, 1 if recompute else 0, units.array, units.count, facts)
        )


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
    address = getattr(policy, "_policy_address", None)
    if not isinstance(address, int) or not address:
        raise TypeError(f"sac_plugin: decide_call needs a sac_plugin.Policy, got {type(policy).__name__}")
    units = _units(unit_names)
    facts = _facts(draws_random, casts_a_parameter, routes_tokens)
    return units.decode(_policy_decide(address, op_entry(op_name), units.array, units.count, call_index, facts))
