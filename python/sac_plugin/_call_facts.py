"""Facts about one call that the C++ rule takes from the front doors that see calls in Python
(torch.compile's policy function, the dispatch-mode engine): the op's traits as the catalog
records them, whether this call draws random numbers, and whether it casts a parameter.
These are facts, not the rule: what follows from them is decided in C++ (docs/semantics.md), and
so are the two facts themselves, from the call's values (NOTE: [A call's facts are decided here]
in csrc/ops/op_traits.h); this module only hands C++ the op's traits and the call's arguments."""

from __future__ import annotations

import functools
from typing import NamedTuple

from . import _native
from ._validation import op_spelling

__all__ = ["OpTraits", "casts_a_parameter", "draws_random", "op_traits"]


class OpTraits(NamedTuple):
    collective: bool
    never_counted: bool
    random: bool
    mutates_inputs: bool
    view: bool
    dropout_argument: int  # index of dropout_p, or -1
    copy_cast: bool  # aten::_to_copy: a parameter cast when its source is a parameter


@functools.lru_cache(maxsize=None)
def op_traits(op) -> OpTraits:
    """The very traits the C++ fallback decides with (the op catalog's), per overload."""
    return OpTraits(*_native.C.op_traits(op_spelling(op)))


# draws_random(traits, args, kwargs) -> bool: whether a call of the op with `traits` (op_traits)
# draws from a generator: a random op, unless its dropout_p is 0 (an int 0 too, as Python has it).
draws_random = _native.C.draws_random
# casts_a_parameter(traits, args) -> bool: whether it is aten::_to_copy of a leaf that requires
# grad: autocast's weight cast (NOTE: [Autocast's weight casts] in csrc/ops/op_traits.h).
casts_a_parameter = _native.C.casts_a_parameter
