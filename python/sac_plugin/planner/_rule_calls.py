"""A profile's calls as the one rule (docs/semantics.md, NOTE: [The keep rule] in
csrc/policy/policy.cpp) decides them: the calls a policy holds, the calls that route tokens, the
torch_remat regions that keep whole, and the policy that holds exactly a plan's calls.

NOTE: [A plan keeps a keep-flag region whole or recomputes it whole]
Under a policy that selects anything, a torch_remat region opened with recompute=False that no
list names keeps every call inside it (the rule's step 4); a name in recomputed_units recomputes
every call inside it, whatever else selects them (step 3); a policy that selects nothing is full
recompute, regions included. So a plan cannot keep some calls of such a region and recompute
others: it chooses each region as one item, kept whole (its name in kept_units, which keeps what
the flag keeps and makes the policy select something) or recomputed whole (its name in
recomputed_units). Names that open together (one region inside another, or one name opened with
either flag) are one item. A recompute=True region decides nothing itself: its calls are offered
one by one, as any call. The calls that route tokens are held by every selective policy (step 2),
inside a recomputed unit too, so a plan that keeps anything counts them and offers none of them.

The calls inside a recomputed unit take no index (Policy countsCalls), so a plan's kept_calls
count each op's calls outside the regions it recomputes; a plan names calls by their profiled
index, which counts every call.
"""

from __future__ import annotations

import dataclasses

from .. import _rule
from ..policy import Policy
from ._cost import OffloadModel, Placement, call_key, offload_placement
from ._profile import WRITTEN_IN_THE_FORWARD, LayerProfile, ProfiledCall


def overload(op: str) -> str:
    """The single overload a profiled op name means: "aten::mm" -> "aten::mm.default"."""
    return op if "." in op.partition("::")[2] else op + ".default"


def unit_names(call: ProfiledCall) -> tuple[str, ...]:
    return tuple(unit.name if type(unit) is _rule.RegionOpening else unit for unit in call.units)


def held_by(policy: Policy, profile: LayerProfile, decided: bool = False) -> tuple[frozenset, frozenset]:
    """The profiled calls `policy` keeps on the device and offloads: the one C++ rule
    (docs/semantics.md), asked call by call in the order the forward made them, through the call
    decider that also numbers the calls for every-nth and kept-call rules exactly as the engines do
    (a call in a recomputed unit takes no number). Each call is asked with the units open around it,
    torch_remat regions with their flags (NOTE: [A profile records each call's open units]). An
    offloaded call under offload_min_bytes, or one that would take the host past
    host_memory_limit, stays on the device, as the runtime keeps it. With `decided`, the calls the
    forward decides to keep also include those it frees when it writes them later. A policy that
    keeps nothing holds nothing: the runtime does not intercept its regions (full recompute,
    keep-flag regions and routing calls included)."""
    if policy.keeps_nothing:
        return frozenset(), frozenset()
    decider = _rule.CallDecider(policy)
    kept, offloaded, host_bytes = set(), set(), 0
    limit = policy.host_memory_limit
    for call in profile.calls:
        decision = decider.decide(overload(call.op), False, call.units)
        # A call after the recompute stops is decided as held but not held (NOTE: [Kept outputs
        # the recompute never reaches]): it holds no bytes and saves no time. A call the forward
        # writes later, whose output the runtime cannot copy alone, is decided held too, then
        # freed at the write (NOTE: [Kept outputs written in the forward]): `decided` counts it,
        # as a trace of the forward shows it.
        written = call.why_not_keepable == WRITTEN_IN_THE_FORWARD
        if not (decision.held and (call.keepable or (decided and written))):
            continue
        if written:
            kept.add(call_key(call))
            continue
        if (
            decision.outcome == _rule.Outcome.OFFLOAD
            and offload_placement(call.bytes, host_bytes, policy.offload_min_bytes, limit) == Placement.HOST
        ):
            offloaded.add(call_key(call))
            host_bytes += call.bytes
        else:
            kept.add(call_key(call))
    return frozenset(kept), frozenset(offloaded)


_ROUTING_PROBE: list = []  # a policy that selects something: the rule then pins routing calls
_ANSWERS_BY_PROFILE: dict = {}


def _answer(profile: LayerProfile, what: str, compute):
    """One answer per profile and question, for the profile being planned (a plan asks again for
    every budget); a new profile replaces the old one's answers."""
    entry = _ANSWERS_BY_PROFILE.get(id(profile))
    if entry is None or entry[0] is not profile:
        _ANSWERS_BY_PROFILE.clear()
        entry = _ANSWERS_BY_PROFILE[id(profile)] = (profile, {})
    answers = entry[1]
    if what not in answers:
        answers[what] = compute()
    return answers[what]


def routing_calls(profile: LayerProfile) -> frozenset[tuple[str, int]]:
    """The profiled calls the one rule keeps under any selective policy because they route tokens,
    asked of it call by call (a profile of made-up ops, as property tests build, has none)."""

    def compute():
        if not _ROUTING_PROBE:
            _ROUTING_PROBE.append(Policy(kept_ops=["aten::mm"]))
        found = set()
        for call in profile.calls:
            try:
                decision = _rule.decide_call(_ROUTING_PROBE[0], call.op, call.units, 0)
            except (ValueError, RuntimeError):
                continue  # not a registered op
            if decision.reason == _rule.Reason.ROUTES_TOKENS:
                found.add(call_key(call))
        return frozenset(found)

    return _answer(profile, "routing", compute)


@dataclasses.dataclass(frozen=True)
class KeptRegion:
    """torch_remat regions opened with recompute=False that a plan keeps or recomputes as one item.

    Attributes:
        names: The region names (kept_units or recomputed_units name them all).
        members: Every call inside an opening of one of the names.
        calls: The calls the rule holds when the regions are kept, the routing calls left out.
        bytes: Their bytes.
        seconds: Their kernel time, which keeping them saves.
    """

    names: tuple[str, ...]
    members: frozenset[tuple[str, int]]
    calls: frozenset[tuple[str, int]]
    bytes: int
    seconds: float


def kept_regions(profile: LayerProfile) -> tuple[KeptRegion, ...]:
    """The keep-flag regions of a profile, names that open together joined (NOTE: [A plan keeps a
    keep-flag region whole or recomputes it whole])."""

    def compute():
        keeping = {
            unit.name
            for call in profile.calls
            for unit in call.units
            if type(unit) is _rule.RegionOpening and not unit.recompute
        }
        if not keeping:
            return ()
        joined = {name: name for name in keeping}

        def root(name):
            while joined[name] != name:
                joined[name] = joined[joined[name]]
                name = joined[name]
            return name

        for call in profile.calls:
            names = [name for name in unit_names(call) if name in keeping]
            for name in names[1:]:
                joined[root(name)] = root(names[0])
        groups: dict[str, set[str]] = {}
        for name in sorted(keeping):
            groups.setdefault(root(name), set()).add(name)
        routing = routing_calls(profile)
        by_key = {call_key(c): c for c in profile.calls}
        regions = []
        for names in sorted(groups.values(), key=sorted):
            members = frozenset(call_key(c) for c in profile.calls if names.intersection(unit_names(c)))
            held, _ = held_by(Policy(kept_units=sorted(names)), profile)
            calls = (held & members) - routing
            regions.append(
                KeptRegion(
                    tuple(sorted(names)),
                    members,
                    frozenset(calls),
                    sum(by_key[k].bytes for k in calls),
                    sum(by_key[k].seconds for k in calls),
                )
            )
        return tuple(regions)

    return _answer(profile, "kept regions", compute)


def _calls_by_op(keys, index_of) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {}
    for key in sorted(keys):
        calls.setdefault(overload(key[0]), []).append(index_of[key])
    return calls


def plan_policy(
    profile: LayerProfile,
    kept: frozenset[tuple[str, int]],
    offloaded: frozenset[tuple[str, int]],
    offload: OffloadModel | None,
) -> Policy:
    """The policy that holds a plan's calls: a keep-flag region with any kept or offloaded call is
    kept whole (kept_units), any other recomputed whole (recomputed_units); the other calls by
    kept_calls and offloaded_calls, at the indices the runtime counts with those regions
    recomputed; the routing calls by the rule itself. A plan that keeps and offloads nothing is
    full recompute (NOTE: [A plan keeps a keep-flag region whole or recomputes it whole])."""
    held = kept | offloaded
    kept_names, recomputed_names, kept_members, recomputed_members = [], [], set(), set()
    if held:
        for region in kept_regions(profile):
            if region.calls & held:
                kept_names += region.names
                kept_members |= region.members
            else:
                recomputed_names += region.names
                recomputed_members |= region.members
    # The runtime's index of each call outside the recomputed regions (Policy countsCalls).
    index_of, counts = {}, {}
    for call in profile.calls:
        if call_key(call) not in recomputed_members:
            index_of[call_key(call)] = counts.get(call.op, 0)
            counts[call.op] = index_of[call_key(call)] + 1
    by_rule = routing_calls(profile) | recomputed_members
    kept_calls = _calls_by_op(kept - by_rule - kept_members, index_of)
    units = {"kept_units": sorted(kept_names), "recomputed_units": sorted(recomputed_names)}
    if offload is None:
        return Policy(kept_calls=kept_calls, **units)
    return Policy(
        kept_calls=kept_calls,
        offloaded_calls=_calls_by_op(offloaded - by_rule, index_of),
        offload_min_bytes=offload.min_bytes,
        host_memory_limit=offload.host_memory_limit,
        **units,
    )
