"""What a call costs a plan: the bytes it holds against the budget, the time its recompute takes,
and with offload, its copies to the host and back and the compute they hide behind.

The three-way model. With offload=True each call the recompute would run has three
outcomes, and the plan takes the least predicted step time within the budget:
  - keep: its output stays on the device (its bytes count against the budget), costs nothing;
  - offload: its output lives in pinned host memory between forward and backward (no device
    bytes; its bytes count against host_memory_limit), costs the time compute waits for its copy
    back (NOTE: [The copy queues]);
  - recompute: no bytes, costs its kernel time.
A plan's predicted overhead is its recompute kernel time plus the exposed copy time of all its
offloads together, timed on the two copy queues (exposed_copy_seconds). A call's CopyCost is what
its copies would expose were it the only call offloaded: a lower bound on what it adds, which the
solver's knapsack uses to propose offloads, and the queues then price and prune (prune_offloads).
Where an offloaded call's outputs live (host, or the device under the size floor
offload_min_bytes or past host_memory_limit) is the runtime's rule, asked of the C++ library
(offload_placement), never restated here.

NOTE: [The copy queues]
The runtime (NOTE: [Offloading kept outputs] in csrc/dispatch/offload.cpp) copies an offloaded
output to the host on one copy-out stream right after its kernel, and back on one copy-in stream
when the region's recompute begins, all of the region's outputs at once, each after its own copy
out has finished; the recompute, which runs the forward again, waits for an output's copy back
where it is served. So a layer's step is timed on three queues, in its profile's kernel times:
  - the forward runs every call's kernel back to back; call i's copy out starts when the copy-out
    stream is free and its kernel has ended, and takes bytes / the device-to-host bandwidth;
  - the recompute begins when the forward ends (the planner plans one layer, whose backward
    follows its forward); the copies back queue in the forward's order on the copy-in stream,
    each starting when the stream is free and its copy out has finished, bytes / the
    host-to-device bandwidth each;
  - the recompute runs the kernels of the calls it recomputes, in the forward's order; at an
    offloaded call it waits until that call's copy back has finished. The waits summed are the
    exposed copy time (what offload_stats()["exposed_copy_us"] measures, from events).
Several copies in one stretch of compute thus share it, and a copy out still queued when the
forward ends delays every copy back behind it. The backward's gradients run after the recompute
and hide nothing of it. In a stack of layers the copies back of a layer also start one layer
early (with the recompute of the layer after it), which the model, timing one layer, does not
count: its exposed time is what a single layer, or the first layer the backward reaches, waits.
The runtime queues a region's copies back in the order it holds the outputs (a hash map by
data-flow identity), which can differ from the forward's and from step to step: a copy back
queued behind one the recompute needs later makes it wait longer than the model says (on the test
accelerator, the first three matmuls of a Llama block at 20 MB/s: 39 ms predicted, 39 or 65 ms
measured, by step). The forward's order is the model's because it is the order the recompute
needs them in.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

from .. import _native
from .._native import Placement
from .._validation import bounded_repr, describe_value
from ..policy import Policy
from . import _fields
from ._profile import LayerProfile, ProfiledCall

OFFLOAD_MIN_BYTES = inspect.signature(Policy).parameters["offload_min_bytes"].default


def offload_placement(
    nbytes: int, reserved_host_bytes: int, offload_min_bytes: int, host_memory_limit: int | None
) -> Placement:
    """The runtime's rule (NOTE: [Where an offloaded call's outputs live] in
    csrc/policy/offload_rule.cpp): HOST when nbytes >= offload_min_bytes and reserved + nbytes fits
    within host_memory_limit (None: no cap). Byte counts are ints from 0 to 2**63 - 1."""
    limit = -1 if host_memory_limit is None else host_memory_limit
    # A sum of reservations past int64 is past every limit: clamped, it still is.
    reserved = min(reserved_host_bytes, _fields.INT64_MAX)
    return Placement(_native.C.offload_placement(nbytes, reserved, offload_min_bytes, limit))


class PlanError(ValueError):
    """A budget or a plan file that cannot be used; the message says what is wrong and what is right.

    Args:
        message: What is wrong and what is right.
        lowest_bytes: For a budget below what any plan reaches, the lowest budget a plan reaches.

    Attributes:
        lowest_bytes: For a budget below what any plan reaches, the lowest budget a plan reaches,
            in bytes (`plan`'s full recompute floor, `plan_step`'s lowest reachable peak); None
            for any other error.
    """

    def __init__(self, message: str, lowest_bytes: int | None = None):
        super().__init__(message)
        self.lowest_bytes = lowest_bytes

    def __reduce__(self):
        return (type(self), (str(self), self.lowest_bytes))


def unreachable_budget(where: str, asked: str, lowest_is: str, lowest: int, how: str) -> PlanError:
    """The PlanError for a budget below the lowest any plan reaches: it names the budget given
    (`asked`) and that lowest (`lowest_is` says what it is), and carries it as `lowest_bytes`."""
    return PlanError(
        f"sac_plugin: {where}: no plan reaches {asked}: {lowest_is} is {lowest} bytes "
        f"({lowest / 2**20:.2f} MiB), with {how}",
        lowest_bytes=lowest,
    )


def check_budget(budget, where: str = "budget", *, int_is_bytes: bool = False):
    """The budget as the planner uses it: a float fraction from 0.0 to 1.0, or bytes (an int from 2
    to 2**63 - 1, or a string with a unit, which comes back as the int).

    NOTE: [A budget has one reading]
    A float is a fraction of the layer's no-checkpointing activation bytes and an int is bytes, so
    1.0 keeps everything and 1 would keep one byte: the ints 0 and 1 (and the bools) read either
    way, and are refused with both readings named rather than taken as bytes. Bytes under 2 are
    still spelled with a unit ("0B", "1B"); a unit string ("512MiB", "8GiB") is read by
    `bytes_from_text`, the parser `python -m sac_plugin plan --budget/--peak` uses too. A plan
    file's int is bytes whatever its value (`int_is_bytes`): JSON writes 1 and 1.0 apart, and a
    plan saved with 0 bytes (a step plan's full recompute) reads back as it was written.
    """
    if isinstance(budget, str):
        return _budget_from_text(budget, where)
    reads_two_ways = isinstance(budget, bool) or (isinstance(budget, int) and budget in (0, 1) and not int_is_bytes)
    if reads_two_ways:
        n = int(budget)
        raise PlanError(
            f"sac_plugin: {where}={budget!r} reads two ways: {n} {'byte' if n == 1 else 'bytes'}, or the fraction "
            f"{float(n)} of the layer's no-checkpointing activation bytes; pass a fraction as a float from 0.0 to "
            f"1.0 (such as {float(n)}), or bytes as an int >= 2 or a string with a unit (such as '{n}B' or '512MiB')"
        )
    if not isinstance(budget, (int, float)):
        raise TypeError(
            f"sac_plugin: {where} must be a fraction of the layer's no-checkpointing activation bytes "
            f"(a float from 0.0 to 1.0) or bytes (an int >= 2, or a string with a unit such as '512MiB'), "
            f"got {describe_value(budget)}"
        )
    if isinstance(budget, float) and not (math.isfinite(budget) and 0.0 <= budget <= 1.0):
        raise PlanError(
            f"sac_plugin: {where} as a fraction must be from 0.0 to 1.0, got {budget!r}; pass an int or a string "
            "with a unit ('512MiB') for bytes"
        )
    if isinstance(budget, int) and not is_byte_count(budget):
        least = 0 if int_is_bytes else 2
        raise PlanError(
            f"sac_plugin: {where} as bytes must be an int from {least} to 2**63 - 1, got {bounded_repr(budget)}"
        )
    return budget


def _budget_from_text(text: str, where: str) -> int:
    """A budget string: bytes with a unit, never a bare number (a bare "1" would read two ways)."""
    try:
        if not text.strip()[-1:].isalpha():
            raise ValueError("no unit")
        return bytes_from_text(text, least=0)
    except ValueError:
        raise PlanError(
            f"sac_plugin: {where} as a string must be bytes with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
            f"such as '512MiB' or '1B', got {bounded_repr(text)}; pass a fraction as a float"
        ) from None


def byte_budget(nbytes: int):
    """A budget of `nbytes` computed bytes, as check_budget takes it: 0 and 1 would read two ways
    (NOTE: [A budget has one reading]), so under 2 bytes it is the fraction 0.0 (0 bytes); one
    byte keeps no more than none unless a call's whole output is one byte."""
    return nbytes if nbytes >= 2 else 0.0


# Byte units as `bytes_from_text` reads them, upper-cased: decimal (KB) and binary (KiB).
BYTE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def bytes_from_text(text: str, least: int = 1) -> int:
    """Bytes written as an int ("4096") or a number with a unit ("8GiB", "512MiB", "1.5GB", "1B").

    Args:
        text: The text.
        least: The fewest bytes accepted.

    Returns:
        The bytes, an int from `least` to 2**63 - 1.

    Raises:
        ValueError: Text that is not bytes, or out of range; the message lists the spellings.
    """
    number = text.strip().rstrip("BbKkMmGgTtIi")
    unit = text.strip()[len(number) :].upper() or "B"
    accepted = f"an int >= {least} or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as 8GiB"
    try:
        value = int(number) if unit == "B" else float(number) * BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{accepted}, got {bounded_repr(text)}") from None
    if not (value >= least and value < 2**63):
        raise ValueError(f"{accepted}, got {bounded_repr(text)}")
    return int(value)


def budget_in_bytes(budget, profile: LayerProfile) -> int:
    if isinstance(budget, float):
        return int(budget * profile.no_checkpoint_bytes)
    # A budget given with a unit ("512MiB") is bytes: the same the plan's check read.
    return bytes_from_text(budget, least=0) if isinstance(budget, str) else int(budget)


def call_key(call: ProfiledCall) -> tuple[str, int]:
    """How plans name a call: (op, index among the forward's calls of the op)."""
    return call.op, call.index


def is_byte_count(value) -> bool:
    """An int from 0 to 2**63 - 1: the library counts bytes in int64."""
    return _fields.COUNT.check(value)


def is_rate(value) -> bool:
    return _fields.RATE.check(value)


@dataclasses.dataclass(frozen=True)
class OffloadModel:
    """What offloading costs on the layer's device, as a plan prices its copies.

    Args:
        d2h_bytes_per_s: Copy bandwidth from the device to the host, in bytes per second (timed
            at plan time or given by the caller).
        h2d_bytes_per_s: Copy bandwidth from the host back to the device, in bytes per second.
        min_bytes: The bytes under which a call is never offloaded (the policy's
            offload_min_bytes).
        host_memory_limit: The most bytes the offloaded outputs may hold in host memory together
            (None: no cap).

    Raises:
        ValueError: A bandwidth that is not a finite number > 0, or a byte count that is not an
            int from 0 to 2**63 - 1.
    """

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    min_bytes: int = OFFLOAD_MIN_BYTES
    host_memory_limit: int | None = None

    def __post_init__(self):
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            if not is_rate(getattr(self, name)):
                raise ValueError(
                    f"sac_plugin: OffloadModel.{name} must be a finite number of bytes per second > 0, "
                    f"got {bounded_repr(getattr(self, name))}"
                )
        if not is_byte_count(self.min_bytes):
            raise ValueError(
                f"sac_plugin: OffloadModel.min_bytes must be an int from 0 to 2**63 - 1 (bytes), got "
                f"{bounded_repr(self.min_bytes)}"
            )
        if self.host_memory_limit is not None and not is_byte_count(self.host_memory_limit):
            raise ValueError(
                f"sac_plugin: OffloadModel.host_memory_limit must be None (no cap) or an int from 0 to "
                f"2**63 - 1 (bytes), got {bounded_repr(self.host_memory_limit)}"
            )

    def why_not_offloadable(self, call: ProfiledCall) -> str:
        """Why a plan may not offload a call.

        Args:
            call: A call of the layer's profile.

        Returns:
            "" when a plan may offload the call; otherwise why not: why it may not be kept, or
            "under N bytes" when its new outputs take no bytes or fewer than `min_bytes`.
        """
        if not call.keepable:
            return call.why_not_keepable
        # A call that holds no new bytes has nothing to move off the device.
        if call.bytes == 0 or offload_placement(call.bytes, 0, self.min_bytes, None) == Placement.DEVICE_BELOW_FLOOR:
            return f"under {self.min_bytes} bytes"
        return ""


@dataclasses.dataclass(frozen=True)
class CopyCost:
    """One call's two copies and the compute each can hide behind were it the only call offloaded,
    in seconds (NOTE: [The copy queues]): the forward's kernel time after it, which its copy to
    the host runs beside, and the recompute's kernel time before it, which its copy back runs
    beside (every call before it recomputed: the most that window can be)."""

    to_host: float
    to_device: float
    forward_window: float
    backward_window: float

    @property
    def exposed(self) -> float:
        """The copy time the windows do not hide: the copy out's overrun past the forward's end
        delays the copy back, whose overrun past the recompute's window the recompute waits."""
        return max(0.0, max(0.0, self.to_host - self.forward_window) + self.to_device - self.backward_window)

    @property
    def hides(self) -> bool:
        return self.exposed == 0.0


def copy_windows(profile: LayerProfile) -> list[tuple[float, float]]:
    """Per call, (the forward's kernel time after it, the recompute's kernel time before it with
    every call before it recomputed): its copies' windows were it the only call offloaded."""
    windows, after = [(0.0, 0.0)] * len(profile.calls), 0.0
    for i in range(len(profile.calls) - 1, -1, -1):
        windows[i] = (after, 0.0)
        after += profile.calls[i].seconds
    before = 0.0
    for i, c in enumerate(profile.calls):
        windows[i] = (windows[i][0], before)
        before += c.seconds if c.recomputed else 0.0
    return windows


def copy_costs(profile: LayerProfile, offload: OffloadModel) -> dict[tuple[str, int], CopyCost]:
    """The copies of every call a plan may offload, by (op, index)."""
    return {
        call_key(c): CopyCost(c.bytes / offload.d2h_bytes_per_s, c.bytes / offload.h2d_bytes_per_s, *window)
        for c, window in zip(profile.calls, copy_windows(profile))
        if not offload.why_not_offloadable(c)
    }


def exposed_copy_seconds(profile: LayerProfile, kept, offloaded, copies) -> float:
    """How long the recompute waits for the copies back of the offloaded calls together, timed on
    the copy queues (NOTE: [The copy queues]); `kept` are the calls the recompute is served, not
    run, `copies` each offloaded call's CopyCost."""
    if not offloaded:
        return 0.0
    now, out_free, copied_out = 0.0, 0.0, {}
    for c in profile.calls:
        now += c.seconds
        key = call_key(c)
        if key in offloaded:
            out_free = max(now, out_free) + copies[key].to_host
            copied_out[key] = out_free
    forward_end = in_free = now
    copied_in = {}
    for key, out_done in copied_out.items():
        in_free = max(in_free, out_done) + copies[key].to_device
        copied_in[key] = in_free
    now, waited = forward_end, 0.0
    for c in profile.calls:
        key = call_key(c)
        if key in copied_in:
            wait = max(0.0, copied_in[key] - now)
            waited += wait
            now += wait
        elif c.recomputed and key not in kept:
            now += c.seconds
    return waited


def recompute_seconds(profile: LayerProfile, kept) -> float:
    """The kernel time of the calls the recompute runs: those it reaches and is not served."""
    return sum(c.seconds for c in profile.calls if c.recomputed and call_key(c) not in kept)


def step_overhead(profile: LayerProfile, kept, offloaded, copies) -> float:
    """The time a plan adds to a step: kernel time of the calls it recomputes plus the time the
    recompute waits for the copies back of the calls it offloads (NOTE: [The copy queues])."""
    return recompute_seconds(profile, frozenset(kept) | frozenset(offloaded)) + exposed_copy_seconds(
        profile, kept, offloaded, copies
    )


def prune_offloads(profile: LayerProfile, kept, offloaded, copies) -> frozenset:
    """`offloaded` less the calls whose copies, queued with the others', cost more than
    recomputing them: one at a time, the call whose recompute instead saves the most predicted
    time, until none does. Every step lowers step_overhead, so the result never predicts a slower
    step than `offloaded`, nor than recomputing all of them."""
    offloaded = set(offloaded)
    best = step_overhead(profile, kept, offloaded, copies)
    order = {call_key(c): i for i, c in enumerate(profile.calls)}
    while offloaded:
        trials = [(step_overhead(profile, kept, offloaded - {key}, copies), order[key], key) for key in offloaded]
        overhead, _, key = min(trials)
        if overhead >= best:
            break
        offloaded.discard(key)
        best = overhead
    # One at a time can stop where dropping several at once would still pay.
    return frozenset() if step_overhead(profile, kept, (), copies) <= best else frozenset(offloaded)
