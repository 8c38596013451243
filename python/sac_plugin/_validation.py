"""Checks and message helpers shared by every module that validates a caller's argument: bounded
reprs for messages, op and unit name checks that mirror the C++ bounds, and op lookup by name."""

from __future__ import annotations

import reprlib

import torch

# Mirrors of the C++ bounds (kMaxOpNameLength in op_resolution.h, kMaxUnitNameLength in
# unit_stack.h), checked here first so that the message names the argument.
MAX_OP_NAME_LENGTH = 1024
MAX_UNIT_NAME_LENGTH = 256
# every_nth_op's n travels to C++ as int64 and is stored exactly.
MAX_EVERY_NTH = 2**63 - 1

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlevel = 2
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 4


def bounded_repr(value) -> str:
    """repr(value), cut short: a huge or deeply nested value (a YAML alias bomb) costs nothing."""
    return _short.repr(value)


def describe_value(value) -> str:
    """What a caller passed, for messages: a bounded repr (a huge or deeply nested value costs
    nothing) and its type."""
    return f"{_short.repr(value)} ({type(value).__name__})"


def _check_text(name: str, where: str, what: str, limit: int, why: str = "") -> str:
    """Refuses names the C++ side could not report faithfully or would keep forever."""
    if "\x00" in name:
        raise ValueError(f"sac_plugin: {where}: {what} cannot contain a NUL character, got {_short.repr(name)}")
    if len(name) > limit:
        raise ValueError(
            f"sac_plugin: {where}: {what} has at most {limit} characters{why}, got one of {len(name)}: "
            f"{_short.repr(name)}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"sac_plugin: {where}: {what} must be valid Unicode text, got {_short.repr(name)}") from None
    return name


def op_spelling(op, where: str = "op") -> str:
    """The plugin's spelling of an op: "aten::mm.default" for an overload, "aten::mm" for a packet."""
    if isinstance(op, str):
        return _check_text(op, where, "an op name", MAX_OP_NAME_LENGTH)
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise TypeError(
        f"sac_plugin: {where}: expected an op name such as 'aten::mm.default' or an op such as "
        f"torch.ops.aten.mm.default, got {describe_value(op)}"
    )


def check_unit_name(name, where: str) -> str:
    """A unit name as recompute_unit and policies accept it; the plain str of a StrEnum member."""
    if not isinstance(name, str):
        raise TypeError(
            f"sac_plugin: {where}: a recompute unit name is a str such as 'attn', got {describe_value(name)}"
        )
    if not name:
        raise ValueError(f"sac_plugin: {where}: a recompute unit needs a non-empty str name such as 'attn', got ''")
    _check_text(
        name, where, "a recompute unit name", MAX_UNIT_NAME_LENGTH, " (names are kept for the life of the process)"
    )
    return str(name)


def overload_of(name: str) -> torch._ops.OpOverload:
    """torch.ops.aten.mm.out for "aten::mm.out", torch.ops.aten.mm.default for "aten::mm"."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
