"""Facts about one call that the C++ rule takes from the front doors that see calls in Python
(torch.compile's policy function, the dispatch-mode engine): the op's traits as the catalog
records them, whether this call draws random numbers, and whether it casts a parameter.
These are facts, not the rule: what follows from them is decided in C++ (docs/semantics.md)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import _native
from ._validation import op_spelling

__all__ = ["OpTraits", "casts_a_parameter", "draws_random", "op_traits"]

_aten = torch.ops.aten


class OpTraits(NamedTuple):
    collective: bool
    never_counted: bool
    random: bool
    mutates_inputs: bool
    view: bool
    dropout_argument: int  # index of dropout_p, or -1


@functools.lru_cache(maxsize=None)
def op_traits(op) -> OpTraits:
    """The very traits the C++ fallback decides with (the op catalog's), per overload."""
    return OpTraits(*_native.C.op_traits(op_spelling(op)))


def draws_random(traits: OpTraits, args, kwargs) -> bool:
    """Whether this call draws from a generator: a random op, or an attention op with dropout_p != 0."""
    if not traits.random:
        return False
    if traits.dropout_argument < 0:
        return True
    index = traits.dropout_argument
    value = args[index] if index < len(args) else kwargs.get("dropout_p", 0.0)
    return not isinstance(value, (int, float)) or value != 0


def casts_a_parameter(op, args) -> bool:
    """aten::_to_copy of a leaf that requires grad: autocast's weight cast (NOTE: [Autocast's
    weight casts] in csrc/ops/op_traits.h)."""
    return (
        op is _aten._to_copy.default
        and bool(args)
        and isinstance(args[0], torch.Tensor)
        and args[0].requires_grad
        and args[0].is_leaf
    )
