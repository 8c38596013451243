"""The fields of the planner's files (a plan's, a step plan's), declared once: each field's name,
the versions that have it, and the kind of value it accepts, checked by one loop
(check_object). Reading a file checks every field against its declaration, so a
malformed file fails with one message naming the field, what it holds and what it accepts; no
other exception escapes (a value too large for the library's int64, a float too large for a
float, a JSON text nested deeper than the parser recurses)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping

from .._validation import bounded_repr

INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a field accepts: `accepts` says it in words (for messages), `check` tests a value."""

    accepts: str
    check: Callable[[object], bool]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _is_int(value) or isinstance(value, float)


def _finite(value) -> bool:
    # An int too large for a float is not finite here: the planner computes in floats.
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


COUNT = Kind("an int from 0 to 2**63 - 1", lambda v: _is_int(v) and 0 <= v <= INT64_MAX)
SECONDS = Kind("a finite number >= 0", lambda v: _is_number(v) and _finite(v) and v >= 0)
RATE = Kind("a finite number of bytes per second > 0", lambda v: _is_number(v) and _finite(v) and v > 0)
TEXT = Kind("a string", lambda v: isinstance(v, str))
FLAG = Kind("true or false", lambda v: isinstance(v, bool))
LIST = Kind("a list", lambda v: isinstance(v, list))
OBJECT = Kind("an object", lambda v: isinstance(v, Mapping))
OPTIONAL_COUNT = Kind("null or an int from 0 to 2**63 - 1", lambda v: v is None or COUNT.check(v))
OPTIONAL_OBJECT = Kind("null or an object", lambda v: v is None or isinstance(v, Mapping))
CALL_KEY = Kind(
    "an [op, index] pair (a string and an int from 0 to 2**63 - 1)",
    lambda v: isinstance(v, list) and len(v) == 2 and TEXT.check(v[0]) and COUNT.check(v[1]),
)

UNITS = Kind(
    "a list of [name, recompute] pairs (a non-empty string, and null for a unit or true or false for a "
    "torch_remat region's flag)",
    lambda v: isinstance(v, list)
    and all(
        isinstance(u, list) and len(u) == 2 and isinstance(u[0], str) and u[0] and (u[1] is None or FLAG.check(u[1]))
        for u in v
    ),
)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    since: int = 1  # the first version that has it
    required: bool = True  # within the versions that have it


class FileError(Exception):
    """A field that does not match its declaration; the message names it."""


def described(value) -> str:
    """A value as a message shows it: bounded, and cheap however large or deeply nested."""
    return bounded_repr(value)


def check_object(value, fields: tuple[Field, ...], where: str, version: int) -> dict:
    """The fields of `value` (an object) that `version` has, each checked against its kind.
    `where` names the object in messages ("" for the file itself, "calls[3]")."""
    prefix = f"{where}." if where else ""
    if not isinstance(value, Mapping):
        raise FileError(f"{where or 'the plan'} must be an object, got {described(value)}")
    known = {f.name: f for f in fields if f.since <= version}
    for key in value:
        if key not in known:
            raise FileError(
                f"unknown key {described(key)}{' in ' + where if where else ''}; known keys in version "
                f"{version}: {', '.join(sorted(known))}"
            )
    checked = {}
    for field in known.values():
        if field.name not in value:
            if field.required:
                raise FileError(f"missing key {field.name!r}{' in ' + where if where else ''}")
            continue
        item = value[field.name]
        if not field.kind.check(item):
            raise FileError(f"{prefix}{field.name} must be {field.kind.accepts}, got {described(item)}")
        checked[field.name] = item
    return checked


def check_list(values: list, kind: Kind, name: str) -> list:
    for i, value in enumerate(values):
        if not kind.check(value):
            raise FileError(f"{name}[{i}] must be {kind.accepts}, got {described(value)}")
    return values


def parse(text: str):
    """The JSON value of a plan file's text; FileError for any text that is not JSON the planner
    can read (including one nested deeper than the parser recurses, or an int of more digits than
    Python converts)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise FileError(f"not valid JSON: {error}") from None
    except RecursionError:
        raise FileError(
            "not valid JSON for a plan: nested too deeply to read (a plan file nests 3 levels: "
            "the plan, its lists, their entries)"
        ) from None
    except ValueError as error:  # an int of more digits than Python converts
        raise FileError(f"not valid JSON for a plan: {error}") from None
