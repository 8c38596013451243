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
        "_reference",
        "address",
        "unchecked_units",
        "watched_forwards",
        "reach_unknown",
        "__weakref__",
    )

    def __init__(self, policy, label: str = ""):
        self.policy = policy
        # What messages call this place: the checkpointed layer's class, or "" for none.
        self.label = label
        # The policy is a value: read once here, not on every checkpoint call the site makes.
        self.keeps_nothing = policy.keeps_nothing
        self._reference = _scopes.SiteReference(policy._policy_address, label)
        # What the scope C ABI and the dispatch-mode engine make regions from; valid while this lives.
        self.address = self._reference.address
        # Units not yet seen to mean something in a region's forward (_unit_checks.py).
        self.unchecked_units = set(policy.kept_units | policy.recomputed_units | policy.offloaded_units)
        self.watched_forwards = 0
        # Whether no forward of a region of this site has been watched yet for the kept calls its
        # recompute never reaches (NOTE: [Kept outputs the recompute never reaches]).
        self.reach_unknown = not policy.keeps_nothing

    def __reduce__(self):
        # A copy (pickle, deepcopy) is a new place: it learns for itself.
        return (Site, (self.policy, self.label))

    def __repr__(self) -> str:
        return f"Site({self.policy!r})"
