"""How a Python dispatch mode hands one call to the C++ engine and back: what the mode reads of
an op's schema once, the call's arguments split into tensors (named by data flow in C++) and
other values, and a served call's return value put together again. Shared by the dispatch-mode
engine (_dispatch_mode.py) and the native engine's recompute under other modes
(_mode_recompute.py), which both drive csrc/dispatch/mode_engine.cpp.
"""

from __future__ import annotations

import enum

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _current_dispatch_modes

from ._call_facts import op_traits
from ._native import ModeAction, ModePass

__all__ = [
    "ModeAction",
    "ModePass",
    "Op",
    "Slot",
    "assemble",
    "call_begin",
    "call_begin_all",
    "call_end",
    "flatten_arguments",
    "flatten_returns",
    "foreign_modes_on",
    "known_ops",
    "mode_op",
    "no_python_dispatch",
    "split_arguments",
]


class Slot(enum.IntEnum):
    """How an argument or a return travels to C++: tensors as they are, the rest stays here."""

    OTHER = 0
    TENSOR = 1
    TENSOR_LIST = 2
    OPTIONAL_TENSOR_LIST = 3


_OTHER, _TENSOR, _TENSOR_LIST, _OPTIONAL_TENSOR_LIST = (
    Slot.OTHER,
    Slot.TENSOR,
    Slot.TENSOR_LIST,
    Slot.OPTIONAL_TENSOR_LIST,
)

# Tensor types without a __torch_dispatch__ of their own, by type. A call on a subclass that has
# one goes to that subclass first (the mode answers NotImplemented), and the plain-tensor ops its
# handler makes come back to the mode: what the native engine sees, where torch's `Python` key
# sits above the plugin's.
_plain_types: dict = {}


def _is_plain(type_) -> bool:
    plain = _plain_types.get(type_)
    if plain is None:
        plain = _plain_types[type_] = type_.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    return plain


def _slot(type_) -> int:
    if isinstance(type_, torch._C.OptionalType):
        type_ = type_.getElementType()
    if isinstance(type_, torch._C.TensorType):
        return _TENSOR
    if isinstance(type_, torch._C.ListType):
        element = type_.getElementType()
        if isinstance(element, torch._C.TensorType):
            return _TENSOR_LIST
        if isinstance(element, torch._C.OptionalType) and isinstance(element.getElementType(), torch._C.TensorType):
            return _OPTIONAL_TENSOR_LIST
    return _OTHER


class Op:
    """What the mode needs of one op overload, read once per process."""

    __slots__ = ("handle", "arguments", "names", "returns", "traits", "random", "other_returns")

    def __init__(self, func):
        schema = func._schema
        self.traits = op_traits(func)  # what C++ tells a call's facts by (_call_facts.draws_random)
        self.random = self.traits.random  # only a random op's calls are asked whether they draw
        self.handle = torch.ops.sac.mode_op(schema.name, schema.overload_name)
        self.arguments = tuple(_slot(argument.type) for argument in schema.arguments)
        self.names = {argument.name: i for i, argument in enumerate(schema.arguments)}
        self.returns = tuple(_slot(value.type) for value in schema.returns)
        self.other_returns = _OTHER in self.returns


# op overload -> Op, or None for ops that never count; a mode reads it first, as
# `known_ops[func] if func in known_ops else mode_op(func)`, which costs no call per op.
known_ops: dict = {}
call_begin = torch.ops.sac.mode_call_begin.default
call_begin_all = torch.ops.sac.mode_call_begin_all.default
call_end = torch.ops.sac.mode_call_end.default
no_python_dispatch = torch._C._DisableTorchDispatch
_RUN_ONLY, _REDIRECTED = ModeAction.RUN_ONLY, ModeAction.REDIRECTED


def mode_op(func) -> Op | None:
    """What the mode needs of `func`, read once per op overload; None for an op that never counts."""
    # NOTE: [The plugin's own calls]: reading an op's traits dispatches sac ops no mode may see.
    with no_python_dispatch():
        op = None if op_traits(func).never_counted else Op(func)
    known_ops[func] = op
    return op


def flatten_arguments(op: Op, args, kwargs):
    """(tensors, their argument positions, the key of every other argument); None when a tensor
    is a subclass, False when a tensor sits where the schema takes none. The key folds the
    non-tensor arguments (with their positions) into one int for the call's data-flow identity; repr tells 1, 1.0 and True apart and has no
    hash collisions between small ints (hash(-1) == hash(-2)). An object whose repr is its address
    (a process group, the ReduceOp dist.all_reduce makes anew for every call) is named by its type
    alone, as the native engine names it (DataFlow::mixValue): an address would name the same call
    differently in the forward and the recompute."""
    split = split_arguments(op, args, kwargs)
    if not split:
        return split
    tensors, positions, others = split
    if not others:
        return tensors, positions, 0
    text = repr(others)
    if " at 0x" in text:
        text = repr([_by_kind(value) for value in others])
    return tensors, positions, hash(text)


def _by_kind(value):
    return type(value).__qualname__ if " at 0x" in repr(value) else value


def split_arguments(op: Op, args, kwargs):
    """(tensors, their argument positions, [position, value, ...] of every other argument given);
    None when a tensor is a subclass, False when a tensor sits where the schema takes none."""
    tensors: list = []
    positions: list = []
    others: list = []
    items = enumerate(args)
    if kwargs:
        names = op.names
        items = [*items, *sorted(((names[name], value) for name, value in kwargs.items()), key=lambda item: item[0])]
    slots = op.arguments
    for position, value in items:
        slot = slots[position]
        if slot == _TENSOR and isinstance(value, torch.Tensor):
            if not _is_plain(type(value)):
                return None
            tensors.append(value)
            positions.append(position)
        elif slot >= _TENSOR_LIST and value is not None:
            for element in value:
                if element is not None and not _is_plain(type(element)):
                    return None
                tensors.append(element)
                positions.append(position)
        elif isinstance(value, torch.Tensor):
            # A tensor where the schema takes no tensor (an `Any` argument): it has no data flow
            # to be named by, so the call is run, never kept or served.
            return False
        else:
            others.append(position)
            others.append(value)
    return tensors, positions, others


def replace_tensors(op: Op, args, kwargs, tensors):
    """args and kwargs with their tensors replaced, in the order split_arguments lists them, by
    `tensors` (NOTE: [The recompute writes nothing outside its region] in
    csrc/dispatch/outside_writes.cpp)."""
    slots = op.arguments
    replacements = iter(tensors)

    def replaced(position, value):
        slot = slots[position]
        if slot == _TENSOR and isinstance(value, torch.Tensor):
            return next(replacements)
        if slot >= _TENSOR_LIST and value is not None:
            return type(value)(next(replacements) for _ in value)
        return value

    new_args = tuple(replaced(position, value) for position, value in enumerate(args))
    if not kwargs:
        return new_args, kwargs
    names = op.names
    new_kwargs = dict(kwargs)
    for name, position in sorted(((name, names[name]) for name in kwargs), key=lambda item: item[1]):
        new_kwargs[name] = replaced(position, kwargs[name])
    return new_args, new_kwargs


def run_begun(region: int, op: Op, func, args, kwargs, action: int, tensors):
    """Runs a call the region began and did not serve: on the tensors that came back with the
    answer where it says REDIRECTED (NOTE: [The recompute writes nothing outside its region] in
    csrc/dispatch/outside_writes.cpp), then records (and keeps) its outputs unless it says RUN_ONLY.
    Returns the call's result and the action without REDIRECTED."""
    if action & _REDIRECTED:
        args, kwargs = replace_tensors(op, args, kwargs, tensors)
        action &= ~_REDIRECTED
    out = func(*args, **kwargs)
    if action != _RUN_ONLY:
        out_tensors, out_positions = flatten_returns(op, out)
        with no_python_dispatch():
            call_end(region, out_tensors, out_positions)
    return out, action


def flatten_returns(op: Op, out):
    values = (out,) if len(op.returns) == 1 else (out or ())
    tensors: list = []
    positions: list = []
    for position, (slot, value) in enumerate(zip(op.returns, values)):
        if slot == _TENSOR:
            tensors.append(value)
            positions.append(position)
        elif slot >= _TENSOR_LIST and value is not None:
            for element in value:
                tensors.append(element)
                positions.append(position)
    return tensors, positions


def assemble(op: Op, served, counts, other_value):
    """A served call's return value from its tensors (flat, `counts` per return) and
    `other_value(position)` for each return that is not a tensor."""
    values = []
    next_tensor = 0
    for position, (slot, count) in enumerate(zip(op.returns, counts)):
        if slot == _TENSOR:
            values.append(served[next_tensor])
            next_tensor += 1
        elif slot >= _TENSOR_LIST:
            values.append(list(served[next_tensor : next_tensor + count]))
            next_tensor += count
        else:
            values.append(other_value(position))
    if len(values) == 1:
        return values[0]
    return tuple(values) if values else None


_OWN_MODULES = f"{__package__}."


# torch's tracing modes (torch.compile's and export's fake, functional and proxy modes): under them
# values are fake and the compiler decides what is saved, so they are no reason to keep above modes.
_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, key) for key in ("FAKE", "FUNCTIONAL", "PROXY"))


def foreign_modes_on() -> bool:
    """Whether a TorchDispatchMode other than the plugin's own (the per-op trace) is on, outside
    torch's tracing."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    if any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES):
        return False
    return not all(type(mode).__module__.startswith(_OWN_MODULES) for mode in _current_dispatch_modes())
