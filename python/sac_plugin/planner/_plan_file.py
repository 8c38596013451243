"""The files a Plan and a StepPlan save and load: their formats and versions, their fields declared
once (each checked against its declaration by _fields.py), the JSON written, and what a file must
hold beyond the kinds of its fields: each call listed once, kept and offloaded calls that were
profiled and may be held, an offload model for any offloaded call; a step plan's windows in the
order the step runs them, and each of its layers' plans a plan file's object."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from .. import _rule
from .._validation import bounded_repr, describe_value
from . import _fields
from ._cost import OffloadModel, PlanError, call_key, check_budget
from ._profile import LayerProfile, ProfiledCall

FORMAT = "sac_plugin.plan"
VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
STEP_FORMAT = "sac_plugin.step_plan"
STEP_VERSION = 1
STEP_READABLE_VERSIONS = (1,)
# A step plan's windows, in the order the step runs them: each layer's forward, the head (the
# loss and its backward), each layer's backward.
WINDOW_KINDS = ("forward", "head", "backward")

# The fields every file of the planner opens with (_header writes them): name, kind, first version.
_HEADER_FIELDS = (
    _fields.Field("format", _fields.TEXT),
    _fields.Field("version", _fields.COUNT),
    _fields.Field("torch", _fields.TEXT, required=False),
)
# The plan file's fields.
_PLAN_FIELDS = (
    *_HEADER_FIELDS,
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
# The step plan file's fields.
_STEP_FIELDS = (
    *_HEADER_FIELDS,
    _fields.Field("peak_bytes", _fields.COUNT),
    _fields.Field("measured_peak", _fields.OPTIONAL_COUNT),
    _fields.Field(
        "measured_windows",
        _fields.Kind(
            "null or a list of ints from 0 to 2**63 - 1",
            lambda v: v is None or (isinstance(v, list) and all(_fields.COUNT.check(x) for x in v)),
        ),
    ),
    _fields.Field("offload", _fields.FLAG),
    _fields.Field("windows", _fields.LIST),
    _fields.Field("layers", _fields.LIST),
)
# The fields of the objects the files nest, by the field that holds them: a plan's calls and
# offload model, a step plan's windows and layers.
_ENTRY_FIELDS = {
    "calls": (
        _fields.Field("op", _fields.TEXT),
        _fields.Field("index", _fields.COUNT),
        _fields.Field("unit", _fields.TEXT),
        _fields.Field("bytes", _fields.COUNT),
        _fields.Field("seconds", _fields.SECONDS),
        _fields.Field("not_keepable", _fields.TEXT),
        _fields.Field("recomputed", _fields.FLAG),
        _fields.Field("units", _fields.UNITS, since=4),
    ),
    "offload": (
        _fields.Field("d2h_bytes_per_s", _fields.RATE),
        _fields.Field("h2d_bytes_per_s", _fields.RATE),
        _fields.Field("min_bytes", _fields.COUNT),
        _fields.Field("host_memory_limit", _fields.OPTIONAL_COUNT),
    ),
    "windows": (
        _fields.Field("kind", _fields.Kind("one of 'forward', 'head', 'backward'", lambda v: v in WINDOW_KINDS)),
        _fields.Field("layer", _fields.OPTIONAL_COUNT),
        _fields.Field("peak", _fields.COUNT),
    ),
    "layers": (
        _fields.Field("name", _fields.TEXT),
        _fields.Field("offload_inputs", _fields.FLAG),
        _fields.Field("input_bytes", _fields.COUNT),
        _fields.Field("plan", _fields.OBJECT),
    ),
}


@dataclasses.dataclass(frozen=True)
class PlanContents:
    """What a plan file holds, checked: enough to make the Plan it was saved from."""

    profile: LayerProfile
    budget: int | float
    kept: frozenset[tuple[str, int]]
    offloaded: frozenset[tuple[str, int]]
    offload: OffloadModel | None


@dataclasses.dataclass(frozen=True)
class StepPlanContents:
    """What a step plan file holds, checked: each window as (kind, layer, peak) and each layer as
    (name, plan, offload_inputs, input_bytes), its plan read by the caller's reader."""

    peak_bytes: int
    windows: tuple[tuple[str, int | None, int], ...]
    layers: tuple[tuple[str, object, bool, int], ...]
    measured_peak: int | None
    measured_windows: tuple[int, ...] | None
    offload: bool


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
        **_header(FORMAT, VERSION),
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


def _header(format: str, version: int) -> dict:
    """The fields every file of the planner opens with: its format, its version and the torch that wrote it."""
    return {"format": format, "version": version, "torch": torch.__version__.split("+")[0]}


def _check_header(data, format: str, readable_versions: tuple[int, ...], noun: str) -> int:
    """The version of a file's object, once its format is `format` and its version one of
    `readable_versions` (`noun`: "plan", "step plan", for messages)."""
    fail = _fields.FileError
    if not isinstance(data, Mapping):
        raise fail(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != format:
        raise fail(f"'format' must be {format!r}, got {bounded_repr(data.get('format'))}: not a sac_plugin {noun}")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in readable_versions:
        raise fail(
            f"version {bounded_repr(version)} is not supported; this sac_plugin reads versions "
            f"{', '.join(map(str, readable_versions))}"
        )
    return version


def plan_contents(data) -> PlanContents:
    """The contents of a plan's dict form, in any readable version, each field checked against its
    declaration and the fields against each other; a _fields.FileError names what is wrong."""
    fail = _fields.FileError
    version = _check_header(data, FORMAT, READABLE_VERSIONS, "plan")
    fields = _fields.check_object(data, _PLAN_FIELDS, "", version)
    try:
        budget = check_budget(fields["budget"], "budget", int_is_bytes=True)
    except (TypeError, ValueError) as error:
        raise fail(str(error).removeprefix("sac_plugin: ")) from None
    calls = []
    for i, call in enumerate(fields["calls"]):
        c = _fields.check_object(call, _ENTRY_FIELDS["calls"], f"calls[{i}]", version)
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
            model = _fields.check_object(fields["offload"], _ENTRY_FIELDS["offload"], "offload", version)
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


def path_of(path, where: str) -> Path:
    """`path` as a Path, once it is one (`where`: the method, "Plan.save", for the message)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"sac_plugin: {where} expects a path (str or os.PathLike), got {describe_value(path)}")
    return Path(path)


def step_plan_to_dict(step_plan) -> dict:
    """A StepPlan as the current version of the step plan file writes it, each layer's plan as its
    to_dict writes it."""
    measured = step_plan.measured_windows
    return {
        **_header(STEP_FORMAT, STEP_VERSION),
        "peak_bytes": step_plan.peak_bytes,
        "measured_peak": step_plan.measured_peak,
        "measured_windows": None if measured is None else list(measured),
        "offload": step_plan.offload,
        "windows": [{"kind": w.kind, "layer": w.layer, "peak": w.peak} for w in step_plan.windows],
        "layers": [
            {"name": c.name, "offload_inputs": c.offload_inputs, "input_bytes": c.input_bytes, "plan": c.plan.to_dict()}
            for c in step_plan.layers
        ],
    }


def step_plan_contents(data, where: str, read_plan: Callable[[object, str], object]) -> StepPlanContents:
    """The contents of a step plan's dict form, each field checked against its declaration and the
    fields against each other; each layer's plan is `read_plan(data, where)` (Plan.from_dict), whose
    PlanError becomes a _fields.FileError naming the layer, as every other fault is."""
    fail = _fields.FileError
    version = _check_header(data, STEP_FORMAT, STEP_READABLE_VERSIONS, "step plan")
    fields = _fields.check_object(data, _STEP_FIELDS, "", version)
    if fields["peak_bytes"] < 1:
        raise fail(f"peak_bytes must be an int >= 1, got {fields['peak_bytes']}")
    layers = []
    for i, entry in enumerate(fields["layers"]):
        layer = _fields.check_object(entry, _ENTRY_FIELDS["layers"], f"layers[{i}]", version)
        try:
            layer_plan = read_plan(layer["plan"], f"{where}: layers[{i}].plan")
        except PlanError as error:
            raise fail(str(error).removeprefix(f"sac_plugin: {where}: ")) from None
        if layer["offload_inputs"] and layer_plan.offload is None:
            raise fail(f"layers[{i}] offloads its inputs but its plan has no offload model")
        layers.append((layer["name"], layer_plan, layer["offload_inputs"], layer["input_bytes"]))
    if not layers:
        raise fail("layers is empty: a step plan plans at least one layer")
    names = [name for name, *_ in layers]
    if len(set(names)) != len(names):
        raise fail("layers names one layer twice")
    windows = []
    for i, entry in enumerate(fields["windows"]):
        w = _fields.check_object(entry, _ENTRY_FIELDS["windows"], f"windows[{i}]", version)
        windows.append((w["kind"], w["layer"], w["peak"]))
    forward, head, backward = WINDOW_KINDS
    expected = (
        [(forward, j) for j in range(len(layers))]
        + [(head, None)]
        + [(backward, j) for j in range(len(layers) - 1, -1, -1)]
    )
    if [(kind, layer) for kind, layer, _ in windows] != expected:
        raise fail(
            f"windows must be, in order, the forward of each of the {len(layers)} layers, the head and "
            "each layer's backward in reverse"
        )
    seen = fields["measured_windows"]
    if seen is not None and len(seen) != len(windows):
        raise fail(f"measured_windows has {len(seen)} peaks for {len(windows)} windows")
    return StepPlanContents(
        fields["peak_bytes"],
        tuple(windows),
        tuple(layers),
        fields["measured_peak"],
        None if seen is None else tuple(seen),
        fields["offload"],
    )


__all__ = [
    "FORMAT",
    "READABLE_VERSIONS",
    "STEP_FORMAT",
    "STEP_READABLE_VERSIONS",
    "STEP_VERSION",
    "VERSION",
    "WINDOW_KINDS",
    "PlanContents",
    "StepPlanContents",
    "path_of",
    "plan_contents",
    "plan_to_dict",
    "read_plan_file",
    "step_plan_contents",
    "step_plan_to_dict",
    "write_plan_file",
]
