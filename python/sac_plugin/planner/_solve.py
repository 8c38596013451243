"""Choosing a plan: for each budget, the calls to keep (and, with an offload model, to offload)
for the least predicted step time, from knapsack tables built once per profile.

Without a host cap a call not kept costs min(kernel time, its copies' exposed time alone), the
value of keeping it in a 0/1 knapsack over device bytes. Where the host cap binds, one
table over device cells x host cells (knapsack.PairKnapsack) chooses keep, offload or recompute
together, exact on the grid of the sizes' gcd while the table is small (otherwise on a coarser
grid, never over either limit). Every answer is completed the same way: given its kept calls, the
offloads that save the most time within the host cap (a knapsack over host bytes), then any
offloaded call that still fits the budget is kept instead (no copies, no host bytes). The
candidates are the two-way plan's kept calls, the unbounded-host answer's and, where the cap binds,
the pair table's and the kept calls planned with offload open only to the calls the host took;
the cheapest, each priced with its copies queued together and its offloads pruned where recomputing
them is faster (NOTE: [The copy queues] in _cost.py), wins. The two-way plan itself is a
candidate, so a three-way plan never predicts a slower step than the two-way one.
"""

from __future__ import annotations

from . import _knapsack as knapsack
from ._cost import OffloadModel, budget_in_bytes, call_key, copy_costs, prune_offloads, step_overhead
from ._profile import LayerProfile, ProfiledCall
from ._rule_calls import kept_regions, routing_calls


class Solver:
    """Every budget's choice for one profile and offload model: the knapsack tables are built once
    and answer every budget (a Pareto curve costs one build)."""

    def __init__(self, profile: LayerProfile, offload: OffloadModel | None, two_way: knapsack.Knapsack | None = None):
        self.profile = profile
        self.offload = offload
        # Offered one by one: the calls outside keep-flag regions that a policy may keep, but not
        # the routing calls, which every selective policy holds (capacity leaves room for them).
        # Each keep-flag region is one item after them (NOTE: [A plan keeps a keep-flag region
        # whole or recomputes it whole]).
        self.routing = routing_calls(profile)
        regions = kept_regions(profile)
        in_regions = frozenset().union(*(r.members for r in regions))
        offered = [c for c in profile.calls if c.keepable and call_key(c) not in in_regions | self.routing]
        self.items = [c for c in offered if c.bytes > 0]
        self.regions = [r for r in regions if r.bytes > 0]
        self.bytes_of = {call_key(c): c.bytes for c in profile.calls}
        self.routing_bytes = sum(c.bytes for c in profile.calls if c.keepable and call_key(c) in self.routing)
        self.free = frozenset(call_key(c) for c in offered if c.bytes == 0 and c.seconds > 0).union(
            *(r.calls for r in regions if r.bytes == 0 and r.seconds > 0)
        )
        weights = [c.bytes for c in self.items] + [r.bytes for r in self.regions]
        capacity = max(0, profile.no_checkpoint_bytes - profile.full_recompute_bytes)
        self.max_capacity = min(capacity, sum(weights))
        region_seconds = [r.seconds for r in self.regions]
        self.two_way = two_way or knapsack.Knapsack(
            weights, [c.seconds for c in self.items] + region_seconds, self.max_capacity
        )
        self.copies = copy_costs(profile, offload) if offload is not None else {}
        if offload is not None:
            # A region is kept or recomputed, never offloaded: not keeping it costs its recompute.
            self.three_way = knapsack.Knapsack(
                weights, [self._dropped_cost(c) for c in self.items] + region_seconds, self.max_capacity
            )
        self._without_offload = None
        self._pair = None

    def _keys(self, indices) -> set[tuple[str, int]]:
        """The calls of the knapsack's items: a call, or a keep-flag region's calls."""
        keys = set()
        for i in indices:
            if i < len(self.items):
                keys.add(call_key(self.items[i]))
            else:
                keys |= self.regions[i - len(self.items)].calls
        return keys

    def _dropped_cost(self, call: ProfiledCall) -> float:
        """What the call costs when not kept: the cheaper of its recompute and its exposed copies."""
        copy = self.copies.get(call_key(call))
        return call.seconds if copy is None else min(call.seconds, copy.exposed)

    def without_offload(self) -> Solver:
        if self.offload is None:
            return self
        if self._without_offload is None:
            self._without_offload = Solver(self.profile, None, self.two_way)
        return self._without_offload

    def capacity(self, budget) -> int:
        """Bytes the kept outputs may take: the budget minus the floor and the calls that route
        tokens (held whenever anything is kept), at most what there is to keep; under 0 where the
        routing calls do not fit."""
        return min(
            budget_in_bytes(budget, self.profile) - self.profile.full_recompute_bytes - self.routing_bytes,
            self.max_capacity,
        )

    def _kept(self, table: knapsack.Knapsack, capacity: int) -> frozenset[tuple[str, int]]:
        """Free calls (keepable, no new bytes) and the knapsack's choice within the capacity. A
        capacity under 0 (a budget under the floor, or the floor and the routing calls) keeps only
        the free calls, and nothing where there are routing calls to hold: keeping even a free call
        would hold them."""
        if capacity < 0:
            return frozenset() if self.routing_bytes else self.free
        if capacity >= sum(table.weights):
            return frozenset(self.free | self._keys(range(len(table.weights))))
        return frozenset(self.free | self._keys(table.solve(capacity)))

    def choose(self, budget) -> tuple[frozenset, frozenset]:
        """(kept, offloaded) for the budget: the least predicted step time (the three-way model)."""
        capacity = self.capacity(budget)
        two_way = self._kept(self.two_way, capacity)
        if self.offload is None:
            return two_way, frozenset()
        if capacity < 0 and self.routing_bytes:
            return frozenset(), frozenset()  # an offloaded call, like a kept one, holds the routing calls
        capacity = max(0, capacity)  # offloading holds no device bytes: below the floor it still saves time
        unbounded_host = self._kept(self.three_way, capacity)
        options = [self._complete(two_way, capacity), self._complete(unbounded_host, capacity)]
        if self._host_binds(unbounded_host):
            device, _ = self._pair_table().solve(capacity)
            options.append(self._complete(self.free | self._keys(device), capacity))
            allowed = options[1][1]
            values = [self._dropped_cost(c) if call_key(c) in allowed else c.seconds for c in self.items]
            restricted = knapsack.Knapsack(self.two_way.weights, values + [r.seconds for r in self.regions], capacity)
            options.append(self._complete(self._kept(restricted, capacity), capacity))
        # Priced on the copy queues, where offloads share the copy streams; the two-way plan stays
        # a candidate, so a plan with offload never predicts a slower step than one without.
        options = [(kept, prune_offloads(self.profile, kept, offloaded, self.copies)) for kept, offloaded in options]
        options.append((two_way, frozenset()))
        return min(options, key=lambda o: (self.overhead(*o), self.host_bytes(o[1]), len(o[1]), sorted(o[1])))

    def _pair_table(self) -> knapsack.PairKnapsack:
        """Keep, offload or recompute as one knapsack over device and host bytes together."""
        if self._pair is None:
            host_values = [
                c.seconds - self.copies[call_key(c)].exposed if call_key(c) in self.copies else None for c in self.items
            ]
            self._pair = knapsack.PairKnapsack(
                self.two_way.weights,
                [c.seconds for c in self.items] + [r.seconds for r in self.regions],
                host_values + [None] * len(self.regions),
                self.max_capacity,
                self.offload.host_memory_limit,
            )
        return self._pair

    def overhead(self, kept, offloaded) -> float:
        return step_overhead(self.profile, kept, offloaded, self.copies)

    def host_bytes(self, offloaded) -> int:
        return sum(c.bytes for c in self.items if call_key(c) in offloaded)

    def _worth_offloading(self, kept) -> list[ProfiledCall]:
        """The calls not kept whose exposed copies cost less than their recompute."""
        return [
            c
            for c in self.items
            if call_key(c) not in kept and call_key(c) in self.copies and self.copies[call_key(c)].exposed < c.seconds
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
                [c.bytes for c in candidates], [c.seconds - self.copies[call_key(c)].exposed for c in candidates], limit
            )
            offloaded = [candidates[i] for i in table.solve(limit)]
        kept = set(kept)
        room = capacity - sum(self.bytes_of[k] for k in kept)
        position = {call_key(c): i for i, c in enumerate(self.items)}
        for c in sorted(offloaded, key=lambda c: (-self.copies[call_key(c)].exposed, -c.bytes, position[call_key(c)])):
            if c.bytes <= room:
                kept.add(call_key(c))
                room -= c.bytes
        offloaded = {call_key(c) for c in offloaded} - kept
        if limit is not None:
            host_room = limit - self.host_bytes(offloaded)
            rest = sorted(
                (c for c in candidates if call_key(c) not in kept and call_key(c) not in offloaded),
                key=lambda c: (-(c.seconds - self.copies[call_key(c)].exposed) / c.bytes, position[call_key(c)]),
            )
            for c in rest:
                if c.bytes <= host_room:
                    offloaded.add(call_key(c))
                    host_room -= c.bytes
        return frozenset(kept), frozenset(offloaded)
