"""Recompute units: named parts of a model that a policy can keep as a whole."""

from __future__ import annotations

import enum
import functools
import threading

import torch

from . import _observers, _scopes, _unit_checks
from .policy import check_unit_name, describe_value

__all__ = ["RecomputeUnit", "UNIT_ANNOTATION_PREFIX", "in_recompute_unit", "open_units", "recompute_unit"]


class RecomputeUnit(enum.StrEnum):
    """Named units a config can keep. Values are what config files spell."""

    ATTN = "attn"
    MLP = "mlp"
    MOE_GATE = "moe_gate"
    MOE_DISPATCH = "moe_dispatch"
    NORM = "norm"


_unit_checks.add_vocabulary(unit.value for unit in RecomputeUnit)


# Under torch.compile a unit is carried as node metadata: torch.fx.traceback.annotate writes
# node.meta["custom"], and the policy function that tags nodes for the partitioner reads it back
# from fx_traceback.current_meta while AOTAutograd traces the checkpointed region (see
# checkpointing.torch_policy_fn). One key per unit, so nested units accumulate.
UNIT_ANNOTATION_PREFIX = "sac_unit:"


class _UnitScope:
    """Eager: opens the unit on this thread's C++ unit stack (units nest).

    One scope object may be entered more than once (recursion, or on several threads), so it
    remembers each opening as (thread, depth, observer tokens). An exit is checked before anything changes: from
    a thread that did not enter it, or out of order, it is refused and the opening stays, so
    the unit can still be closed correctly afterwards.
    """

    __slots__ = ("_name", "_id", "_openings")

    def __init__(self, name: str):
        self._name = name
        self._id = _unit_id(name)
        self._openings: list[tuple[int, int]] = []

    def __enter__(self):
        depth = _scopes.unit_push(self._id)
        if depth < 0:
            _scopes.raise_last_error(-depth)
        # Diagnostics that watch units (reports, the unit checks) see each opening.
        watching = _observers.observers()
        tokens = tuple((o, o.unit_entered(self._name)) for o in watching) if watching else ()
        self._openings.append((threading.get_ident(), depth, tokens))
        return self

    def __exit__(self, *exc_info):
        thread = threading.get_ident()
        index = next((i for i in range(len(self._openings) - 1, -1, -1) if self._openings[i][0] == thread), None)
        if index is None:
            where = "it is open on another thread" if self._openings else "it is not open"
            raise RuntimeError(
                f"sac_plugin: exiting recompute unit {self._name!r} on a thread that did not enter it ({where}); "
                "exit it on the thread that entered it; nothing was changed"
            )
        _, depth, tokens = self._openings[index]
        _scopes.unit_pop(self._id, depth)  # refuses misnesting, changing nothing
        del self._openings[index]
        for observer, token in tokens:
            observer.unit_exited(self._name, token)
        return False


@functools.lru_cache(maxsize=4096)
def _unit_id(name: str) -> int:
    # Interned in C++ once per name (units are a small vocabulary, capped there); a scope then
    # opens and closes its unit by id through the scope C ABI (NOTE: [Scopes through a C ABI]).
    return _scopes.unit_id(name)


def recompute_unit(name: str):
    """Context manager: ops run inside are part of unit `name` (units nest).

    with recompute_unit("attn"):
        out = attention(q, k, v)

    Eager code opens the unit in C++; inside torch.compile the unit becomes node metadata that
    the compiled region's selection honours.
    """
    check_unit_name(name, "recompute_unit: name")
    if torch.compiler.is_compiling():
        return torch.fx.traceback.annotate({UNIT_ANNOTATION_PREFIX + name: True})
    return _UnitScope(name)


def in_recompute_unit(name: str, fn=None):
    """Runs a callable inside unit `name`: a decorator, or `in_recompute_unit(name, fn)`."""
    check_unit_name(name, "in_recompute_unit: name")
    _unit_checks.declare(name)

    def decorate(function):
        if not callable(function):
            raise TypeError(f"sac_plugin: in_recompute_unit: fn must be callable, got {describe_value(function)}")

        @functools.wraps(function)
        def run_in_unit(*args, **kwargs):
            with recompute_unit(name):
                return function(*args, **kwargs)

        run_in_unit.__sac_unit__ = name
        return run_in_unit

    return decorate if fn is None else decorate(fn)


def open_units() -> list[str]:
    """The units open on this thread, outermost first."""
    return list(torch.ops.sac.open_units())
