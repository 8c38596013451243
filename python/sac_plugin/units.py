"""Recompute units: named parts of a model that a policy can keep as a whole."""

from __future__ import annotations

import functools

import torch


def _check_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"sac_plugin: a recompute unit needs a non-empty str name such as 'attn', got {name!r}")
    return name


# Under torch.compile a unit is carried as node metadata: torch.fx.traceback.annotate writes
# node.meta["custom"], and the policy function that tags nodes for the partitioner reads it back
# from fx_traceback.current_meta while AOTAutograd traces the checkpointed region (see
# checkpointing.torch_policy_fn). One key per unit, so nested units accumulate.
UNIT_ANNOTATION_PREFIX = "sac_unit:"


class _UnitScope:
    """Eager: opens the unit on this thread's C++ unit stack (units nest)."""

    __slots__ = ("_name", "_depths")

    def __init__(self, name: str):
        self._name = name
        self._depths: list[int] = []

    def __enter__(self):
        self._depths.append(torch.ops.sac.push_unit(self._name))
        return self

    def __exit__(self, *exc_info):
        torch.ops.sac.pop_unit(self._name, self._depths.pop())
        return False


def recompute_unit(name: str):
    """Context manager: ops run inside are part of unit `name` (units nest).

    with recompute_unit("attn"):
        out = attention(q, k, v)

    Eager code opens the unit in C++; inside torch.compile the unit becomes node metadata that
    the compiled region's selection honours.
    """
    _check_name(name)
    if torch.compiler.is_compiling():
        return torch.fx.traceback.annotate({UNIT_ANNOTATION_PREFIX + name: True})
    return _UnitScope(name)


def in_recompute_unit(name: str, fn=None):
    """Runs a callable inside unit `name`: a decorator, or `in_recompute_unit(name, fn)`."""
    _check_name(name)

    def decorate(function):
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
