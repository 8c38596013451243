"""Policies: which ops keep their outputs for backward, and which recompute units are kept."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from . import _native
from ._validation import byte_count, call_rules, every_nth_rules, flag, op_names, overload_of, unit_names

__all__ = ["Policy", "resolve_kept_ops"]


def _unflatten(flat) -> dict[str, tuple[int, ...]]:
    ops, counts, indices = flat
    rules, start = {}, 0
    for op, count in zip(ops, counts):
        rules[op] = tuple(indices[start : start + count])
        start += count
    return rules


class Policy:
    """Which calls a checkpointed region keeps, offloads or recomputes.

    A policy is an immutable value: copies share it and pickles rebuild it from its names. Every
    argument is checked here, at declaration, so a bad one is reported by name with what was given.
    Where outputs are on the CPU (no accelerator), offloading is keeping, said once per checkpoint
    site.

    Args:
        kept_ops: Op overloads whose outputs are kept ("aten::mm" for every overload,
            "aten::mm.default", or torch.ops.aten.mm.default).
        kept_units: Names of recompute units (see `recompute_unit`; a torch_remat region is one)
            inside which every op is kept. Unit names in kept_units, recomputed_units and
            offloaded_units may be patterns: each '*' matches any run of characters, dots
            included, as torchtitan's region patterns ("*", "*routed_experts.w13.*"). A torch_remat
            region that no list names follows its own recompute= flag.
        every_nth_op: {op: n}: keep calls 1, n+1, 2n+1, ... of the op in each region;
            {"aten::mm": 2} is torchtitan's "every other matmul" rule.
        recomputed_units: Units whose ops are always recomputed, whatever else would keep them.
        kept_calls: {op: [i, j, ...]}: keep exactly these calls of the op in each region, by
            0-based index among the region's forward calls of it, counted as every_nth_op counts
            them (what a memory-budget plan produces: sac_plugin.plan). An op has one rule:
            kept_ops, every_nth_op or kept_calls.
        offloaded_ops: The selection kept_ops makes, for outputs held in pinned host memory
            between the forward and the backward instead of on the device: copied out on a side
            stream after the call, copied back when the region's recompute begins, served like
            kept outputs. The invariants are the kept ones.
        offloaded_units: The selection kept_units makes, offloaded as offloaded_ops.
        offloaded_calls: The selection kept_calls makes, offloaded as offloaded_ops. kept_calls
            and offloaded_calls may name one op with disjoint indices.
        offload_min_bytes: A call whose outputs take fewer bytes is kept on the device (a copy
            would cost more than it frees); 1 MiB by default.
        host_memory_limit: The most pinned host memory the offload pool may hold, in use and
            cached, when a call of this policy offloads (None: no limit); past it, once idle
            buffers are freed, the call is kept on the device (NOTE: [A bounded pinned pool]).
        pin_routing: Under a policy that selects anything, the calls that route tokens (topk,
            sort, argsort and argmax indices, nonzero and unique) and device->host copies
            (.item(), .tolist(), .cpu()) are served from the forward, so the recompute routes as
            the forward did and never waits on the device (docs/semantics.md). False opts out.
        offload_inputs: The region's positional inputs that carry the activation (tensors that
            require grad and are not leaves), which torch's checkpoint holds for the recompute,
            are held in pinned host memory between the forward and the backward, with the
            offloaded outputs and within the same host_memory_limit (docs/offload.md). False by
            default. With nothing kept, this lowers full recompute's floor.

    Raises:
        TypeError: An argument of the wrong type (a single name where a collection is expected,
            a non-int index, count or byte count, a non-bool flag).
        ValueError: An unknown op, a collective, random or mutating op, an op given two rules,
            an index, n or byte count out of range, or a name too long or not valid text.
    """

    __slots__ = (
        "_handle",
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
        # Each field's form is checked by its one check (NOTE: [One check per field] in
        # _validation.py), so that a bad value is reported by name with what was given; what the
        # names mean is checked by C++ as the policy is made.
        spellings = op_names(kept_ops, "kept_ops")
        every_nth = every_nth_rules(every_nth_op)
        calls = call_rules(kept_calls, "kept_calls")
        offloaded = op_names(offloaded_ops, "offloaded_ops")
        offloaded_call_rules = call_rules(offloaded_calls, "offloaded_calls")
        min_bytes = byte_count(offload_min_bytes, "offload_min_bytes", allow_none=False)
        host_limit = byte_count(host_memory_limit, "host_memory_limit", allow_none=True)
        # Each field by name (NOTE: [A policy is built from named fields] in csrc/bindings/python_policy.cpp).
        self._handle = _native.C.Policy(
            kept_ops=spellings,
            kept_units=unit_names(kept_units, "kept_units"),
            every_nth_op=every_nth,
            recomputed_units=unit_names(recomputed_units, "recomputed_units"),
            kept_calls={op: list(indices) for op, indices in calls.items()},
            offloaded_ops=offloaded,
            offloaded_units=unit_names(offloaded_units, "offloaded_units"),
            offloaded_calls={op: list(indices) for op, indices in offloaded_call_rules.items()},
            offload_min_bytes=min_bytes,
            host_memory_limit=-1 if host_limit is None else host_limit,
            pin_routing=flag(pin_routing, "pin_routing"),
            offload_inputs=flag(offload_inputs, "offload_inputs"),
        )
        self._kept_call_spellings = calls
        self._kept_calls = _unflatten(self._handle.kept_calls())
        self._offloaded_spellings = tuple(offloaded)
        self._offloaded_call_spellings = offloaded_call_rules
        self._offloaded_calls = _unflatten(self._handle.offloaded_calls())
        self._offloaded_ops = frozenset(self._handle.offloaded_ops())
        self._offloaded_units = frozenset(self._handle.offloaded_units())
        self._offload_min_bytes = min_bytes
        self._host_memory_limit = host_limit
        self._pin_routing = self._handle.pin_routing()
        self._offload_inputs = self._handle.offload_inputs()
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
        """The names and patterns of the units inside which every op is kept."""
        return self._kept_units

    @property
    def recomputed_units(self) -> frozenset[str]:
        """The names and patterns of the units whose ops are always recomputed."""
        return self._recomputed_units

    @property
    def every_nth_op(self) -> dict[str, int]:
        """Every-nth rules by kept overload name ("aten::mm": 2)."""
        ops, every = self._handle.every_nth_op()
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
        """The names and patterns of the units inside which every op is offloaded."""
        return self._offloaded_units

    @property
    def offloaded_calls(self) -> dict[str, tuple[int, ...]]:
        """Offloaded-call rules by overload name, as kept_calls."""
        return dict(self._offloaded_calls)

    @property
    def offload_min_bytes(self) -> int:
        """The bytes under which a call's outputs stay on the device rather than being offloaded."""
        return self._offload_min_bytes

    @property
    def host_memory_limit(self) -> int | None:
        """The most pinned host memory the offload pool may hold when a call of this policy
        offloads (None: no limit)."""
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
        """Whether the policy names no op, unit or call to offload."""
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
        """The kept ops as OpOverload objects (what torch.compile's policy functions see).

        Returns:
            One OpOverload per kept overload, sorted by name.
        """
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


def resolve_kept_ops(names: Iterable) -> frozenset[str]:
    """The names among `names` that name a registered op; the rest are skipped.

    Lets a model list every spelling of an op (say flash-attention v2 and v3) and keep the ones
    this installation has.

    Args:
        names: Op names ("aten::mm", "aten::mm.default") or ops (torch.ops.aten.mm.default).

    Returns:
        The resolvable ones, spelled as the plugin spells them ("aten::mm.default" for an
        overload, "aten::mm" for a packet), ready for `Policy(kept_ops=...)`.

    Raises:
        TypeError: A single name instead of a collection, or an entry that is neither a str nor
            an op.
        ValueError: None of the names resolves, or a name is too long or not valid text.
    """
    return frozenset(_native.C.resolvable_op_names(op_names(names, "resolve_kept_ops: names")))
