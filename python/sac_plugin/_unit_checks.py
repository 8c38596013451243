"""Checks that the units a policy names mean something in the model it checkpoints.

A unit name is a free string: `Policy(kept_units=["atn"])` is a valid policy that keeps nothing,
because no code ever opens a unit "atn". So, the first time regions with a policy run their
forward, the package watches which units open there and how many calls each keeps, and warns
once per policy about:

- a kept or recomputed unit that no model declares (no target map installed it, no
  `in_recompute_unit` names it, it was never opened) and that the forward did not open: almost
  always a typo; the warning names the units that did open and the closest one;
- a kept unit that opened but kept nothing (everything run in it was a view, an in-place write,
  a random call or a collective, or it ran only ops another rule recomputes).

A unit that some model declares but this forward did not open (a MoE unit in a dense layer) is
not an error; it is watched for a few more forwards. Watching costs a little per unit opening and
nothing per op, and stops once each unit of the policy is settled.
"""

from __future__ import annotations

import difflib
import functools
import re
import threading
import warnings
import weakref

import torch

from . import _native, _observers
from ._logging import logger

# Units some model declares: installed by a target map (run_in_unit), named by in_recompute_unit,
# or opened while a forward was watched. Only ever grows (unit names live for the process anyway).
_declared: set[str] = set()
# The unit names every model may use (RecomputeUnit's values), offered as closest matches.
_vocabulary: set[str] = set()
# Forwards watched on any thread; while there is one, the unit observer below is registered.
_watching = 0
_watching_lock = threading.Lock()
_local = threading.local()
# A unit declared elsewhere but not opened is given up on after this many watched forwards.
MAX_WATCHED_FORWARDS = 8


def declare(unit: str) -> None:
    _declared.add(unit)


def add_vocabulary(units) -> None:
    _vocabulary.update(units)


class _Watch:
    """One watched forward: for each unit opened in it, the calls kept while it was open."""

    __slots__ = ("kept_calls", "opened")

    def __init__(self, kept_calls):
        self.kept_calls = kept_calls  # () -> calls the region has kept so far
        self.opened: dict[str, int] = {}


class _UnitObserver(_observers.Observer):
    """Notes, for the forward watched on this thread, each unit opened and what it kept."""

    def unit_entered(self, name: str):
        watches = getattr(_local, "watches", None)
        if not watches:
            return None
        watch = watches[-1]
        watch.opened.setdefault(name, 0)
        return watch, watch.kept_calls()

    def unit_exited(self, name: str, token) -> None:
        if token is not None:
            watch, kept_before = token
            watch.opened[name] += watch.kept_calls() - kept_before


_UNIT_OBSERVER = _UnitObserver()


class WatchedForward:
    """A region's forward context that checks its site's units when the forward ends."""

    __slots__ = ("_site", "_forward", "_watch", "_around", "_kept_before")

    def __init__(self, site, forward, kept_calls):
        self._site, self._forward, self._watch = site, forward, _Watch(kept_calls)
        self._around, self._kept_before = (), 0

    def __enter__(self):
        global _watching
        self._forward.__enter__()
        # Units already open around the checkpointed call are open for the whole forward: what
        # the forward keeps is kept inside them too.
        with torch._C._DisableTorchDispatch():  # NOTE: [The plugin's own calls]
            self._around = tuple(_native.C.open_units())
        self._kept_before = self._watch.kept_calls()
        _local.__dict__.setdefault("watches", []).append(self._watch)
        with _watching_lock:
            _watching += 1
            if _watching == 1:
                _observers.register(_UNIT_OBSERVER)
        return self

    def __exit__(self, *exc_info):
        global _watching
        _local.watches.remove(self._watch)
        with _watching_lock:
            _watching -= 1
            if _watching == 0:
                _observers.unregister(_UNIT_OBSERVER)
        kept_in_forward = self._watch.kept_calls() - self._kept_before
        suppressed = self._forward.__exit__(*exc_info)
        if exc_info[0] is None:
            for unit in self._around:
                self._watch.opened[unit] = self._watch.opened.get(unit, 0) + kept_in_forward
            check(self._site, self._watch.opened)
        return suppressed


def check(site, opened: dict[str, int]) -> None:
    """Settles what one forward says about the site's pending units; warns at most once each."""
    _declared.update(opened)
    policy = site.policy
    site.watched_forwards += 1
    for unit in sorted(site.unchecked_units):
        kind = "kept" if unit in policy.kept_units else "offloaded" if unit in policy.offloaded_units else "recomputed"
        matched = _opened_as(unit, opened)
        if matched is not None:
            site.unchecked_units.discard(unit)
            if kind != "recomputed" and matched == 0 and _claim(policy, unit):
                _warn(
                    f"sac_plugin: {kind} unit '{unit}' was opened in the forward of a checkpointed region with {policy} "
                    "but kept nothing: everything run inside it was a view, an in-place write, a random call, a "
                    "collective or inside a recomputed unit, which are always recomputed (warned once per policy)"
                )
            else:
                logger.debug("unit '%s' of %s: opened, %d calls kept in it", unit, policy, matched)
        elif unit not in _declared and not any(_pattern(unit).fullmatch(name) for name in _declared):
            site.unchecked_units.discard(unit)
            if not _claim(policy, unit):
                continue
            effect = {"kept": "keeps nothing", "offloaded": "offloads nothing"}.get(kind, "recomputes nothing")
            _warn(
                f"sac_plugin: {kind} unit '{unit}' is declared by no model and was not opened in the forward of a "
                f"checkpointed region with {policy}, so it {effect}. Units opened there: "
                f"{', '.join(sorted(opened)) or 'none'}; {_closest(unit, opened)} (warned once per policy)"
            )
    if site.watched_forwards >= MAX_WATCHED_FORWARDS and site.unchecked_units:
        logger.debug(
            "units %s of %s are declared but were not opened in %d forwards; no longer watched",
            sorted(site.unchecked_units),
            policy,
            site.watched_forwards,
        )
        site.unchecked_units.clear()


# Units warned about, per Policy object: each site settles its own units (a unit missing from one
# layer type may open in another), but a warning is about the policy, said once for all its sites.
_warned: dict[int, set[str]] = {}


def _claim(policy, unit: str) -> bool:
    units = _warned.get(id(policy))
    if units is None:
        units = _warned[id(policy)] = set()
        weakref.finalize(policy, _warned.pop, id(policy), None)
    if unit in units:
        return False
    units.add(unit)
    return True


@functools.lru_cache(maxsize=1024)
def _pattern(unit: str):
    # A policy's unit pattern as the C++ side matches it (unitPatternMatches in
    # csrc/policy/policy.cpp): each '*' any run of characters, everything else itself.
    return re.compile(".*".join(re.escape(part) for part in unit.split("*")), re.DOTALL)


def _opened_as(unit: str, opened: dict[str, int]) -> int | None:
    """The calls kept in the units a policy's name or pattern matched in a forward, or None."""
    if "*" not in unit:
        return opened.get(unit)
    counts = [kept for name, kept in opened.items() if _pattern(unit).fullmatch(name)]
    return sum(counts) if counts else None


def _closest(unit: str, opened) -> str:
    candidates = sorted(set(opened) | _declared | _vocabulary)
    match = difflib.get_close_matches(unit, candidates, n=1)
    return f"closest match: '{match[0]}'" if match else "no known unit is close to it"


def _warn(message: str) -> None:
    logger.debug("%s", message)
    warnings.warn(message, UserWarning, stacklevel=2)
