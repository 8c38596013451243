"""Checks and message helpers shared by every module that validates a caller's argument: bounded
reprs for messages, op and unit name checks that mirror the C++ bounds, op lookup by name, and the
checks of the fields a Policy and a RecomputeConfig share.

NOTE: [One check per field]
Each field a Policy and a RecomputeConfig share (kept_ops, kept_units, every_nth_op,
recomputed_units, offloaded_ops, offloaded_units, offload_min_bytes, host_memory_limit,
pin_routing, offload_inputs) is checked by one function here, with one message that names the
field as both spell it; a config reports it as a ConfigError under its own prefix. These checks
are about the value's form (types, ranges, text). What a value means (an op that exists, that the
keep rule may keep, one rule per op, a unit kept and offloaded) is checked once, by the C++ policy
(csrc/policy/policy.cpp), when the Policy is made.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping

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
        if not op:
            raise ValueError(f"sac_plugin: {where}: an op name is a non-empty str such as 'aten::mm', got ''")
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _collection(values, field: str, example: str) -> list:
    if isinstance(values, (str, bytes, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(
            f"sac_plugin: {field} must be a collection of names, not a single {type(values).__name__}: "
            f"{bounded_repr(values)}; write [{bounded_repr(values)}]"
        )
    if isinstance(values, Mapping) or not isinstance(values, Iterable):
        raise TypeError(
            f"sac_plugin: {field} must be a collection of names such as {example}, got {describe_value(values)}"
        )
    return list(values)


def op_names(values, field: str) -> list[str]:
    """The plugin's spellings of a collection of ops (names or OpOverloads), in the given order."""
    return [op_spelling(op, f"{field}[{i}]") for i, op in enumerate(_collection(values, field, "['aten::mm']"))]


def unit_names(values, field: str) -> list[str]:
    """A collection of unit names or patterns, each checked as check_unit_name checks one."""
    return [check_unit_name(unit, f"{field}[{i}]") for i, unit in enumerate(_collection(values, field, "['attn']"))]


def _keyed_by_op(rules, field: str, accepted: str) -> list:
    """The (op spelling, value) pairs of a rule keyed by op, such as {op: n}; None is no rule."""
    if rules is None:
        return []
    if not isinstance(rules, Mapping):
        raise TypeError(f"sac_plugin: {field} must be a mapping from op to {accepted}, got {describe_value(rules)}")
    return [(op_spelling(op, f"{field} key"), value) for op, value in rules.items()]


def every_nth_rules(every_nth_op, field: str = "every_nth_op") -> dict[str, int]:
    """{op spelling: n} from {op: n}; None is no rule."""
    rules: dict[str, int] = {}
    for spelling, n in _keyed_by_op(every_nth_op, field, "n such as {'aten::mm': 2}"):
        if not _is_int(n) or not 1 <= n <= MAX_EVERY_NTH:
            raise (ValueError if _is_int(n) else TypeError)(
                f"sac_plugin: {field}[{spelling!r}] must be an int from 1 to 2**63 - 1 (2 keeps every "
                f"other call), got {describe_value(n)}"
            )
        if rules.get(spelling, n) != n:
            raise ValueError(
                f"sac_plugin: {field} names {spelling!r} twice, with n = {rules[spelling]} and n = {n}; "
                "give each op one n"
            )
        rules[spelling] = n
    return rules


def call_rules(calls, field: str) -> dict[str, tuple[int, ...]]:
    """{op spelling: call indices} as the C++ side takes it: indices sorted, repeats merged, empty
    lists dropped; None is no rule."""
    rules: dict[str, tuple[int, ...]] = {}
    for spelling, indices in _keyed_by_op(calls, field, "call indices such as {'aten::mm.default': [0, 2]}"):
        if isinstance(indices, (str, bytes, Mapping)) or not isinstance(indices, Iterable):
            raise TypeError(
                f"sac_plugin: {field}[{spelling!r}] must be a collection of 0-based call indices such as [0, 2], "
                f"got {describe_value(indices)}"
            )
        indices = list(indices)
        for index in indices:
            if not _is_int(index) or not 0 <= index <= MAX_EVERY_NTH:
                raise (ValueError if _is_int(index) else TypeError)(
                    f"sac_plugin: {field}[{spelling!r}]: a call index is an int from 0 to 2**63 - 1 (0 is the "
                    f"op's first call in the region), got {describe_value(index)}"
                )
        if spelling in rules:
            raise ValueError(f"sac_plugin: {field} names {spelling!r} twice; give each op one list of calls")
        if indices:
            rules[spelling] = tuple(sorted(set(indices)))
    return rules


def byte_count(value, field: str, *, allow_none: bool) -> int | None:
    """A byte count as C++ takes it (int64), or None where None (no limit) is allowed."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_EVERY_NTH:
        accepted = "an int from 0 to 2**63 - 1" + (", or None for no limit" if allow_none else "")
        raise (ValueError if _is_int(value) else TypeError)(
            f"sac_plugin: {field} is a byte count, {accepted}; got {describe_value(value)}"
        )
    return value


def flag(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"sac_plugin: {field} must be True or False, got {describe_value(value)}")
    return value


def without_library_prefix(error: Exception) -> str:
    """An error's message without the library's prefix ("sac_plugin: " from Python, "sac: " from
    C++), for a caller that reports it under its own (a config's "recompute config: ")."""
    text = str(error)
    for prefix in ("sac_plugin: ", "sac: "):
        text = text.removeprefix(prefix)
    return text
