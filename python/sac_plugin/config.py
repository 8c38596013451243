"""Recompute configs: what a training config file says about checkpointing (applying one is
sac_plugin.apply_recompute_config).

A config speaks Policy's vocabulary: kept_units, kept_ops, every_nth_op, recomputed_units,
offloaded_units, offloaded_ops, offload_min_bytes, host_memory_limit, pin_routing and
offload_inputs mean what the Policy arguments of those names mean, and are checked by the same
checks with the same messages (NOTE: [One check per field] in _validation.py). Everything unset
keeps nothing: an unset config is full recompute of every layer, so it can never raise peak memory.

    {"kept_units": ["attn"], "kept_ops": [], "every_nth_op": {"aten::mm": 2}, "every_nth_layer": 1,
     "first_layer": 0, "layer_ratio": null, "force_recompute_modules": [], "recomputed_units": [],
     "preserve_rng_state": true, "budget": null, "peak_bytes": null, "offloaded_units": [],
     "offloaded_ops": [], "offload_min_bytes": 1048576, "host_memory_limit": null,
     "pin_routing": true, "offload_inputs": false}

A config adds one thing to a policy's units: a name the catalog holds (a RecomputeUnit value such
as "attn") in kept_units or offloaded_units means what the model's target map says it means (ops,
or callables the layers run in that unit), and the map must declare it. Every other name or
pattern passes to the policy as written: a unit the model's code opens (a torch_remat region, a
recompute_unit block), by name or by pattern as torchtitan's region patterns ("*",
"*routed_experts.w13.*"). recomputed_units always pass as written.

Deprecated names are read for one more release, with a FutureWarning: units and regions
(kept_units), ops (kept_ops), recomputed_regions (recomputed_units) and offloaded_regions
(offloaded_units).

Which wrap sites (layers, counted from 0) are checkpointed: every_nth_layer=n with first_layer=f
takes f, f+n, f+2n, ... (the default f=0 takes 0, n, 2n, ...: n=2 of 4 layers is 0 and 2);
first_layer=n-1 is the other convention, Modalities' ac_freq=n (n=2 of 4 layers is 1 and 3).
layer_ratio=r takes round(r * count) layers (at least one) spread evenly from layer 0:
layer floor(i * count / chosen) for i = 0 .. chosen-1 (0.5 of 4 is 0 and 2).

A `budget` (a fraction of the checkpointed layers' no-checkpointing activation bytes, or bytes)
replaces the hand-written selection: the plugin profiles the layers and keeps what saves the most
recompute time within it (sac_plugin.plan), so kept_units, kept_ops, every_nth_op,
force_recompute_modules and the other hand-written selections stay unset.

A `peak_bytes` (an int) bounds the device's peak allocated bytes over a whole training step
instead: applying the config needs the step (apply_recompute_config(..., step=...)), which
sac_plugin.plan_step profiles and measures; it leaves the hand-written selection and budget unset
the same way. With peak_bytes, offload_inputs lets the plan offload (plan_step's offload=True: the
layers' inputs and kept calls, where that lowers the step's peak); a budget never offloads the
inputs, so budget and offload_inputs together are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence, Sized
from pathlib import Path

from . import _renamed_fields, _validation
from ._renamed_fields import RENAMED_FIELDS
from ._validation import bounded_repr, describe_value, without_library_prefix
from .units import RecomputeUnit

__all__ = ["ConfigError", "RecomputeConfig"]

# A force-recomputed module runs in a unit of this prefix and its path, which the policy recomputes.
RECOMPUTE_UNIT_PREFIX = "recompute:"


class ConfigError(ValueError):
    """A recompute config that cannot be applied; the message names the field."""


# What a hand-written selection sets, in field order: a budget or a peak chooses by measurement instead.
_HAND_SELECTION_FIELDS = (
    "kept_units",
    "kept_ops",
    "every_nth_op",
    "force_recompute_modules",
    "recomputed_units",
    "offloaded_units",
    "offloaded_ops",
)
_CATALOG_UNITS = {unit.value: unit for unit in RecomputeUnit}
# The fields that list op or unit names, each with the check Policy gives its field of that name.
_NAME_LIST_FIELDS = {
    "kept_units": _validation.unit_names,
    "kept_ops": _validation.op_names,
    "recomputed_units": _validation.unit_names,
    "offloaded_units": _validation.unit_names,
    "offloaded_ops": _validation.op_names,
}


def _import_yaml(where: str):
    """pyyaml, an optional dependency: missing, the error names the extra that installs it."""
    try:
        import yaml
    except ImportError:
        raise ImportError(
            f"sac_plugin: RecomputeConfig.{where} needs pyyaml, which is not installed: pip install sac_plugin[yaml]"
        ) from None
    return yaml


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """What a training config file says about checkpointing; every field is checked on construction.

    Unset, a config keeps nothing: full recompute of every layer. The fields select what the
    checkpointed layers keep (kept_units, kept_ops, every_nth_op), offload (offloaded_*), force to
    recompute, and which layers are checkpointed; a `budget` or a `peak_bytes` chooses by
    measurement instead of by hand. The fields named as `Policy`'s arguments mean what they mean
    there. `sac_plugin.apply_recompute_config` applies one to a model.

    Deprecated names are still taken, as keywords, file keys and attributes, with a FutureWarning,
    for one more release: units and regions (kept_units), ops (kept_ops), recomputed_regions
    (recomputed_units) and offloaded_regions (offloaded_units).

    Args:
        kept_units: Units inside which every op is kept. A catalog name (`RecomputeUnit`, such
            as "attn") means what the model's target map says (ops, or callables run in the
            unit); any other name or pattern is a unit the model's code opens (a torch_remat
            region), passed to the policy as written.
        kept_ops: Op names to keep in every checkpointed layer.
        every_nth_op: `{op: n}`: keep every n-th call of the op in each region.
        every_nth_layer: Checkpoint every n-th layer, from `first_layer`.
        first_layer: Index of the first checkpointed layer.
        layer_ratio: The fraction of the layers to checkpoint, spread evenly from layer 0; set it
            alone, without every_nth_layer or first_layer.
        force_recompute_modules: Paths of submodules (in a layer) that are always recomputed.
        recomputed_units: Unit names or patterns whose ops are always recomputed, as written.
        preserve_rng_state: torch.utils.checkpoint's: whether the recompute replays random numbers.
        budget: What the checkpointed layers may keep: a fraction of their activation bytes
            without checkpointing (a float from 0.0 to 1.0), or bytes (an int >= 2, or a string
            with a unit such as "512MiB", held as its int). The layers are profiled and keep what saves the most
            recompute time within it (`sac_plugin.plan`).
        peak_bytes: Plan the whole training step for this peak of allocated device bytes
            (`sac_plugin.plan_step`); applying the config then needs the step.
        offloaded_units: Units whose outputs are held in pinned host memory until the backward,
            named as kept_units names them.
        offloaded_ops: Op names whose outputs are held in pinned host memory until the backward.
        offload_min_bytes: Outputs smaller than this stay on the device.
        host_memory_limit: Bytes of host memory offloaded outputs may hold at once; None: no limit.
        pin_routing: Serve MoE routing decisions from the forward (`Policy`'s pin_routing).
        offload_inputs: Also hold the checkpointed layers' inputs in pinned host memory.

    Raises:
        ConfigError: A field is invalid, or set fields contradict each other.
    """

    kept_units: tuple[RecomputeUnit | str, ...] = ()
    kept_ops: tuple[str, ...] = ()
    every_nth_op: Mapping[str, int] = dataclasses.field(default_factory=dict)
    every_nth_layer: int = 1
    first_layer: int = 0
    layer_ratio: float | None = None
    force_recompute_modules: tuple[str, ...] = ()
    recomputed_units: tuple[str, ...] = ()
    preserve_rng_state: bool = True
    budget: float | int | None = None
    peak_bytes: int | None = None
    offloaded_units: tuple[RecomputeUnit | str, ...] = ()
    offloaded_ops: tuple[str, ...] = ()
    offload_min_bytes: int = 1 << 20
    host_memory_limit: int | None = None
    pin_routing: bool = True
    offload_inputs: bool = False

    def __post_init__(self):
        # Each list is checked under the name it was given, so that a message names the entry as
        # written: a field's own values, then those given under its deprecated names (_renamed_fields).
        renamed = self.__dict__.pop(_renamed_fields.GIVEN_UNDER_OLD_NAMES, {})
        for field, check in _NAME_LIST_FIELDS.items():
            given = [(field, getattr(self, field)), *renamed.get(field, ())]
            names = [name for written, values in given for name in _policy_field(written, check, values)]
            object.__setattr__(self, field, tuple(names))
        # A catalog name in kept_units or offloaded_units is the RecomputeUnit the target map resolves.
        for field in ("kept_units", "offloaded_units"):
            names = getattr(self, field)
            if len(set(names)) != len(names):
                raise ConfigError(f"recompute config: {field}: a unit is listed twice: {list(names)}")
            object.__setattr__(self, field, tuple(_CATALOG_UNITS.get(name, name) for name in names))
        both = [str(unit) for unit in self.kept_units if unit in self.offloaded_units]
        if both:
            raise ConfigError(
                f"recompute config: kept_units and offloaded_units both list {both}; a unit is kept or "
                "offloaded, not both"
            )
        object.__setattr__(
            self, "every_nth_op", _policy_field("every_nth_op", _validation.every_nth_rules, self.every_nth_op)
        )
        _policy_field("offload_min_bytes", _validation.byte_count, self.offload_min_bytes, allow_none=False)
        _policy_field("host_memory_limit", _validation.byte_count, self.host_memory_limit, allow_none=True)
        for field in ("pin_routing", "offload_inputs", "preserve_rng_state"):
            _policy_field(field, _validation.flag, getattr(self, field))
        if not _is_int(self.every_nth_layer) or self.every_nth_layer < 1:
            raise ConfigError(
                f"recompute config: every_nth_layer must be an int >= 1, got {bounded_repr(self.every_nth_layer)}"
            )
        if not _is_int(self.first_layer) or self.first_layer < 0:
            raise ConfigError(
                f"recompute config: first_layer must be an int >= 0 (the index of the first checkpointed layer), "
                f"got {bounded_repr(self.first_layer)}"
            )
        if self.layer_ratio is not None:
            if (
                isinstance(self.layer_ratio, bool)
                or not isinstance(self.layer_ratio, (int, float))
                or not 0 < self.layer_ratio <= 1
            ):
                raise ConfigError(
                    f"recompute config: layer_ratio must be in (0, 1], got {bounded_repr(self.layer_ratio)}"
                )
            if self.every_nth_layer != 1:
                raise ConfigError("recompute config: layer_ratio and every_nth_layer both select layers; set one")
            if self.first_layer != 0:
                raise ConfigError(
                    "recompute config: first_layer applies to every_nth_layer; layer_ratio spreads its layers from "
                    "layer 0. Set every_nth_layer and first_layer, or layer_ratio alone"
                )
            object.__setattr__(self, "layer_ratio", float(self.layer_ratio))
        _check_strings("force_recompute_modules", self.force_recompute_modules)
        object.__setattr__(self, "force_recompute_modules", tuple(self.force_recompute_modules))
        if self.budget is not None:
            from .planner._cost import check_budget

            try:
                # A budget with a unit ("512MiB") is held as its bytes, as the planner reads it.
                object.__setattr__(self, "budget", check_budget(self.budget))
            except (TypeError, ValueError) as error:
                raise ConfigError(f"recompute config: {without_library_prefix(error)}") from None
            chosen = self._hand_selection()
            if chosen:
                raise ConfigError(
                    f"recompute config: budget chooses what to keep by measurement; leave {', '.join(chosen)} "
                    "unset (or drop budget to choose by hand)"
                )
            if self.offload_inputs:
                raise ConfigError(
                    "recompute config: budget plans what each layer keeps and never offloads the "
                    "layers' inputs; drop offload_inputs, or plan with peak_bytes, whose plans may "
                    "offload them"
                )
        if self.peak_bytes is not None:
            if not _is_int(self.peak_bytes) or not 1 <= self.peak_bytes <= _validation.MAX_EVERY_NTH:
                raise ConfigError(
                    "recompute config: peak_bytes must be a byte count of device memory, an int from 1 "
                    f"to 2**63 - 1, or null, got {bounded_repr(self.peak_bytes)}"
                )
            chosen = (["budget"] if self.budget is not None else []) + self._hand_selection()
            if chosen:
                raise ConfigError(
                    f"recompute config: peak_bytes plans the step by measurement; leave "
                    f"{', '.join(chosen)} unset (or drop peak_bytes)"
                )

    def _hand_selection(self) -> list[str]:
        """The fields of the hand-written selection that are set, which a budget or a peak replaces."""
        return [name for name in _HAND_SELECTION_FIELDS if getattr(self, name)]

    @property
    def selected_units(self) -> tuple[RecomputeUnit, ...]:
        """The catalog units the config keeps or offloads: the ones the model's target map resolves
        and its layers must open."""
        return tuple(unit for unit in self.kept_units + self.offloaded_units if isinstance(unit, RecomputeUnit))

    def field_of(self, unit: RecomputeUnit) -> str:
        """Where a kept or offloaded unit is written, for messages.

        Args:
            unit: One of `kept_units` or `offloaded_units`.

        Returns:
            "kept_units[i]" or "offloaded_units[j]".
        """
        field = "kept_units" if unit in self.kept_units else "offloaded_units"
        return f"{field}[{getattr(self, field).index(unit)}]"

    # --- files -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The config as a mapping of every field to plain values (lists, not tuples).

        Returns:
            A dict that `from_dict` reads back to an equal config.
        """
        data = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple):
                value = [str(item) for item in value]
            elif isinstance(value, Mapping):
                value = dict(value)
            data[field.name] = value
        return data

    @classmethod
    def from_dict(cls, data) -> RecomputeConfig:
        """A config from a mapping of field names to values; fields left out keep their defaults.

        Args:
            data: The mapping, as a parsed config file gives it.

        Returns:
            The config.

        Raises:
            ConfigError: `data` is not a mapping, has an unknown key, or a value is invalid.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"recompute config: expected a mapping of keys to values, got {type(data).__name__}")
        known = [field.name for field in dataclasses.fields(cls)]
        if len(data) > MAX_LIST_ENTRIES:
            raise ConfigError(
                f"recompute config: the mapping has {len(data)} keys; a recompute config has at most {len(known)}"
            )
        for key in data:
            if key not in known and key not in RENAMED_FIELDS:
                raise ConfigError(f"recompute config: unknown key {bounded_repr(key)}; known keys: {', '.join(known)}")
        return cls(**data)

    def to_json(self) -> str:
        """The config as JSON text.

        Returns:
            `to_dict()` as indented JSON, ending with a newline.
        """
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RecomputeConfig:
        """A config from the text of a JSON file.

        Args:
            text: The JSON text: one object whose keys are fields.

        Returns:
            The config.

        Raises:
            TypeError: `text` is not a str.
            ConfigError: The text is not valid JSON, gives a key twice, or its config is invalid.
        """
        load = functools.partial(json.loads, object_pairs_hook=_unique_keys)
        return cls.from_dict(_parse(text, "from_json", "JSON", load, json.JSONDecodeError))

    def to_yaml(self) -> str:
        """The config as YAML text (needs pyyaml).

        Returns:
            `to_dict()` as block-style YAML, in field order.
        """
        yaml = _import_yaml("to_yaml")
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def from_yaml(cls, text: str) -> RecomputeConfig:
        """A config from the text of a YAML file (needs pyyaml); an empty file is the default config.

        Args:
            text: The YAML text: one mapping whose keys are fields.

        Returns:
            The config, its fields from the mapping and the rest at their defaults.

        Raises:
            TypeError: `text` is not a str (RecomputeConfig.load reads a file).
            ConfigError: The text is not valid YAML, gives a key twice, or its config is invalid.
        """
        yaml = _import_yaml("from_yaml")
        load = functools.partial(yaml.load, Loader=_unique_key_loader())  # a SafeLoader
        data = _parse(text, "from_yaml", "YAML", load, yaml.YAMLError)
        return cls.from_dict({} if data is None else data)

    @staticmethod
    def _format_of(path: Path) -> str:
        formats = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
        if path.suffix not in formats:
            raise ConfigError(f"recompute config: {path}: expected a .json, .yaml or .yml file")
        return formats[path.suffix]

    @classmethod
    def load(cls, path: str | Path) -> RecomputeConfig:
        """A config from a .json, .yaml or .yml file, read as UTF-8.

        Args:
            path: The file.

        Returns:
            The config.

        Raises:
            TypeError: `path` is not a str or os.PathLike.
            ConfigError: The file has another suffix, cannot be read, or its config is invalid.
        """
        path = _path_of(path, "load")
        parse = getattr(cls, "from_" + cls._format_of(path))
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ConfigError(f"recompute config: {path}: cannot read it: {error.strerror or error}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"recompute config: {path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
                "save the file as UTF-8"
            ) from None
        return parse(text)

    def save(self, path: str | Path) -> None:
        """Writes the config to a .json, .yaml or .yml file, in the format its suffix names.

        Args:
            path: The file.

        Raises:
            TypeError: `path` is not a str or os.PathLike.
            ConfigError: The file has another suffix.
        """
        path = _path_of(path, "save")
        path.write_text(getattr(self, "to_" + self._format_of(path))(), encoding="utf-8")

    # --- applying ----------------------------------------------------------------------------------

    def selected_layers(self, count: int) -> list[int]:
        """Indices of the wrap sites that are checkpointed, out of `count` (see the module docstring).

        every_nth_layer=2 of 4 is [0, 2]; with first_layer=1 it is [1, 3] (Modalities' ac_freq=2).

        Args:
            count: How many wrap sites (layers) the model has.

        Returns:
            The checkpointed indices, ascending.

        Raises:
            ConfigError: first_layer is not one of the `count` layers.
        """
        if self.layer_ratio is not None:
            chosen = max(1, round(count * self.layer_ratio)) if count else 0
            return sorted({math.floor(i * count / chosen) for i in range(chosen)})
        if count and self.first_layer >= count:
            raise ConfigError(
                f"recompute config: first_layer is {self.first_layer}, but the model has {count} wrap sites "
                f"(layers 0 to {count - 1}); first_layer must be one of them"
            )
        return list(range(self.first_layer, count, self.every_nth_layer))


_renamed_fields.install(RecomputeConfig)


_TOO_DEEP = "recompute config: not valid {format}: nested too deeply (a recompute config is a flat mapping)"


# A recompute config is a few short lines: these bounds refuse a hostile or corrupt file (a
# huge file, a YAML alias bomb that expands to millions of entries) before any of it is used.
MAX_TEXT_CHARACTERS = 1 << 24
MAX_LIST_ENTRIES = 4096


def _duplicate_key(key, where: str = "") -> ConfigError:
    return ConfigError(
        f"recompute config: key {bounded_repr(key)} is given twice{where}; each key may be given "
        "once (a parser would keep the last one silently)"
    )


def _unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook: an object, refusing a key given twice."""
    data = {}
    for key, value in pairs:
        if key in data:
            raise _duplicate_key(key)
        data[key] = value
    return data


_UNIQUE_KEY_LOADER = None


def _unique_key_loader():
    """yaml's SafeLoader, refusing a mapping key given twice (the line is named)."""
    global _UNIQUE_KEY_LOADER
    if _UNIQUE_KEY_LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):
                if isinstance(node, yaml.MappingNode):
                    seen = set()
                    for key_node, _ in node.value:
                        if key_node.tag == "tag:yaml.org,2002:merge":
                            continue  # a merge (<<) supplies keys that the mapping's own override
                        key = self.construct_object(key_node, deep=True)
                        try:
                            duplicate = key in seen
                        except TypeError:  # unhashable: SafeLoader's own error says so
                            break
                        if duplicate:
                            raise _duplicate_key(key, f" (line {key_node.start_mark.line + 1})")
                        seen.add(key)
                return super().construct_mapping(node, deep=deep)

        _UNIQUE_KEY_LOADER = UniqueKeyLoader
    return _UNIQUE_KEY_LOADER


def _check_text(text, method: str) -> None:
    if not isinstance(text, str):
        raise TypeError(
            f"recompute config: RecomputeConfig.{method} expects the file's text (str), got {describe_value(text)}; "
            "RecomputeConfig.load(path) reads a file"
        )
    if len(text) > MAX_TEXT_CHARACTERS:
        raise ConfigError(
            f"recompute config: the text has {len(text)} characters; a recompute config has at most "
            f"{MAX_TEXT_CHARACTERS}"
        )


def _parse(text, method: str, format: str, load, errors) -> object:
    """What `load` parses `text` (RecomputeConfig.`method`'s argument) to; its `errors`, and a
    text nested deeper than the parser recurses, are ConfigErrors naming the `format`."""
    _check_text(text, method)
    try:
        return load(text)
    except errors as error:
        raise ConfigError(f"recompute config: not valid {format}: {error}") from None
    except RecursionError:
        raise ConfigError(_TOO_DEEP.format(format=format)) from None


def _path_of(path, method: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"recompute config: RecomputeConfig.{method} expects a path (str or os.PathLike), got "
            f"{describe_value(path)}"
        )
    return Path(path)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(field: str, value) -> None:
    """Refuses a list or mapping longer than any config needs (an alias bomb) before it is read."""
    if isinstance(value, Sized) and not isinstance(value, (str, bytes)) and len(value) > MAX_LIST_ENTRIES:
        raise ConfigError(
            f"recompute config: {field} has {len(value)} entries; at most {MAX_LIST_ENTRIES} are accepted"
        )


def _policy_field(field: str, check, value, **options):
    """`value` checked by `check`, the check it shares with Policy (NOTE: [One check per field] in
    _validation.py); its message under the config's prefix, as a ConfigError."""
    _check_size(field, value)
    try:
        return check(value, field, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"recompute config: {without_library_prefix(error)}") from None


def _check_list(field: str, value) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"recompute config: {field} must be a list, got {bounded_repr(value)}")
    _check_size(field, value)


def _check_strings(field: str, values) -> None:
    _check_list(field, values)
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"recompute config: {field}[{i}] must be a non-empty string, got {bounded_repr(value)}")
