"""Policies: which ops keep their outputs for backward, and which recompute units are kept."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping

import torch

__all__ = [
    "Policy",
    "bounded_repr",
    "describe_value",
    "op_spelling",
    "check_unit_name",
    "overload_of",
    "resolve_kept_ops",
]

OpLike = "str | torch._ops.OpOverload | torch._ops.OpOverloadPacket"

# Mirrors of the C++ bounds (kMaxOpNameLength in op_resolution.h, kMaxUnitNameLength in
# unit_stack.h), checked here first so that the message names the argument.
MAX_OP_NAME_LENGTH = 1024
MAX_UNIT_NAME_LENGTH = 256
# every_nth_op's n travels to C++ as int64 and is stored exactly.
MAX_EVERY_NTH = 2**63 - 1

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlevel = 2
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 4


def bounded_repr(value) -> str:
    """repr(value), cut short: a huge or deeply nested value (a YAML alias bomb) costs nothing."""
    return _short.repr(value)


def describe_value(value) -> str:
    """What a caller passed, for messages: a bounded repr (a huge or deeply nested value costs
    nothing) and its type."""
    return f"{_short.repr(value)} ({type(value).__name__})"


def _check_text(name: str, where: str, what: str, limit: int, why: str = "") -> str:
    """Refuses names the C++ side could not report faithfully or would keep forever."""
    if "\x00" in name:
        raise ValueError(f"sac_plugin: {where}: {what} cannot contain a NUL character, got {_short.repr(name)}")
    if len(name) > limit:
        raise ValueError(
            f"sac_plugin: {where}: {what} has at most {limit} characters{why}, got one of {len(name)}: "
            f"{_short.repr(name)}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"sac_plugin: {where}: {what} must be valid Unicode text, got {_short.repr(name)}") from None
    return name


def op_spelling(op, where: str = "op") -> str:
    """The plugin's spelling of an op: "aten::mm.default" for an overload, "aten::mm" for a packet."""
    if isinstance(op, str):
        return _check_text(op, where, "an op name", MAX_OP_NAME_LENGTH)
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise TypeError(
        f"sac_plugin: {where}: expected an op name such as 'aten::mm.default' or an op such as "
        f"torch.ops.aten.mm.default, got {describe_value(op)}"
    )


def _names(values, what: str, example: str = "['aten::mm']") -> list:
    if isinstance(values, (str, bytes, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(
            f"sac_plugin: {what} must be a collection of names, not a single {type(values).__name__}: "
            f"{_short.repr(values)}; write [{_short.repr(values)}]"
        )
    if isinstance(values, Mapping) or not isinstance(values, Iterable):
        raise TypeError(
            f"sac_plugin: {what} must be a collection of names such as {example}, got {describe_value(values)}"
        )
    return list(values)


def check_unit_name(name, where: str) -> str:
    """A unit name as recompute_unit and policies accept it; the plain str of a StrEnum member."""
    if not isinstance(name, str):
        raise TypeError(
            f"sac_plugin: {where}: a recompute unit name is a str such as 'attn', got {describe_value(name)}"
        )
    if not name:
        raise ValueError(f"sac_plugin: {where}: a recompute unit needs a non-empty str name such as 'attn', got ''")
    _check_text(
        name, where, "a recompute unit name", MAX_UNIT_NAME_LENGTH, " (names are kept for the life of the process)"
    )
    return str(name)


def _every_nth_rules(every_nth_op) -> dict[str, int]:
    if every_nth_op is None:
        return {}
    if not isinstance(every_nth_op, Mapping):
        raise TypeError(
            "sac_plugin: every_nth_op must be a mapping from op to n such as {'aten::mm': 2}, got "
            f"{describe_value(every_nth_op)}"
        )
    rules: dict[str, int] = {}
    for op, n in every_nth_op.items():
        spelling = op_spelling(op, "every_nth_op key")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_EVERY_NTH:
            raise (TypeError if not isinstance(n, int) or isinstance(n, bool) else ValueError)(
                f"sac_plugin: every_nth_op[{spelling!r}] must be an int from 1 to 2**63 - 1 (2 keeps every "
                f"other call), got {describe_value(n)}"
            )
        if rules.get(spelling, n) != n:
            raise ValueError(
                f"sac_plugin: every_nth_op names {spelling!r} twice, with n = {rules[spelling]} and n = {n}; "
                "give each op one n"
            )
        rules[spelling] = n
    return rules


def _call_rules(calls, field: str = "kept_calls") -> dict[str, tuple[int, ...]]:
    """{op: call indices} as the C++ side takes it: indices sorted, repeats merged, empty lists dropped."""
    if calls is None:
        return {}
    if not isinstance(calls, Mapping):
        raise TypeError(
            f"sac_plugin: {field} must be a mapping from op to call indices such as {{'aten::mm.default': [0, 2]}}, "
            f"got {describe_value(calls)}"
        )
    rules: dict[str, tuple[int, ...]] = {}
    for op, indices in calls.items():
        spelling = op_spelling(op, f"{field} key")
        if isinstance(indices, (str, bytes, Mapping)) or not isinstance(indices, Iterable):
            raise TypeError(
                f"sac_plugin: {field}[{spelling!r}] must be a collection of 0-based call indices such as [0, 2], "
                f"got {describe_value(indices)}"
            )
        indices = list(indices)
        for index in indices:
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_EVERY_NTH:
                raise (TypeError if not isinstance(index, int) or isinstance(index, bool) else ValueError)(
                    f"sac_plugin: {field}[{spelling!r}]: a call index is an int from 0 to 2**63 - 1 (0 is the "
                    f"op's first call in the region), got {describe_value(index)}"
                )
        if spelling in rules:
            raise ValueError(f"sac_plugin: {field} names {spelling!r} twice; give each op one list of calls")
        if indices:
            rules[spelling] = tuple(sorted(set(indices)))
    return rules


def _byte_count(value, field: str, *, allow_none: bool) -> int:
    """A byte count as C++ takes it (int64; -1 for none where None is allowed)."""
    if value is None and allow_none:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_EVERY_NTH:
        accepted = "an int from 0 to 2**63 - 1" + (", or None for no limit" if allow_none else "")
        raise (TypeError if not isinstance(value, int) or isinstance(value, bool) else ValueError)(
            f"sac_plugin: {field} is a byte count, {accepted}; got {describe_value(value)}"
        )
    return value


def _unflatten(flat) -> dict[str, tuple[int, ...]]:
    ops, counts, indices = flat
    rules, start = {}, 0
    for op, count in zip(ops, counts):
        rules[op] = tuple(indices[start : start + count])
        start += count
    return rules


class Policy:
    """Which calls a checkpointed region keeps, offloads or recomputes.

    kept_ops: op overloads whose outputs are kept ("aten::mm" for every overload,
        "aten::mm.default", or torch.ops.aten.mm.default).
    kept_units: names of recompute units (see `recompute_unit`; a torch_remat region is one)
        inside which every op is kept. Unit names in kept_units, recomputed_units and
        offloaded_units may be patterns: each '*' matches any run of characters, dots included,
        as torchtitan's region patterns ("*", "*routed_experts.w13.*"). A torch_remat region that
        no list names follows its own recompute= flag.
    every_nth_op: {op: n}: keep calls 1, n+1, 2n+1, ... of the op in each region; {"aten::mm": 2}
        is torchtitan's "every other matmul" rule.
    recomputed_units: units whose ops are always recomputed, whatever else would keep them.
    kept_calls: {op: [i, j, ...]}: keep exactly these calls of the op in each region, by 0-based
        index among the region's forward calls of it, counted as every_nth_op counts them (what a
        memory-budget plan produces: sac_plugin.plan). An op has one rule: kept_ops, every_nth_op
        or kept_calls.
    offloaded_ops, offloaded_units, offloaded_calls: the same selections as kept_ops, kept_units
        and kept_calls, for outputs that are held in pinned host memory between the forward and the
        backward instead of on the device: copied out on a side stream after the call, copied
        back when the region's recompute begins, served like kept outputs. The invariants are the
        kept ones. kept_calls and offloaded_calls may name one op with disjoint indices.
    offload_min_bytes: a call whose outputs take fewer bytes is kept on the device (a copy would
        cost more than it frees); 1 MiB by default.
    host_memory_limit: the most pinned host memory the offload pool may hold, in use and cached,
        when a call of this policy offloads (None: no limit); past it, once idle buffers are freed,
        the call is kept on the device (NOTE: [A bounded pinned pool]).
    pin_routing: under a policy that selects anything, the calls that route tokens (topk, sort,
        argsort and argmax indices, nonzero and unique) and device->host copies
        (.item(), .tolist(), .cpu()) are served from the forward, so the recompute routes as the
        forward did and never waits on the device (docs/semantics.md). False opts out.
    offload_inputs: the region's positional inputs that carry the activation (tensors that require
        grad and are not leaves), which torch's checkpoint holds for the recompute, are held in
        pinned host memory between the forward and the backward, with the offloaded outputs and
        within the same host_memory_limit (docs/offload.md). False by default. With nothing
        kept, this lowers full recompute's floor.

    Where outputs are on the CPU (no accelerator), offloading is keeping, said once per checkpoint site.
    Unknown ops, collectives, random and mutating ops raise ValueError here, at declaration.
    """

    __slots__ = (
        "_handle",
        "_policy_address",
        "_kept_ops",
        "_kept_units",
        "_spellings",
        "_every_nth",
        "_recomputed_units",
        "_kept_call_spellings",
        "_kept_calls",
        "_offloaded_spellings",
        "_offloaded_ops",
        "_offloaded_units",
        "_offloaded_call_spellings",
        "_offloaded_calls",
        "_offload_min_bytes",
        "_host_memory_limit",
        "_pin_routing",
        "_offload_inputs",
        "__weakref__",
    )

    def __init__(
        self,
        kept_ops: Iterable = (),
        kept_units: Iterable[str] = (),
        *,
        every_nth_op: Mapping | None = None,
        recomputed_units: Iterable[str] = (),
        kept_calls: Mapping | None = None,
        offloaded_ops: Iterable = (),
        offloaded_units: Iterable[str] = (),
        offloaded_calls: Mapping | None = None,
        offload_min_bytes: int = 1 << 20,
        host_memory_limit: int | None = None,
        pin_routing: bool = True,
        offload_inputs: bool = False,
    ):
        # Every argument is checked here, before C++ sees it, so that a bad one is reported by
        # name with what was given (C++ would report a torchbind conversion failure).
        spellings = [op_spelling(op, f"kept_ops[{i}]") for i, op in enumerate(_names(kept_ops, "kept_ops"))]
        units = _unit_names(kept_units, "kept_units")
        recomputed = _unit_names(recomputed_units, "recomputed_units")
        every_nth = _every_nth_rules(every_nth_op)
        calls = _call_rules(kept_calls)
        offloaded = [
            op_spelling(op, f"offloaded_ops[{i}]") for i, op in enumerate(_names(offloaded_ops, "offloaded_ops"))
        ]
        offloaded_unit_names = _unit_names(offloaded_units, "offloaded_units")
        offloaded_call_rules = _call_rules(offloaded_calls, "offloaded_calls")
        min_bytes = _byte_count(offload_min_bytes, "offload_min_bytes", allow_none=False)
        host_limit = _byte_count(host_memory_limit, "host_memory_limit", allow_none=True)
        if not isinstance(pin_routing, bool):
            raise TypeError(f"sac_plugin: pin_routing must be True or False, got {describe_value(pin_routing)}")
        if not isinstance(offload_inputs, bool):
            raise TypeError(f"sac_plugin: offload_inputs must be True or False, got {describe_value(offload_inputs)}")
        # Each field by name (NOTE: [A policy is built from named fields] in csrc/bindings/library.cpp).
        self._handle = torch.classes.sac.Policy(
            kept_ops=spellings,
            kept_units=units,
            every_nth_ops=every_nth,
            recomputed_units=recomputed,
            kept_calls={op: list(indices) for op, indices in calls.items()},
            offloaded_ops=offloaded,
            offloaded_units=offloaded_unit_names,
            offloaded_calls={op: list(indices) for op, indices in offloaded_call_rules.items()},
            offload_min_bytes=min_bytes,
            host_memory_limit=host_limit,
            pin_routing=pin_routing,
        )
        self._kept_call_spellings = calls
        self._kept_calls = _unflatten(self._handle.kept_calls())
        self._offloaded_spellings = tuple(offloaded)
        self._offloaded_call_spellings = offloaded_call_rules
        self._offloaded_calls = _unflatten(self._handle.offloaded_calls())
        self._offloaded_ops = frozenset(self._handle.offloaded_ops())
        self._offloaded_units = frozenset(self._handle.offloaded_units())
        self._offload_min_bytes = min_bytes
        self._host_memory_limit = host_memory_limit
        self._pin_routing = pin_routing
        self._offload_inputs = offload_inputs
        # What the scope C ABI creates regions from (checkpointing.Region); valid while _handle lives.
        self._policy_address = self._handle.policy_address()
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
    def kept_calls(self) -> dict[str, tuple[int, ...]]:
        """Kept-call rules by kept overload name ("aten::mm": (0, 2, 5)), indices ascending."""
        return dict(self._kept_calls)

    @property
    def offloaded_ops(self) -> frozenset[str]:
        """Every offloaded overload, named as kept_ops names them."""
        return self._offloaded_ops

    @property
    def offloaded_units(self) -> frozenset[str]:
        return self._offloaded_units

    @property
    def offloaded_calls(self) -> dict[str, tuple[int, ...]]:
        """Offloaded-call rules by overload name, as kept_calls."""
        return dict(self._offloaded_calls)

    @property
    def offload_min_bytes(self) -> int:
        return self._offload_min_bytes

    @property
    def host_memory_limit(self) -> int | None:
        return self._host_memory_limit

    @property
    def pin_routing(self) -> bool:
        """Whether routing calls and device->host copies are served from the forward."""
        return self._pin_routing

    @property
    def offload_inputs(self) -> bool:
        """Whether the region's activation inputs are offloaded between forward and backward."""
        return self._offload_inputs

    @property
    def offloads_nothing(self) -> bool:
        return not self._offloaded_ops and not self._offloaded_units and not self._offloaded_calls

    @property
    def keeps_nothing(self) -> bool:
        """Whether the policy holds no call's outputs, on the device or offloaded: full recompute."""
        return (
            not self._kept_ops
            and not self._kept_units
            and not self._every_nth
            and not self._kept_calls
            and self.offloads_nothing
        )

    def kept_overloads(self) -> list[torch._ops.OpOverload]:
        """The kept ops as OpOverload objects (what torch.compile's policy functions see)."""
        return [overload_of(name) for name in sorted(self._kept_ops)]

    def _identity(self):
        return (
            self._kept_ops,
            self._kept_units,
            tuple(sorted(self.every_nth_op.items())),
            self._recomputed_units,
            tuple(sorted(self._kept_calls.items())),
            self._offloaded_ops,
            self._offloaded_units,
            tuple(sorted(self._offloaded_calls.items())),
            self._offload_min_bytes,
            self._host_memory_limit,
            self._pin_routing,
            self._offload_inputs,
        )

    def __repr__(self) -> str:
        parts = [f"kept_ops={sorted(self._spellings)!r}", f"kept_units={sorted(self._kept_units)!r}"]
        if self._every_nth:
            parts.append(f"every_nth_op={self._every_nth!r}")
        if self._recomputed_units:
            parts.append(f"recomputed_units={sorted(self._recomputed_units)!r}")
        if self._kept_call_spellings:
            parts.append(f"kept_calls={ {op: list(v) for op, v in self._kept_call_spellings.items()}!r}")
        if self._offloaded_spellings:
            parts.append(f"offloaded_ops={sorted(self._offloaded_spellings)!r}")
        if self._offloaded_units:
            parts.append(f"offloaded_units={sorted(self._offloaded_units)!r}")
        if self._offloaded_call_spellings:
            parts.append(f"offloaded_calls={ {op: list(v) for op, v in self._offloaded_call_spellings.items()}!r}")
        if not self.offloads_nothing and self._offload_min_bytes != 1 << 20:
            parts.append(f"offload_min_bytes={self._offload_min_bytes}")
        if self._host_memory_limit is not None:
            parts.append(f"host_memory_limit={self._host_memory_limit}")
        if not self._pin_routing:
            parts.append("pin_routing=False")
        if self._offload_inputs:
            parts.append("offload_inputs=True")
        return f"Policy({', '.join(parts)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    # A policy is a value, immutable once made and holding nothing the runtime learns (that is a
    # checkpoint site's: NOTE: [What a site learns]): copies share it, pickles rebuild it from its names.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (
            _rebuild_policy,
            (
                self._spellings,
                tuple(sorted(self._kept_units)),
                self._every_nth,
                tuple(sorted(self._recomputed_units)),
                self._kept_call_spellings,
                {
                    "offloaded_ops": self._offloaded_spellings,
                    "offloaded_units": tuple(sorted(self._offloaded_units)),
                    "offloaded_calls": self._offloaded_call_spellings,
                    "offload_min_bytes": self._offload_min_bytes,
                    "host_memory_limit": self._host_memory_limit,
                    "pin_routing": self._pin_routing,
                    "offload_inputs": self._offload_inputs,
                },
            ),
        )


def _rebuild_policy(kept_ops, kept_units, every_nth_op, recomputed_units, kept_calls=None, offload=None):
    return Policy(
        kept_ops,
        kept_units,
        every_nth_op=every_nth_op,
        recomputed_units=recomputed_units,
        kept_calls=kept_calls,
        **(offload or {}),
    )


def overload_of(name: str) -> torch._ops.OpOverload:
    """torch.ops.aten.mm.out for "aten::mm.out", torch.ops.aten.mm.default for "aten::mm"."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")


def _unit_names(values, what: str) -> list[str]:
    return [check_unit_name(unit, f"{what}[{i}]") for i, unit in enumerate(_names(values, what, "['attn']"))]


def resolve_kept_ops(names: Iterable) -> frozenset[str]:
    """The names among `names` that name a registered op; the rest are skipped.

    Lets a model list every spelling of an op (say flash-attention v2 and v3) and keep the ones
    this installation has. Raises ValueError when none of them resolves.
    """
    spellings = [
        op_spelling(op, f"resolve_kept_ops: names[{i}]")
        for i, op in enumerate(_names(names, "resolve_kept_ops: names"))
    ]
    return frozenset(torch.ops.sac.resolvable_op_names(spellings))
