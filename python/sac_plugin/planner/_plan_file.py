"""The file a Plan saves and loads: its format and versions, its fields declared once (each
checked against its declaration by _fields.py), the JSON written, and what a file must hold
beyond the kinds of its fields: each call listed once, kept and offloaded calls that were profiled
and may be held, an offload model for any offloaded call."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from .. import _rule
from .._validation import bounded_repr
from . import _fields
from ._cost import OffloadModel, PlanError, call_key, check_budget
from ._profile import LayerProfile, ProfiledCall

FORMAT = "sac_plugin.plan"
VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)

# The plan file's fields: name, kind, first version.
_PLAN_FIELDS = (
    _fields.Field("format", _fields.TEXT),
    _fields.Field("version", _fields.COUNT),
    _fields.Field("torch", _fields.TEXT, required=False),
    _fields.Field(
        "budget",
        _fields.Kind(
            "a fraction (a float from 0.0 to 1.0) or a byte count (an int >= 0)",
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        ),
    ),
    _fields.Field("no_checkpoint_bytes", _fields.COUNT),
    _fields.Field("full_recompute_bytes", _fields.COUNT),
    _fields.Field("rng_state_bytes", _fields.COUNT, since=3),
    _fields.Field("runs", _fields.COUNT),
    _fields.Field("calls", _fields.LIST),
    _fields.Field("kept", _fields.LIST),
    _fields.Field("offload", _fields.OPTIONAL_OBJECT, since=2),
    _fields.Field("offloaded", _fields.LIST, since=2),
)
_CALL_FIELDS = (
    _fields.Field("op", _fields.TEXT),
    _fields.Field("index", _fields.COUNT),
    _fields.Field("unit", _fields.TEXT),
    _fields.Field("bytes", _fields.COUNT),
    _fields.Field("seconds", _fields.SECONDS),
    _fields.Field("not_keepable", _fields.TEXT),
    _fields.Field("recomputed", _fields.FLAG),
    _fields.Field("units", _fields.UNITS, since=4),
)
_OFFLOAD_FIELDS = (
    _fields.Field("d2h_bytes_per_s", _fields.RATE),
    _fields.Field("h2d_bytes_per_s", _fields.RATE),
    _fields.Field("min_bytes", _fields.COUNT),
    _fields.Field("host_memory_limit", _fields.OPTIONAL_COUNT),
)


@dataclasses.dataclass(frozen=True)
class PlanContents:
    """What a plan file holds, checked: enough to make the Plan it was saved from."""

    profile: LayerProfile
    budget: int | float
    kept: frozenset[tuple[str, int]]
    offloaded: frozenset[tuple[str, int]]
    offload: OffloadModel | None


def plan_to_dict(
    profile: LayerProfile,
    budget,
    kept: frozenset[tuple[str, int]],
    offloaded: frozenset[tuple[str, int]],
    offload: OffloadModel | None,
) -> dict:
    """A plan as the current version of the file writes it."""
    p = profile
    offload = None if offload is None else dataclasses.asdict(offload)
    return {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch.__version__.split("+")[0],
        "budget": budget,
        "no_checkpoint_bytes": p.no_checkpoint_bytes,
        "full_recompute_bytes": p.full_recompute_bytes,
        "rng_state_bytes": p.rng_state_bytes,
        "runs": p.runs,
        "calls": [
            {
                "op": c.op,
                "index": c.index,
                "unit": c.unit,
                "bytes": c.bytes,
                "seconds": c.seconds,
                "not_keepable": c.why_not_keepable,
                "recomputed": c.recomputed,
                "units": [_unit_to_list(unit) for unit in c.units],
            }
            for c in p.calls
        ],
        "kept": [[op, index] for op, index in sorted(kept)],
        "offload": offload,
        "offloaded": [[op, index] for op, index in sorted(offloaded)],
    }


def _unit_to_list(unit) -> list:
    """A call's open unit as the file holds it: [name, null] for a unit, [name, flag] for a
    torch_remat region's opening with its recompute= flag."""
    if type(unit) is _rule.RegionOpening:
        return [unit.name, unit.recompute]
    return [unit, None]


def _unit_from_list(pair):
    name, recompute = pair
    return name if recompute is None else _rule.RegionOpening(name, recompute)


def plan_contents(data) -> PlanContents:
    """The contents of a plan's dict form, in any readable version, each field checked against its
    declaration and the fields against each other; a _fields.FileError names what is wrong."""
    fail = _fields.FileError
    if not isinstance(data, Mapping):
        raise fail(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise fail(f"'format' must be {FORMAT!r}, got {bounded_repr(data.get('format'))}: not a sac_plugin plan")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        raise fail(
            f"version {bounded_repr(version)} is not supported; this sac_plugin reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    fields = _fields.check_object(data, _PLAN_FIELDS, "", version)
    try:
        budget = check_budget(fields["budget"], "budget", int_is_bytes=True)
    except (TypeError, ValueError) as error:
        raise fail(str(error).removeprefix("sac_plugin: ")) from None
    calls = []
    for i, call in enumerate(fields["calls"]):
        c = _fields.check_object(call, _CALL_FIELDS, f"calls[{i}]", version)
        units = tuple(_unit_from_list(unit) for unit in c["units"]) if "units" in c else None
        innermost = units[-1] if units else None
        if units is not None and c["unit"] != (
            innermost.name if type(innermost) is _rule.RegionOpening else innermost or ""
        ):
            raise fail(
                f"calls[{i}].unit is {c['unit']!r}, but the innermost of its units is {bounded_repr(c['units'])}"
            )
        calls.append(
            ProfiledCall(
                c["op"],
                c["index"],
                c["unit"],
                c["bytes"],
                float(c["seconds"]),
                c["not_keepable"],
                c["recomputed"],
                units,
            )
        )
    by_key = {call_key(c): c for c in calls}
    if len(by_key) != len(calls):
        raise fail("calls lists one (op, index) twice")

    def call_keys(name: str) -> set[tuple[str, int]]:
        keys = set()
        for i, pair in enumerate(_fields.check_list(fields[name], _fields.CALL_KEY, name)):
            call = by_key.get(tuple(pair))
            if call is None:
                raise fail(f"{name}[{i}] = {bounded_repr(pair)} is not a profiled call")
            if not call.keepable:
                raise fail(f"{name}[{i}] = {bounded_repr(pair)} cannot be {name}: {call.why_not_keepable}")
            keys.add(tuple(pair))
        return keys

    kept = call_keys("kept")
    offload, offloaded = None, set()
    if version >= 2:
        if fields["offload"] is not None:
            model = _fields.check_object(fields["offload"], _OFFLOAD_FIELDS, "offload", version)
            offload = OffloadModel(
                float(model["d2h_bytes_per_s"]),
                float(model["h2d_bytes_per_s"]),
                model["min_bytes"],
                model["host_memory_limit"],
            )
        offloaded = call_keys("offloaded")
        if offloaded and offload is None:
            raise fail("'offloaded' lists calls but 'offload' is null: an offloaded call needs the offload model")
        for pair in sorted(offloaded):
            if pair in kept:
                raise fail(f"{list(pair)!r} is both kept and offloaded")
            why = offload.why_not_offloadable(by_key[pair])
            if why:
                raise fail(f"offloaded {list(pair)!r} cannot be offloaded: {why}")
    rng_state = fields.get("rng_state_bytes", 0)
    if rng_state > fields["full_recompute_bytes"]:
        raise fail(
            f"rng_state_bytes ({rng_state}) is part of full_recompute_bytes "
            f"({fields['full_recompute_bytes']}), so it cannot be larger"
        )
    profile = LayerProfile(
        tuple(calls), fields["no_checkpoint_bytes"], fields["full_recompute_bytes"], fields["runs"], rng_state
    )
    return PlanContents(profile, budget, frozenset(kept), frozenset(offloaded), offload)


def write_plan_file(path: Path, data: dict) -> Path:
    """Writes a plan's to_dict form as the JSON text read_plan_file reads; returns the path."""
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def read_plan_file(path: Path, what: str) -> dict:
    """The data of the plan file at `path` (`what`: "plan file", "step plan file", for messages),
    parsed by _fields; anything unreadable or malformed is a PlanError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"sac_plugin: {what} {path}: cannot read it: {error}") from None
    try:
        return _fields.parse(text)
    except _fields.FileError as error:
        raise PlanError(f"sac_plugin: {what} {path}: {error}") from None
