"""The one seam through which diagnostics watch checkpointed steps.

Audits, per-layer reports, activation-memory tracking and the unit checks all need to see what a
checkpointed step does: which regions it creates, its passes, each recompute unit it opens. They
register an `Observer` here (`observe(observer)` as a context manager, or `register`/`unregister`)
instead of appending to lists in other modules. The hot path asks one question: is `registered`,
this module's one global, empty? It reads the global itself, not through `observing()`, because a
Python call made once per checkpoint, with the interpreter cold, costs microseconds. With nothing
registered, a checkpointed region pays nothing for any of this.

Observers are called on the thread that runs the step (the forward, or autograd's thread for the
recompute), in registration order. The registry is a tuple replaced under a lock, so a reader
never sees it half-changed and needs no lock itself.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["Observer", "observe", "observers", "observing", "register", "registered", "unregister"]


class Observer:
    """Every hook is optional: the base class does nothing, subclasses override what they watch."""

    def region_created(self, region) -> None:
        """A checkpointed region (a `sac_plugin.Region`) was created for one checkpoint call."""

    def wrap_passes(self, region, policy, forward, recompute, kept_calls):
        """Returns the (forward, recompute) contexts of a region, wrapped as the observer needs.
        `kept_calls()` says how many calls the region has kept so far."""
        return forward, recompute

    def unit_entered(self, name: str):
        """A recompute unit opened on this thread; the return value comes back to unit_exited."""
        return None

    def unit_exited(self, name: str, token) -> None:
        """The unit opened with `token` closed on this thread."""


# The observers, in registration order; replaced whole under the lock, never changed in place.
registered: tuple[Observer, ...] = ()
_lock = threading.Lock()


def observing() -> bool:
    """Whether any observer is registered (the hot path reads `registered` itself)."""
    return bool(registered)


def observers() -> tuple[Observer, ...]:
    return registered


def register(observer: Observer) -> None:
    global registered
    if not isinstance(observer, Observer):
        raise TypeError(f"sac_plugin: an observer must be a sac_plugin Observer, got {type(observer).__name__}")
    with _lock:
        registered = (*registered, observer)


def unregister(observer: Observer) -> None:
    """Removes one registration of `observer`; a second call for the same one changes nothing."""
    global registered
    with _lock:
        for i in range(len(registered) - 1, -1, -1):
            if registered[i] is observer:
                registered = registered[:i] + registered[i + 1 :]
                return


@contextlib.contextmanager
def observe(observer: Observer):
    """Registers `observer` for the block, whatever it raises."""
    register(observer)
    try:
        yield observer
    finally:
        unregister(observer)
