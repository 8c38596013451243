"""Checkpoint sites: one policy applied at one place of a model, and what the runtime learns there.

NOTE: [What a site learns] (csrc/dispatch/site.h): a Policy is a value, what it selects; what
running it teaches (the kept calls torch's early stop never lets the recompute reach, the units
seen to mean something in a forward, the warnings said) is a fact about one layer's code. So each
context_fn(policy) (apply_selective_checkpointing makes one per module) has a Site of its own: the
C++ half holds what the fallback reads per call, this object what only Python watches.
"""

from __future__ import annotations

from . import _scopes

__all__ = ["Site"]


class Site:
    """One policy applied at one place; regions made from it learn together."""

    __slots__ = (
        "policy",
        "label",
        "keeps_nothing",
        "native",
        "unchecked_units",
        "watched_forwards",
        "reach_unknown",
        "watches_saves",
        "writes_outside",
        "marks_passes",
        "__weakref__",
    )

    def __init__(self, policy, label: str = "", *, marks_passes: bool = False):
        self.policy = policy
        # What messages call this place: the checkpointed layer's class, or "" for none.
        self.label = label
        # The policy is a value: read once here, not on every checkpoint call the site makes.
        self.keeps_nothing = policy.keeps_nothing
        # A site whose regions only mark passes for another region that decides their calls.
        self.marks_passes = marks_passes
        # The C++ site (_C.Site): what regions are made from.
        self.native = _scopes.new_site(policy, label, marks_passes=marks_passes)
        # Whether the layer's forward writes tensors outside its region: None until a forward of
        # the site has shown it (NOTE: [The recompute writes nothing outside its region] in
        # csrc/dispatch/outside_writes.cpp). A policy that keeps nothing intercepts only then.
        self.writes_outside = None
        # Units not yet seen to mean something in a region's forward (_unit_checks.py).
        self.unchecked_units = set(policy.kept_units | policy.recomputed_units | policy.offloaded_units)
        self.watched_forwards = 0
        # Whether no forward of a region of this site has been watched yet for the kept calls its
        # recompute never reaches (NOTE: [Kept outputs the recompute never reaches]).
        self.reach_unknown = not policy.keeps_nothing
        # Whether its forwards note what autograd saves, to find the recompute calls nothing the
        # backward needs reads: until a watched forward found none (NOTE: [The recompute runs only
        # what backward needs] in csrc/dispatch/dead_calls.cpp).
        self.watches_saves = not policy.keeps_nothing

    def outside_writes_possible(self) -> bool:
        """Whether a region of this site may write outside itself in its forward (unknown counts),
        read from the C++ site until a forward has settled it."""
        if self.writes_outside is None:
            seen = self.native.outside_writes()
            if seen == 0:
                return True
            self.writes_outside = seen == 2
        return self.writes_outside

    def finds_dead_calls(self) -> bool:
        """Whether the site's watched forwards found recompute calls to skip (or none has ended)."""
        return self.native.dead_calls() != 1

    def __reduce__(self):
        # A copy (pickle, deepcopy) is a new place: it learns for itself.
        return (_new_site, (self.policy, self.label, self.marks_passes))

    def __repr__(self) -> str:
        return f"Site({self.policy!r})"


def _new_site(policy, label: str, marks_passes: bool) -> Site:
    return Site(policy, label, marks_passes=marks_passes)
