"""A memory-budget plan for one layer: which calls to keep, offload or recompute, chosen from a
measured profile.

    plan = sac_plugin.plan(layer, x, cos, sin, budget=0.3)   # 30% of its no-checkpointing bytes
    sac_plugin.apply_selective_checkpointing(layer, plan.policy)
    print(plan.table()); plan.plot("plan.png"); plan.save("plan.json")

The budget bounds the bytes the checkpointed layer holds between forward and backward, counted
as sac_plugin.memory and benchmarks/bench_memory.py count them: what full recompute holds anyway (the
layer's inputs: the floor) plus the outputs the plan keeps. A fraction is of the bytes the layer
holds without checkpointing; an int is bytes. The kept outputs are chosen by an exact 0/1
knapsack (knapsack.py) that maximises the kernel time the recompute skips.

The three-way model. With offload=True each call the recompute would run has three
outcomes, and the plan takes the least predicted step time within the budget:
  - keep: its output stays on the device (its bytes count against the budget), costs nothing;
  - offload: its output lives in pinned host memory between forward and backward (no device
    bytes; its bytes count against host_memory_limit), costs the copy time its windows do not
    hide: max(0, to_host - forward_window) + max(0, to_device - backward_window), where a copy
    takes bytes / the measured bandwidth of its direction;
  - recompute: no bytes, costs its kernel time.
The forward window of call i is the kernel time of the calls after it in the forward (its copy to
the host runs beside them). The backward window is the kernel time of the same calls again: the
region's backward runs roughly in reverse, so the gradients of the calls after i run before
call i's output is needed, and their forward kernel times stand in for their gradients' (which
usually take longer). The model does not see data flow (a recomputed call that reads the output
needs it sooner) nor the copy stream's queue (copies are costed one by one: several copies in one
window each count it whole). Where an offloaded call's outputs live (host, or the device under the
size floor offload_min_bytes or past host_memory_limit) is the runtime's rule, asked of the C++
library (offload_placement), never restated here.
Without a host cap a call not kept costs min(kernel time, exposed copy time), so the 0/1 knapsack
over device bytes with that cost as the value of keeping is exact. Where the host cap binds, one
table over device cells x host cells (knapsack.PairKnapsack) chooses keep, offload or recompute
together, exact on the grid of the sizes' gcd while the table is small (otherwise on a coarser
grid, never over either limit). Every answer is completed the same way: given its kept calls, the
offloads that save the most time within the host cap (a knapsack over host bytes), then any
offloaded call that still fits the budget is kept instead (no copies, no host bytes). The
candidates are the two-way plan's kept calls, the unbounded-host answer's and, where the cap binds,
the pair table's and the kept calls planned with offload open only to the calls the host took;
the cheapest wins. The two-way plan is a candidate and completing it only replaces recomputes by
cheaper copies, so a three-way plan never predicts a slower step than the two-way one.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..policy import Policy, bounded_repr, describe_value
from .. import _native, _rule
from . import _knapsack as knapsack
from . import _plan_file as plan_file
from ._profile import (
    WRITTEN_IN_THE_FORWARD,
    LayerProfile,
    ProfiledCall,
    accelerator_device,
    measure_offload_bandwidth,
    profile_layer,
)

FORMAT = "sac_plugin.plan"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
PARETO_BUDGETS = tuple(i / 20 for i in range(21))
OFFLOAD_MIN_BYTES = inspect.signature(Policy).parameters["offload_min_bytes"].default

log = logging.getLogger("sac_plugin")
_warned_offload_unavailable: set[str] = set()


INT64_MAX = 2**63 - 1


class Placement(enum.IntEnum):
    """Where an offloaded call's outputs live (values as in C++ sac::OffloadPlacement)."""

    HOST = 0
    DEVICE_BELOW_FLOOR = 1
    DEVICE_HOST_LIMIT = 2


def offload_placement(
    nbytes: int, reserved_host_bytes: int, offload_min_bytes: int, host_memory_limit: int | None
) -> Placement:
    """The runtime's rule (NOTE: [Where an offloaded call's outputs live] in
    csrc/policy/offload_rule.cpp): HOST when nbytes >= offload_min_bytes and reserved + nbytes fits
    within host_memory_limit (None: no cap). Byte counts are ints from 0 to 2**63 - 1."""
    limit = -1 if host_memory_limit is None else host_memory_limit
    # A sum of reservations past int64 is past every limit: clamped, it still is.
    reserved = min(reserved_host_bytes, INT64_MAX)
    return Placement(_native.lib.sac_offload_placement(nbytes, reserved, offload_min_bytes, limit))


class PlanError(ValueError):
    """A budget or a plan file that cannot be used; the message says what is wrong and what is right."""


# The plan file's fields (NOTE in planner/_plan_file.py): name, kind, first version.
_PLAN_FIELDS = (
    plan_file.Field("format", plan_file.TEXT),
    plan_file.Field("version", plan_file.COUNT),
    plan_file.Field("torch", plan_file.TEXT, required=False),
    plan_file.Field(
        "budget",
        plan_file.Kind(
            "a fraction (a float from 0.0 to 1.0) or a byte count (an int >= 0)",
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        ),
    ),
    plan_file.Field("no_checkpoint_bytes", plan_file.COUNT),
    plan_file.Field("full_recompute_bytes", plan_file.COUNT),
    plan_file.Field("rng_state_bytes", plan_file.COUNT, since=3),
    plan_file.Field("runs", plan_file.COUNT),
    plan_file.Field("calls", plan_file.LIST),
    plan_file.Field("kept", plan_file.LIST),
    plan_file.Field("offload", plan_file.OPTIONAL_OBJECT, since=2),
    plan_file.Field("offloaded", plan_file.LIST, since=2),
)
_CALL_FIELDS = (
    plan_file.Field("op", plan_file.TEXT),
    plan_file.Field("index", plan_file.COUNT),
    plan_file.Field("unit", plan_file.TEXT),
    plan_file.Field("bytes", plan_file.COUNT),
    plan_file.Field("seconds", plan_file.SECONDS),
    plan_file.Field("not_keepable", plan_file.TEXT),
    plan_file.Field("recomputed", plan_file.FLAG),
)
_OFFLOAD_FIELDS = (
    plan_file.Field("d2h_bytes_per_s", plan_file.RATE),
    plan_file.Field("h2d_bytes_per_s", plan_file.RATE),
    plan_file.Field("min_bytes", plan_file.COUNT),
    plan_file.Field("host_memory_limit", plan_file.OPTIONAL_COUNT),
)


def check_budget(budget, where: str = "budget"):
    """A fraction in [0, 1] (float) or a byte count >= 0 (int)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"sac_plugin: {where} must be a fraction of the layer's no-checkpointing activation bytes "
            f"(a float from 0.0 to 1.0) or a byte count (an int >= 0), got {describe_value(budget)}"
        )
    if isinstance(budget, float) and not (math.isfinite(budget) and 0.0 <= budget <= 1.0):
        raise PlanError(
            f"sac_plugin: {where} as a fraction must be from 0.0 to 1.0, got {budget!r}; pass an int for a byte count"
        )
    if isinstance(budget, int) and budget < 0:
        raise PlanError(f"sac_plugin: {where} as a byte count must be >= 0, got {budget}")
    return budget


def _overload(op: str) -> str:
    """The single overload a profiled op name means: "aten::mm" -> "aten::mm.default"."""
    return op if "." in op.partition("::")[2] else op + ".default"


def _key(call: ProfiledCall) -> tuple[str, int]:
    return call.op, call.index


def _is_byte_count(value) -> bool:
    """An int from 0 to 2**63 - 1: the library counts bytes in int64."""
    return plan_file.COUNT.check(value)


def _is_rate(value) -> bool:
    return plan_file.RATE.check(value)


@dataclasses.dataclass(frozen=True)
class OffloadModel:
    """What offloading costs on the layer's device: the copy bandwidth each way (bytes per second,
    timed at plan time or given by the caller), the size under which a call is never offloaded,
    and the host memory the offloaded outputs may hold together (None: no cap)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    min_bytes: int = OFFLOAD_MIN_BYTES
    host_memory_limit: int | None = None

    def __post_init__(self):
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            if not _is_rate(getattr(self, name)):
                raise ValueError(
                    f"sac_plugin: OffloadModel.{name} must be a finite number of bytes per second > 0, "
                    f"got {bounded_repr(getattr(self, name))}"
                )
        if not _is_byte_count(self.min_bytes):
            raise ValueError(
                f"sac_plugin: OffloadModel.min_bytes must be an int from 0 to 2**63 - 1 (bytes), got "
                f"{bounded_repr(self.min_bytes)}"
            )
        if self.host_memory_limit is not None and not _is_byte_count(self.host_memory_limit):
            raise ValueError(
                f"sac_plugin: OffloadModel.host_memory_limit must be None (no cap) or an int from 0 to "
                f"2**63 - 1 (bytes), got {bounded_repr(self.host_memory_limit)}"
            )

    def why_not_offloadable(self, call: ProfiledCall) -> str:
        """ "" when a plan may offload the call."""
        if not call.keepable:
            return call.why_not_keepable
        # A call that holds no new bytes has nothing to move off the device.
        if call.bytes == 0 or offload_placement(call.bytes, 0, self.min_bytes, None) == Placement.DEVICE_BELOW_FLOOR:
            return f"under {self.min_bytes} bytes"
        return ""


@dataclasses.dataclass(frozen=True)
class CopyCost:
    """One call's two copies and the compute each can hide behind, in seconds (the three-way
    model, in this module's docstring)."""

    to_host: float
    to_device: float
    forward_window: float
    backward_window: float

    @property
    def exposed(self) -> float:
        """The copy time the windows do not hide: what offloading the call adds to a step."""
        return max(0.0, self.to_host - self.forward_window) + max(0.0, self.to_device - self.backward_window)

    @property
    def hides(self) -> bool:
        return self.exposed == 0.0


def copy_windows(profile: LayerProfile) -> list[float]:
    """Per call, the kernel time of the calls after it in the forward: the window its copy to the
    host hides in, and (the backward meeting those calls first) the one its copy back hides in."""
    windows, after = [0.0] * len(profile.calls), 0.0
    for i in range(len(profile.calls) - 1, -1, -1):
        windows[i] = after
        after += profile.calls[i].seconds
    return windows


def copy_costs(profile: LayerProfile, offload: OffloadModel) -> dict[tuple[str, int], CopyCost]:
    """The copies of every call a plan may offload, by (op, index)."""
    windows = copy_windows(profile)
    return {
        _key(c): CopyCost(c.bytes / offload.d2h_bytes_per_s, c.bytes / offload.h2d_bytes_per_s, window, window)
        for c, window in zip(profile.calls, windows)
        if not offload.why_not_offloadable(c)
    }


def _overhead(profile: LayerProfile, kept, offloaded, copies) -> float:
    """The time a plan adds to a step: kernel time of the calls it recomputes plus the copy time of
    the calls it offloads that no window hides. Summed in the forward's order, term by term, so
    that a plan that replaces recomputes by cheaper copies never sums to more."""
    total = 0.0
    for c in profile.calls:
        key = _key(c)
        if c.recomputed and key not in kept:
            total += copies[key].exposed if key in offloaded else c.seconds
    return total


_ROUTING_PROBE: list = []  # a policy that selects something: the rule then pins routing calls
_ROUTING_BY_PROFILE: dict = {}


def _routing_calls(profile: LayerProfile) -> frozenset[tuple[str, int]]:
    """The profiled calls the one rule keeps under any selective policy because they route tokens,
    asked of it call by call (a profile of made-up ops, as property tests build, has none)."""
    cached = _ROUTING_BY_PROFILE.get(id(profile))
    if cached is not None and cached[0] is profile:
        return cached[1]
    if not _ROUTING_PROBE:
        _ROUTING_PROBE.append(Policy(kept_ops=["aten::mm"]))
    found = set()
    for call in profile.calls:
        try:
            decision = _rule.decide_call(_ROUTING_PROBE[0], call.op, (call.unit,) if call.unit else (), 0)
        except (ValueError, RuntimeError):
            continue  # not a registered op
        if decision.reason == _rule.Reason.ROUTES_TOKENS:
            found.add(_key(call))
    _ROUTING_BY_PROFILE.clear()  # one profile at a time is planned; keep only its answer
    _ROUTING_BY_PROFILE[id(profile)] = (profile, frozenset(found))
    return frozenset(found)


def _calls_by_op(keys) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {}
    for op, index in sorted(keys):
        calls.setdefault(_overload(op), []).append(index)
    return calls


class _Solver:
    """Every budget's choice for one profile and offload model: the knapsack tables are built once
    and answer every budget (a Pareto curve costs one build)."""

    def __init__(self, profile: LayerProfile, offload: OffloadModel | None, two_way: knapsack.Knapsack | None = None):
        self.profile = profile
        self.offload = offload
        self.items = [c for c in profile.calls if c.keepable and c.bytes > 0]
        capacity = max(0, profile.no_checkpoint_bytes - profile.full_recompute_bytes)
        self.max_capacity = min(capacity, sum(c.bytes for c in self.items))
        self.free = frozenset(_key(c) for c in profile.calls if c.keepable and c.bytes == 0 and c.seconds > 0)
        weights = [c.bytes for c in self.items]
        self.two_way = two_way or knapsack.Knapsack(weights, [c.seconds for c in self.items], self.max_capacity)
        self.copies = copy_costs(profile, offload) if offload is not None else {}
        if offload is not None:
            self.three_way = knapsack.Knapsack(weights, [self._dropped_cost(c) for c in self.items], self.max_capacity)
        self._without_offload = None
        self._pair = None

    def _dropped_cost(self, call: ProfiledCall) -> float:
        """What the call costs when not kept: the cheaper of its recompute and its exposed copies."""
        copy = self.copies.get(_key(call))
        return call.seconds if copy is None else min(call.seconds, copy.exposed)

    def without_offload(self) -> _Solver:
        if self.offload is None:
            return self
        if self._without_offload is None:
            self._without_offload = _Solver(self.profile, None, self.two_way)
        return self._without_offload

    def capacity(self, budget) -> int:
        """Bytes the kept outputs may take: the budget minus the floor and the calls that route
        tokens (held whenever anything is kept), at most what there is to keep."""
        routing = sum(c.bytes for c in self.profile.calls if _key(c) in _routing_calls(self.profile))
        return min(
            budget_in_bytes(budget, self.profile) - self.profile.full_recompute_bytes - routing, self.max_capacity
        )

    def _kept(self, table: knapsack.Knapsack, capacity: int) -> frozenset[tuple[str, int]]:
        """Free calls (keepable, no new bytes) always; the rest by the knapsack within the capacity.
        A capacity under 0 (a budget under the floor) keeps only free calls."""
        kept = set(self.free)
        if capacity > 0:
            if capacity >= sum(table.weights):
                return frozenset(kept | {_key(c) for c in self.items})
            kept |= {_key(self.items[i]) for i in table.solve(capacity)}
        return frozenset(kept)

    def choose(self, budget) -> tuple[frozenset, frozenset]:
        """(kept, offloaded) for the budget: the least predicted step time (the three-way model)."""
        capacity = self.capacity(budget)
        two_way = self._kept(self.two_way, capacity)
        if self.offload is None:
            return two_way, frozenset()
        unbounded_host = self._kept(self.three_way, capacity)
        options = [self._complete(two_way, capacity), self._complete(unbounded_host, capacity)]
        if self._host_binds(unbounded_host):
            device, _ = self._pair_table().solve(max(0, capacity))
            options.append(self._complete(self.free | {_key(self.items[i]) for i in device}, capacity))
            allowed = options[1][1]
            values = [self._dropped_cost(c) if _key(c) in allowed else c.seconds for c in self.items]
            restricted = knapsack.Knapsack([c.bytes for c in self.items], values, max(0, capacity))
            options.append(self._complete(self._kept(restricted, capacity), capacity))
        return min(options, key=lambda o: (self.overhead(*o), self.host_bytes(o[1]), len(o[1]), sorted(o[1])))

    def _pair_table(self) -> knapsack.PairKnapsack:
        """Keep, offload or recompute as one knapsack over device and host bytes together."""
        if self._pair is None:
            host_values = [
                c.seconds - self.copies[_key(c)].exposed if _key(c) in self.copies else None for c in self.items
            ]
            self._pair = knapsack.PairKnapsack(
                [c.bytes for c in self.items],
                [c.seconds for c in self.items],
                host_values,
                self.max_capacity,
                self.offload.host_memory_limit,
            )
        return self._pair

    def overhead(self, kept, offloaded) -> float:
        return _overhead(self.profile, kept, offloaded, self.copies)

    def host_bytes(self, offloaded) -> int:
        return sum(c.bytes for c in self.items if _key(c) in offloaded)

    def _worth_offloading(self, kept) -> list[ProfiledCall]:
        """The calls not kept whose exposed copies cost less than their recompute."""
        return [
            c
            for c in self.items
            if _key(c) not in kept and _key(c) in self.copies and self.copies[_key(c)].exposed < c.seconds
        ]

    def _host_binds(self, kept) -> bool:
        limit = self.offload.host_memory_limit
        return limit is not None and sum(c.bytes for c in self._worth_offloading(kept)) > limit

    def _complete(self, kept, capacity: int) -> tuple[frozenset, frozenset]:
        """The offloads that save the most time beside `kept` within the host cap (a knapsack over
        host bytes where the cap binds); then every offloaded call that still fits in the budget is
        kept instead (no copies, no host memory), and the host room that frees is topped up."""
        candidates = self._worth_offloading(kept)
        limit = self.offload.host_memory_limit
        if limit is None or sum(c.bytes for c in candidates) <= limit:
            offloaded = candidates
        else:
            table = knapsack.Knapsack(
                [c.bytes for c in candidates], [c.seconds - self.copies[_key(c)].exposed for c in candidates], limit
            )
            offloaded = [candidates[i] for i in table.solve(limit)]
        kept = set(kept)
        room = capacity - sum(c.bytes for c in self.items if _key(c) in kept)
        position = {_key(c): i for i, c in enumerate(self.items)}
        for c in sorted(offloaded, key=lambda c: (-self.copies[_key(c)].exposed, -c.bytes, position[_key(c)])):
            if c.bytes <= room:
                kept.add(_key(c))
                room -= c.bytes
        offloaded = {_key(c) for c in offloaded} - kept
        if limit is not None:
            host_room = limit - self.host_bytes(offloaded)
            rest = sorted(
                (c for c in candidates if _key(c) not in kept and _key(c) not in offloaded),
                key=lambda c: (-(c.seconds - self.copies[_key(c)].exposed) / c.bytes, position[_key(c)]),
            )
            for c in rest:
                if c.bytes <= host_room:
                    offloaded.add(_key(c))
                    host_room -= c.bytes
        return frozenset(kept), frozenset(offloaded)


class Plan:
    """The calls one layer keeps (and, with an offload model, offloads) within a byte budget, and
    what that is predicted to cost."""

    def __init__(
        self,
        profile: LayerProfile,
        budget,
        kept: frozenset[tuple[str, int]],
        offloaded: frozenset[tuple[str, int]] = frozenset(),
        *,
        offload: OffloadModel | None = None,
        solver: _Solver | None = None,
    ):
        self.profile = profile
        self.budget = budget
        if kept or offloaded:
            # A policy that selects anything also serves the calls that route tokens (NOTE: [The
            # keep rule], docs/semantics.md): the plan's policy holds them, so the plan counts them.
            kept = frozenset(kept) | (_routing_calls(profile) - frozenset(offloaded))
        self.kept = frozenset(kept)
        self.offloaded = frozenset(offloaded)
        self.offload = offload
        self._solver_cache = solver
        self.copies = solver.copies if solver is not None else copy_costs(profile, offload) if offload else {}
        not_offloadable = sorted(self.offloaded - self.copies.keys())
        if not_offloadable:
            raise ValueError(
                f"sac_plugin: Plan: {not_offloadable[0]} cannot be offloaded: "
                + (
                    "there is no OffloadModel (offload=...)"
                    if offload is None
                    else "not a profiled call a plan may offload"
                )
            )
        by_key = {_key(c): c for c in profile.calls}
        self.kept_bytes = sum(by_key[k].bytes for k in self.kept)
        self.held_bytes = profile.full_recompute_bytes + self.kept_bytes
        self.offloaded_bytes = sum(by_key[k].bytes for k in self.offloaded)
        self.recompute_seconds = _overhead(profile, self.kept | self.offloaded, frozenset(), {})
        self.copy_seconds = sum(self.copies[k].exposed for k in sorted(self.offloaded))
        self.overhead_seconds = _overhead(profile, self.kept, self.offloaded, self.copies)
        self._policy = None

    @classmethod
    def from_profile(cls, profile: LayerProfile, budget=0.3, *, offload: OffloadModel | None = None) -> Plan:
        """The plan for `budget` from a profile (no measurement): keep or recompute each call, or
        with an OffloadModel keep, offload or recompute it (the three-way model in this module's
        docstring)."""
        if offload is not None and not isinstance(offload, OffloadModel):
            raise TypeError(
                f"sac_plugin: Plan.from_profile: offload must be None or an OffloadModel, got {describe_value(offload)}"
            )
        solver = _Solver(profile, offload)
        return cls(profile, check_budget(budget), *solver.choose(budget), offload=offload, solver=solver)

    # --- what it is -------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """Policy(kept_calls=...), with offloaded_calls, offload_min_bytes and host_memory_limit
        when the plan has an offload model."""
        if self._policy is None:
            if self.offload is None:
                self._policy = Policy(kept_calls=_calls_by_op(self.kept))
            else:
                self._policy = Policy(
                    kept_calls=_calls_by_op(self.kept),
                    offloaded_calls=_calls_by_op(self.offloaded),
                    offload_min_bytes=self.offload.min_bytes,
                    host_memory_limit=self.offload.host_memory_limit,
                )
        return self._policy

    @property
    def budget_bytes(self) -> int:
        return budget_in_bytes(self.budget, self.profile)

    @property
    def full_recompute_seconds(self) -> float:
        """Kernel time of the calls a recompute that keeps nothing runs."""
        return sum(c.seconds for c in self.profile.calls if c.recomputed)

    def outcome(self, call: ProfiledCall) -> str:
        """ "keep", "offload" or "recompute" for a call the recompute runs, "-" for one it never runs."""
        key = _key(call)
        if key in self.kept:
            return "keep"
        if key in self.offloaded:
            return "offload"
        return "recompute" if call.recomputed else "-"

    def __repr__(self) -> str:
        mib = 2**20
        offloads = ""
        if self.offload is not None:
            offloads = (
                f", offloads {len(self.offloaded)} ({self.offloaded_bytes / mib:.2f} MiB on the host, "
                f"copies {self.copy_seconds * 1e3:.3f} ms exposed)"
            )
        return (
            f"Plan(budget={self.budget!r}: {self.budget_bytes / mib:.2f} MiB, keeps {len(self.kept)} of "
            f"{len(self.profile.calls)} calls{offloads}, holds {self.held_bytes / mib:.2f} MiB of "
            f"{self.profile.no_checkpoint_bytes / mib:.2f}, recompute {self.recompute_seconds * 1e3:.3f} ms of "
            f"{self.full_recompute_seconds * 1e3:.3f})"
        )

    def rows(self) -> list[dict]:
        """Per op and unit: calls, bytes, time, and how many of them are kept and offloaded."""
        groups: dict[tuple[str, str], dict] = {}
        for c in self.profile.calls:
            row = groups.setdefault(
                (c.op, c.unit),
                {
                    "op": c.op,
                    "unit": c.unit,
                    "calls": 0,
                    "kept": 0,
                    "offloaded": 0,
                    "bytes": 0,
                    "kept_bytes": 0,
                    "seconds": 0.0,
                    "saved_seconds": 0.0,
                    "not_keepable": c.why_not_keepable,
                },
            )
            kept = _key(c) in self.kept
            row["calls"] += 1
            row["bytes"] += c.bytes
            row["seconds"] += c.seconds
            row["kept"] += kept
            row["offloaded"] += _key(c) in self.offloaded
            row["kept_bytes"] += c.bytes if kept else 0
            row["saved_seconds"] += c.seconds if kept else 0.0
        return sorted(groups.values(), key=lambda r: (-r["seconds"], r["op"], r["unit"]))

    def call_rows(self) -> list[dict]:
        """Per call the recompute would run with new bytes, in the forward's order: its outcome and,
        where it may be offloaded, its predicted copies and whether the windows hide them."""
        rows = []
        for c in self.profile.calls:
            if not (c.keepable and c.bytes > 0):
                continue
            why = self.offload.why_not_offloadable(c) if self.offload is not None else "no offload model"
            rows.append(
                {
                    "op": c.op,
                    "index": c.index,
                    "unit": c.unit,
                    "bytes": c.bytes,
                    "seconds": c.seconds,
                    "outcome": self.outcome(c),
                    "copy": self.copies.get(_key(c)),
                    "not_offloadable": why,
                }
            )
        return rows

    def table(self) -> str:
        mib = 2**20
        lines = [
            repr(self),
            f"{'op':<48}{'unit':<14}{'calls':>6}{'kept':>6}{'MiB':>9}{'kept MiB':>10}"
            f"{'ms':>9}{'saved ms':>10}  not keepable",
        ]
        for r in self.rows():
            lines.append(
                f"{r['op']:<48}{r['unit'] or '-':<14}{r['calls']:>6}{r['kept']:>6}{r['bytes'] / mib:>9.3f}"
                f"{r['kept_bytes'] / mib:>10.3f}{r['seconds'] * 1e3:>9.3f}{r['saved_seconds'] * 1e3:>10.3f}"
                f"  {r['not_keepable']}"
            )
        if self.offload is None:
            return "\n".join(lines)
        lines += [
            "",
            f"per call (copies: {self.offload.d2h_bytes_per_s / 1e9:.3f} GB/s to the host, "
            f"{self.offload.h2d_bytes_per_s / 1e9:.3f} GB/s back; each hides behind the kernel time of the "
            "calls after it)",
            f"{'call':<48}{'unit':<14}{'MiB':>9}{'ms':>9}  {'outcome':<10}{'d2h ms':>9}{'h2d ms':>9}"
            f"{'window ms':>11}{'exposed ms':>12}  hides",
        ]
        for r in self.call_rows():
            copy = r["copy"]
            if copy is None:
                copies = f"{'-':>9}{'-':>9}{'-':>11}{'-':>12}  - ({r['not_offloadable']})"
            else:
                copies = (
                    f"{copy.to_host * 1e3:>9.3f}{copy.to_device * 1e3:>9.3f}{copy.forward_window * 1e3:>11.3f}"
                    f"{copy.exposed * 1e3:>12.3f}  {'yes' if copy.hides else 'no'}"
                )
            lines.append(
                f"{r['op'] + ' #' + str(r['index']):<47} {r['unit'] or '-':<14}{r['bytes'] / mib:>9.3f}"
                f"{r['seconds'] * 1e3:>9.3f}  {r['outcome']:<10}{copies}"
            )
        return "\n".join(lines)

    # --- other budgets ------------------------------------------------------------------------------

    def pareto(self, budgets=PARETO_BUDGETS) -> list[dict]:
        """For each budget (fractions from 0 to 1 by default): the plan's predicted held bytes,
        recompute time and overhead (recompute plus exposed copies). With an offload model, also
        what it offloads and the two-way plan's held bytes and overhead at the same budget. One
        knapsack table answers them all."""
        points = []
        for budget in budgets:
            plan = self.with_budget(check_budget(budget, "pareto: budget"))
            point = {
                "budget": budget,
                "budget_bytes": plan.budget_bytes,
                "held_bytes": plan.held_bytes,
                "kept_bytes": plan.kept_bytes,
                "kept_calls": len(plan.kept),
                "recompute_seconds": plan.recompute_seconds,
                "overhead_seconds": plan.overhead_seconds,
            }
            if self.offload is not None:
                two_way = plan.without_offload()
                point.update(
                    {
                        "offloaded_calls": len(plan.offloaded),
                        "offloaded_bytes": plan.offloaded_bytes,
                        "copy_seconds": plan.copy_seconds,
                        "two_way_held_bytes": two_way.held_bytes,
                        "two_way_overhead_seconds": two_way.overhead_seconds,
                    }
                )
            points.append(point)
        return points

    def with_budget(self, budget) -> Plan:
        """The same profile (and offload model) planned for another budget (no new measurement)."""
        check_budget(budget)
        solver = self._solver()
        return Plan(self.profile, budget, *solver.choose(budget), offload=self.offload, solver=solver)

    def without_offload(self) -> Plan:
        """The two-way plan (keep or recompute) for the same profile and budget."""
        solver = self._solver().without_offload()
        return Plan(self.profile, self.budget, *solver.choose(self.budget), solver=solver)

    def _solver(self) -> _Solver:
        if self._solver_cache is None:
            self._solver_cache = _Solver(self.profile, self.offload)
        return self._solver_cache

    def evaluate(self, policy: Policy) -> dict:
        """What a hand-written policy is predicted to hold and recompute on this profile: kept and
        offloaded ops, every-nth rules, calls and units (by each call's innermost unit). With an
        offload model, also its overhead: recompute plus the copies no window hides."""
        if not isinstance(policy, Policy):
            raise TypeError(
                f"sac_plugin: Plan.evaluate: policy must be a sac_plugin.Policy, got {describe_value(policy)}"
            )
        kept, offloaded = _held_by(policy, self.profile)
        kept_bytes = sum(c.bytes for c in self.profile.calls if _key(c) in kept)
        result = {
            "held_bytes": self.profile.full_recompute_bytes + kept_bytes,
            "kept_bytes": kept_bytes,
            "offloaded_bytes": sum(c.bytes for c in self.profile.calls if _key(c) in offloaded),
            "recompute_seconds": _overhead(self.profile, kept | offloaded, frozenset(), {}),
        }
        if self.offload is not None:
            # A policy may offload a call under the plan's size floor: price every call's copies.
            copies = copy_costs(self.profile, dataclasses.replace(self.offload, min_bytes=0))
            result["overhead_seconds"] = _overhead(self.profile, kept, offloaded, copies)
        return result

    def calls_kept_by(self, policy: Policy) -> frozenset[tuple[str, int]]:
        """The profiled calls, as (op, index among the op's calls), that `policy` keeps on the
        device: each asked of the one rule (docs/semantics.md) with its op, index and innermost
        unit; an offloaded call under the policy's offload_min_bytes, or past its host_memory_limit,
        stays on the device as the runtime keeps it (docs/offload.md). These are the forward's
        decisions: a call the forward writes later is among them, although the runtime demotes it
        at the write and evaluate() counts it as recomputed, holding nothing."""
        if not isinstance(policy, Policy):
            raise TypeError(
                f"sac_plugin: Plan.calls_kept_by: policy must be a sac_plugin.Policy, got {describe_value(policy)}"
            )
        return _held_by(policy, self.profile, decided=True)[0]

    def calls_offloaded_by(self, policy: Policy) -> frozenset[tuple[str, int]]:
        """The profiled calls `policy` offloads to host memory, as calls_kept_by counts them."""
        if not isinstance(policy, Policy):
            raise TypeError(
                f"sac_plugin: Plan.calls_offloaded_by: policy must be a sac_plugin.Policy, got {describe_value(policy)}"
            )
        return _held_by(policy, self.profile)[1]

    # --- plot ------------------------------------------------------------------------------------

    def plot(self, path, policies: Mapping[str, Policy] | None = None, *, title: str | None = None) -> Path:
        """A PNG of the Pareto curve (held bytes against the time the plan adds to a step), this
        plan and the hand-written `policies` (default: sac_plugin.planner.reference_policies())
        marked. With an offload model the three-way curve is drawn beside the two-way one."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "sac_plugin: Plan.plot needs matplotlib, which is not installed; install the extra: "
                "pip install 'sac_plugin[plot]' (or pip install matplotlib)"
            ) from None
        path = _path_of(path, "plot")
        from ._reference import reference_policies

        policies = reference_policies() if policies is None else policies
        base = self.profile.no_checkpoint_bytes or 1
        points = self.pareto()
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        if self.offload is None:
            ax.step(
                [p["held_bytes"] / base for p in points],
                [p["recompute_seconds"] * 1e3 for p in points],
                where="post",
                marker=".",
                label="plan (Pareto curve)",
            )
        else:
            ax.step(
                [p["two_way_held_bytes"] / base for p in points],
                [p["two_way_overhead_seconds"] * 1e3 for p in points],
                where="post",
                marker=".",
                label="keep or recompute",
            )
            ax.step(
                [p["held_bytes"] / base for p in points],
                [p["overhead_seconds"] * 1e3 for p in points],
                where="post",
                marker=".",
                color="C9",
                label="keep, offload or recompute",
            )
        # Policies can land on one point (the units policy of a layer that opens no units keeps
        # what "attention kept" keeps): each gets its own hollow marker, the first ones largest and
        # drawn on top, so a marker under another still shows as a ring around it.
        markers = ["o", "s", "D", "^", "v", "P", "X", "*"]
        count = len(policies)
        for i, (name, policy) in enumerate(policies.items()):
            e = self.evaluate(policy)
            seconds = e.get("overhead_seconds", e["recompute_seconds"])
            ax.scatter(
                [e["held_bytes"] / base],
                [seconds * 1e3],
                marker=markers[i % len(markers)],
                s=40 + 45 * (count - i),
                facecolors="none",
                edgecolors=f"C{i + 1}",
                linewidths=1.6,
                zorder=3 + count - i,
                label=name,
            )
        ax.scatter(
            [self.held_bytes / base],
            [self.overhead_seconds * 1e3],
            marker="x",
            s=70,
            color="black",
            zorder=4 + count,
            label=f"this plan (budget {self.budget})",
        )
        ax.set_xlabel("activation bytes held / no checkpointing")
        ax.set_ylabel("recompute kernel time (ms)" if self.offload is None else "recompute + exposed copy time (ms)")
        ax.set_title(title or "sac_plugin memory-budget plan")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def curve(self) -> str:
        """The Pareto curve as text, for terminals; with an offload model, the two-way curve's
        overhead beside the three-way one's."""
        base = self.profile.no_checkpoint_bytes or 1
        header = f"{'budget':>7}{'held MiB':>10}{'held/none':>10}{'kept calls':>11}{'recompute ms':>14}"
        if self.offload is not None:
            header += f"{'offloaded':>10}{'host MiB':>10}{'copy ms':>9}{'total ms':>10}{'2-way ms':>10}"
        lines = [header]
        for p in self.pareto():
            line = (
                f"{p['budget']:>7.2f}{p['held_bytes'] / 2**20:>10.3f}{p['held_bytes'] / base:>10.3f}"
                f"{p['kept_calls']:>11}{p['recompute_seconds'] * 1e3:>14.3f}"
            )
            if self.offload is not None:
                line += (
                    f"{p['offloaded_calls']:>10}{p['offloaded_bytes'] / 2**20:>10.3f}"
                    f"{p['copy_seconds'] * 1e3:>9.3f}{p['overhead_seconds'] * 1e3:>10.3f}"
                    f"{p['two_way_overhead_seconds'] * 1e3:>10.3f}"
                )
            lines.append(line)
        return "\n".join(lines)

    # --- files -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        p = self.profile
        offload = None if self.offload is None else dataclasses.asdict(self.offload)
        return {
            "format": FORMAT,
            "version": VERSION,
            "torch": torch.__version__.split("+")[0],
            "budget": self.budget,
            "no_checkpoint_bytes": p.no_checkpoint_bytes,
            "full_recompute_bytes": p.full_recompute_bytes,
            "rng_state_bytes": p.rng_state_bytes,
            "runs": p.runs,
            "calls": [
                {
                    "op": c.op,
                    "index": c.index,
                    "unit": c.unit,
                    "bytes": c.bytes,
                    "seconds": c.seconds,
                    "not_keepable": c.why_not_keepable,
                    "recomputed": c.recomputed,
                }
                for c in p.calls
            ],
            "kept": [[op, index] for op, index in sorted(self.kept)],
            "offload": offload,
            "offloaded": [[op, index] for op, index in sorted(self.offloaded)],
        }

    def save(self, path) -> Path:
        return write_plan_file(_path_of(path, "save"), self.to_dict())

    @classmethod
    def load(cls, path) -> Plan:
        path = _path_of(path, "load")
        return cls.from_dict(read_plan_file(path, "plan file"), where=f"plan file {path}")

    @classmethod
    def from_dict(cls, data, where: str = "plan") -> Plan:
        """A plan from to_dict's form: this version, version 2 (without "rng_state_bytes": its
        floor does not count the checkpoint's RNG state) or version 1 (keep or recompute only,
        without "offload" and "offloaded"). Every field is checked against its declaration
        (_PLAN_FIELDS, _CALL_FIELDS, _OFFLOAD_FIELDS); anything wrong is a PlanError naming it."""
        try:
            return cls._from_checked_dict(data)
        except plan_file.FileError as error:
            raise PlanError(f"sac_plugin: {where}: {error}") from None

    @classmethod
    def _from_checked_dict(cls, data) -> Plan:
        fail = plan_file.FileError
        if not isinstance(data, Mapping):
            raise fail(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise fail(f"'format' must be {FORMAT!r}, got {bounded_repr(data.get('format'))}: not a sac_plugin plan")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
            raise fail(
                f"version {bounded_repr(version)} is not supported; this sac_plugin reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        fields = plan_file.check_object(data, _PLAN_FIELDS, "", version)
        try:
            budget = check_budget(fields["budget"], "budget")
        except (TypeError, ValueError) as error:
            raise fail(str(error).removeprefix("sac_plugin: ")) from None
        calls = []
        for i, call in enumerate(fields["calls"]):
            c = plan_file.check_object(call, _CALL_FIELDS, f"calls[{i}]", version)
            calls.append(
                ProfiledCall(
                    c["op"], c["index"], c["unit"], c["bytes"], float(c["seconds"]), c["not_keepable"], c["recomputed"]
                )
            )
        by_key = {_key(c): c for c in calls}
        if len(by_key) != len(calls):
            raise fail("calls lists one (op, index) twice")

        def call_keys(name: str) -> set[tuple[str, int]]:
            keys = set()
            for i, pair in enumerate(plan_file.check_list(fields[name], plan_file.CALL_KEY, name)):
                call = by_key.get(tuple(pair))
                if call is None:
                    raise fail(f"{name}[{i}] = {bounded_repr(pair)} is not a profiled call")
                if not call.keepable:
                    raise fail(f"{name}[{i}] = {bounded_repr(pair)} cannot be {name}: {call.why_not_keepable}")
                keys.add(tuple(pair))
            return keys

        kept = call_keys("kept")
        offload, offloaded = None, set()
        if version >= 2:
            if fields["offload"] is not None:
                model = plan_file.check_object(fields["offload"], _OFFLOAD_FIELDS, "offload", version)
                offload = OffloadModel(
                    float(model["d2h_bytes_per_s"]),
                    float(model["h2d_bytes_per_s"]),
                    model["min_bytes"],
                    model["host_memory_limit"],
                )
            offloaded = call_keys("offloaded")
            if offloaded and offload is None:
                raise fail("'offloaded' lists calls but 'offload' is null: an offloaded call needs the offload model")
            for pair in sorted(offloaded):
                if pair in kept:
                    raise fail(f"{list(pair)!r} is both kept and offloaded")
                why = offload.why_not_offloadable(by_key[pair])
                if why:
                    raise fail(f"offloaded {list(pair)!r} cannot be offloaded: {why}")
        rng_state = fields.get("rng_state_bytes", 0)
        if rng_state > fields["full_recompute_bytes"]:
            raise fail(
                f"rng_state_bytes ({rng_state}) is part of full_recompute_bytes "
                f"({fields['full_recompute_bytes']}), so it cannot be larger"
            )
        profile = LayerProfile(
            tuple(calls), fields["no_checkpoint_bytes"], fields["full_recompute_bytes"], fields["runs"], rng_state
        )
        result = cls(profile, budget, frozenset(kept), frozenset(offloaded), offload=offload)
        if result.held_bytes > result.budget_bytes and result.kept:
            raise fail(
                f"it keeps {result.kept_bytes} bytes, so it holds {result.held_bytes}, over its budget of "
                f"{result.budget_bytes} bytes"
            )
        if (
            offload is not None
            and offload.host_memory_limit is not None
            and result.offloaded_bytes > offload.host_memory_limit
        ):
            raise fail(
                f"it offloads {result.offloaded_bytes} bytes, over its host_memory_limit of "
                f"{offload.host_memory_limit} bytes"
            )
        try:
            result.policy
        except ValueError as error:  # an op this torch does not have
            raise fail(f"its calls do not make a policy here: {error}") from None
        return result


def budget_in_bytes(budget, profile: LayerProfile) -> int:
    if isinstance(budget, float):
        return int(budget * profile.no_checkpoint_bytes)
    return int(budget)


def _held_by(policy: Policy, profile: LayerProfile, decided: bool = False) -> tuple[frozenset, frozenset]:
    """The profiled calls `policy` keeps on the device and offloads: the one C++ rule
    (docs/semantics.md), asked call by call in the order the forward made them, through the call
    decider that also numbers the calls for every-nth and kept-call rules exactly as the engines do
    (a call in a recomputed unit takes no number). Each call is asked with the innermost unit it
    ran in. An offloaded call under offload_min_bytes, or one that would take the host past
    host_memory_limit, stays on the device, as the runtime keeps it. With `decided`, the calls the
    forward decides to keep also include those it demotes when it writes them later."""
    decider = _rule.CallDecider(policy)
    kept, offloaded, host_bytes = set(), set(), 0
    limit = policy.host_memory_limit
    for call in profile.calls:
        units = (call.unit,) if call.unit else ()
        decision = decider.decide(_overload(call.op), False, units)
        # A call after the recompute stops is decided as held but not held (NOTE: [Kept outputs
        # the recompute never reaches]): it holds no bytes and saves no time. A call the forward
        # writes later is decided held too, then demoted at the write (NOTE: [Kept outputs
        # written in the forward]): `decided` counts it, as a trace of the forward shows it.
        written = call.why_not_keepable == WRITTEN_IN_THE_FORWARD
        if not (decision.held and (call.keepable or (decided and written))):
            continue
        if written:
            kept.add(_key(call))
            continue
        if (
            decision.outcome == _rule.Outcome.OFFLOAD
            and offload_placement(call.bytes, host_bytes, policy.offload_min_bytes, limit) == Placement.HOST
        ):
            offloaded.add(_key(call))
            host_bytes += call.bytes
        else:
            kept.add(_key(call))
    return frozenset(kept), frozenset(offloaded)


def write_plan_file(path: Path, data: dict) -> Path:
    """Writes a plan's to_dict form as the JSON text read_plan_file reads; returns the path."""
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def read_plan_file(path: Path, what: str) -> dict:
    """The data of the plan file at `path` (`what`: "plan file", "step plan file", for messages),
    parsed and checked by _plan_file; anything unreadable or malformed is a PlanError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"sac_plugin: {what} {path}: cannot read it: {error}") from None
    try:
        return plan_file.parse(text)
    except plan_file.FileError as error:
        raise PlanError(f"sac_plugin: {what} {path}: {error}") from None


def _path_of(path, method: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"sac_plugin: Plan.{method} expects a path (str or os.PathLike), got {describe_value(path)}")
    return Path(path)


def _check_offload_arguments(offload, offload_bandwidth, host_memory_limit, offload_min_bytes) -> None:
    if not isinstance(offload, bool):
        raise TypeError(f"sac_plugin: plan: offload must be True or False, got {describe_value(offload)}")
    named = (
        ("offload_bandwidth", offload_bandwidth),
        ("host_memory_limit", host_memory_limit),
        ("offload_min_bytes", offload_min_bytes),
    )
    given = [name for name, value in named if value is not None]
    if given and not offload:
        raise ValueError(f"sac_plugin: plan: {', '.join(given)} only apply with offload=True")
    pair = isinstance(offload_bandwidth, (tuple, list)) and len(offload_bandwidth) == 2
    if offload_bandwidth is not None and not (pair and all(map(_is_rate, offload_bandwidth))):
        raise ValueError(
            "sac_plugin: plan: offload_bandwidth must be (device_to_host, host_to_device) bytes per "
            f"second, two finite numbers > 0, got {bounded_repr(offload_bandwidth)}"
        )
    if host_memory_limit is not None and not _is_byte_count(host_memory_limit):
        raise ValueError(
            "sac_plugin: plan: host_memory_limit must be None (no cap) or an int from 0 to 2**63 - 1 "
            f"(bytes), got {bounded_repr(host_memory_limit)}"
        )
    if offload_min_bytes is not None and not _is_byte_count(offload_min_bytes):
        raise ValueError(
            f"sac_plugin: plan: offload_min_bytes must be an int from 0 to 2**63 - 1 (bytes), got "
            f"{bounded_repr(offload_min_bytes)}"
        )


def _offload_model(
    module, args, kwargs, offload_bandwidth, host_memory_limit, offload_min_bytes
) -> OffloadModel | None:
    """The offload model for a plan with offload=True: the given bandwidths, else the ones timed
    on the layer's accelerator; None (with one logged warning per reason) where there is neither."""
    if offload_bandwidth is None:
        device = accelerator_device(module, args, kwargs)
        if device is None:
            if not torch.accelerator.is_available():
                reason = "no accelerator is available"
            else:
                reason = f"the layer's parameters and inputs are not on the {torch.accelerator.current_accelerator()}"
            if reason not in _warned_offload_unavailable:
                _warned_offload_unavailable.add(reason)
                log.warning(
                    "sac_plugin: plan: offload=True, but %s and no offload_bandwidth was given: the plan "
                    "keeps or recomputes each call (pass offload_bandwidth=(device_to_host, host_to_device) "
                    "bytes per second to plan offload for another machine)",
                    reason,
                )
            return None
        offload_bandwidth = measure_offload_bandwidth(device)
        log.info(
            "sac_plugin: plan: copies between %s and pinned host memory: %.3f GB/s to the host, %.3f GB/s back",
            device,
            offload_bandwidth[0] / 1e9,
            offload_bandwidth[1] / 1e9,
        )
    return OffloadModel(
        float(offload_bandwidth[0]),
        float(offload_bandwidth[1]),
        OFFLOAD_MIN_BYTES if offload_min_bytes is None else offload_min_bytes,
        host_memory_limit,
    )


def plan(
    module: torch.nn.Module,
    *example_args,
    budget=0.3,
    runs: int = 5,
    warmup: int = 1,
    offload: bool = False,
    offload_bandwidth: tuple[float, float] | None = None,
    host_memory_limit: int | None = None,
    offload_min_bytes: int | None = None,
    **example_kwargs,
) -> Plan:
    """Profiles `module` on the example inputs (warm-up, then `runs` timed forwards and backwards;
    the RNG state, gradients and buffers are restored afterwards) and keeps, within `budget`, the
    calls that save the most recompute time. budget: a fraction of the bytes the module holds
    between forward and backward without checkpointing (float, 0.0 to 1.0), or bytes (int).

    offload=True plans three outcomes per call, keep, offload or recompute, for the least predicted
    step time (the three-way model, docs/memory-budget.md): the copy bandwidths are timed on the layer's
    accelerator, or given as offload_bandwidth=(device_to_host, host_to_device) bytes per second;
    host_memory_limit caps the host bytes offloaded (None: no cap); calls under offload_min_bytes
    (default: the Policy's, 1 MiB) are never offloaded. With neither an accelerator nor
    offload_bandwidth the plan is two-way, with one logged warning."""
    from ..checkpointing import check_checkpointable

    check_budget(budget)
    _check_offload_arguments(offload, offload_bandwidth, host_memory_limit, offload_min_bytes)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sac_plugin: plan: module must be a torch.nn.Module, got {describe_value(module)}")
    if "_sac_policy" in module.__dict__:
        raise ValueError(
            f"sac_plugin: plan: {type(module).__name__} is already checkpointed with "
            f"{module._sac_policy}; plan the module before apply_selective_checkpointing"
        )
    check_checkpointable(module, "plan: module")
    # A plan measures what autograd saves for backward: it profiles with grad enabled (and outside
    # inference mode) wherever it is called from, as a layer planned on its first call is.
    with torch.inference_mode(False), torch.enable_grad():
        profile = profile_layer(module, example_args, example_kwargs, runs=runs, warmup=warmup)
    model = None
    if offload:
        model = _offload_model(
            module, example_args, example_kwargs, offload_bandwidth, host_memory_limit, offload_min_bytes
        )
    return Plan.from_profile(profile, budget, offload=model)
