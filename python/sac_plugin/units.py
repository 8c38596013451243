"""Recompute units: named parts of a model that a policy can keep as a whole."""

from __future__ import annotations

import functools

import torch


def _check_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"sac_plugin: a recompute unit needs a non-empty str name such as 'attn', got {name!r}")
    return name


def _reject_under_compile(name: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"sac_plugin: recompute_unit('{name}') inside torch.compile is not supported: compiled "
            "regions carry their selection as op tags, and a unit would be silently dropped there. "
            "Keep the unit's ops by name (Policy(kept_ops=...)) or run the unit eagerly."
        )


class recompute_unit:
    """Context manager: ops run inside are part of unit `name` (units nest).

    with recompute_unit("attn"):
        out = attention(q, k, v)
    """

    __slots__ = ("_name", "_depths")

    def __init__(self, name: str):
        self._name = _check_name(name)
        self._depths: list[int] = []

    def __enter__(self):
        _reject_under_compile(self._name)
        self._depths.append(torch.ops.sac.push_unit(self._name))
        return self

    def __exit__(self, *exc_info):
        torch.ops.sac.pop_unit(self._name, self._depths.pop())
        return False


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
