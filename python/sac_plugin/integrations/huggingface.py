"""Hugging Face transformers: target maps for decoder (and encoder) layers, and one call to checkpoint a model.

    from sac_plugin.integrations import huggingface
    huggingface.apply_recompute_config(model, RecomputeConfig(units=["attn"]))

The layers are the model's repeated blocks: the modules transformers itself checkpoints
(GradientCheckpointingLayer), or else the class repeated in a ModuleList. Units are submodules
of each layer, by their transformers names, so they hold for every attention implementation
(eager, sdpa, flash). Six model types ship a map (by `model.config.model_type`):

| unit | llama, mistral, qwen2 | mixtral | qwen2_moe | gpt2 |
|---|---|---|---|---|
| attn | self_attn | self_attn | self_attn | attn |
| mlp | mlp | mlp.experts | mlp.experts, mlp.shared_expert | mlp |
| moe_gate | - | mlp.gate | mlp.gate, mlp.shared_expert_gate | - |
| moe_dispatch | - | aten::sort, histc, nonzero | same | - |
| norm | input_layernorm, post_attention_layernorm | same | same | ln_1, ln_2 |

Every other model gets a map derived from its layers' own structure (`derived_target_map`). A
layer's children are its submodules, the items of a ModuleList or ModuleDict standing for the
container (T5's sublayers "layer.0", "layer.1": a container's own forward never runs). "attn" is
the children whose class is an attention module; on a model whose config declares experts
(num_experts, num_local_experts, n_routed_experts, ...), the MoE block is the other child that
holds an "experts" module or a router beside modules with parameters (JetMoE's mlp), "mlp" is its
children with parameters other than its gates, and every MLP beside the block (Granite's
shared_mlp), "moe_gate" its router and expert gates, "moe_dispatch" the routing ops; otherwise
"mlp" is the child whose class is an MLP or feed-forward (T5's T5LayerFF; or, where there is
none, the layer's other children with parameters: BERT's intermediate and output); "norm" is
the layer's own norm children. A unit a layer lacks is absent from it (DeepSeek-V3's first dense
layer has no "moe_gate"); a unit must match in at least one selected layer, and a unit whose
module's forward never runs is refused.

"attn" is the whole attention module: projections, rotary embedding and the attention core.
"moe_dispatch" keeps the routing: the sort of tokens by expert and the per-expert counts
(transformers' grouped_mm experts), or the `nonzero` calls that pick the experts hit and their
tokens (its eager loop; a device sync each on GPU). A config with no units (full recompute, or
ops only) needs no map. transformers is not imported by this module.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _layers
from .._forwards import checkpoint_call, run_in_unit
from .._logging import describe_layers
from .._logging import logger as _logger
from ..checkpointing import context_fn
from ..config import ConfigError, RecomputeConfig, check_target_map, policy_for
from .._validation import bounded_repr, describe_value
from ..targets import KeptCallables, KeptOps, RecomputeTargetMap
from ..units import RecomputeUnit

if TYPE_CHECKING:
    from ..planner import Plan

__all__ = [
    "apply_recompute_config",
    "decoder_layers",
    "derived_target_map",
    "gradient_checkpointing_kwargs",
    "is_hf_model",
    "target_map_for",
]

_NORMS = KeptCallables(["input_layernorm", "post_attention_layernorm"])
# Routing: the experts implementations sort tokens by expert and count them (grouped_mm path), or
# pick the experts hit and their tokens with nonzero (the eager loop).
_ROUTING = KeptOps(["aten::sort", "aten::histc", "aten::nonzero"])
# The config fields by which transformers models declare how many routed experts they have.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
# The cache arguments transformers drops from a layer's call when it checkpoints the layer
# (GradientCheckpointingLayer): a layer planned on captured inputs runs without them too.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _dense(name: str) -> RecomputeTargetMap:
    return RecomputeTargetMap(
        name,
        {
            RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
            RecomputeUnit.MLP: KeptCallables(["mlp"]),
            RecomputeUnit.NORM: _NORMS,
        },
    )


HF_TARGET_MAPS: Mapping[str, RecomputeTargetMap] = {
    "llama": _dense("llama (Hugging Face)"),
    "mistral": _dense("mistral (Hugging Face)"),
    "qwen2": _dense("qwen2 (Hugging Face)"),
    "mixtral": RecomputeTargetMap(
        "mixtral (Hugging Face)",
        {
            RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
            RecomputeUnit.MLP: KeptCallables(["mlp.experts"]),
            RecomputeUnit.MOE_GATE: KeptCallables(["mlp.gate"]),
            RecomputeUnit.MOE_DISPATCH: _ROUTING,
            RecomputeUnit.NORM: _NORMS,
        },
    ),
    "qwen2_moe": RecomputeTargetMap(
        "qwen2_moe (Hugging Face)",
        {
            RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
            RecomputeUnit.MLP: KeptCallables(["mlp.experts", "mlp.shared_expert"]),
            RecomputeUnit.MOE_GATE: KeptCallables(["mlp.gate", "mlp.shared_expert_gate"]),
            RecomputeUnit.MOE_DISPATCH: _ROUTING,
            RecomputeUnit.NORM: _NORMS,
        },
    ),
    "gpt2": RecomputeTargetMap(
        "gpt2 (Hugging Face)",
        {
            RecomputeUnit.ATTN: KeptCallables(["attn"]),
            RecomputeUnit.MLP: KeptCallables(["mlp"]),
            RecomputeUnit.NORM: KeptCallables(["ln_1", "ln_2"]),
        },
    ),
}


def _unwrapped(model):
    """The transformers model inside a PEFT model (peft's get_base_model(): the model its adapters
    were injected into, so that its layers hold them), told without importing peft; any other
    object as given."""
    if isinstance(model, nn.Module) and type(model).__module__.startswith("peft."):
        get_base_model = getattr(type(model), "get_base_model", None)
        if callable(get_base_model):
            base = get_base_model(model)
            if isinstance(base, nn.Module) and base is not model:
                return base
    return model


def is_hf_model(model) -> bool:
    """Whether `model` is a transformers model, or a PEFT model of one, told without importing
    transformers or peft.

    Args:
        model: Any object.

    Returns:
        True for an `nn.Module` from transformers with a config that names its model_type, or a
            PEFT model (LoRA, ...) whose base model is one.
    """
    model = _unwrapped(model)
    return (
        isinstance(model, nn.Module)
        and type(model).__module__.startswith("transformers.")
        and hasattr(model, "config")
        and isinstance(getattr(model.config, "model_type", None), str)
    )


def _model_type(model: nn.Module):
    return getattr(getattr(model, "config", None), "model_type", None)


def target_map_for(model: nn.Module) -> RecomputeTargetMap:
    """The target map for a transformers model: the shipped one for its config.model_type, else
    one derived from its layers (derived_target_map).

    Args:
        model: The transformers model, or a PEFT model of one.

    Returns:
        The model's target map.

    Raises:
        ConfigError: No map ships for the model type, and none can be derived.
    """
    model = _unwrapped(model)
    model_type = _model_type(model)
    if model_type in HF_TARGET_MAPS:
        return HF_TARGET_MAPS[model_type]
    return derived_target_map(model)


def _class_says(module: nn.Module, *words: str) -> bool:
    name = type(module).__name__.lower()
    return any(word in name for word in words)


def _is_gate(name: str, module: nn.Module) -> bool:
    """A MoE block's router, or the gate that weighs its shared expert."""
    name = name.lower()
    return name in ("gate", "router") or name.endswith("_gate") or _class_says(module, "router", "gate")


def _declares_experts(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    counts = [getattr(config, field, None) for field in _EXPERT_COUNTS]
    return any(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts)


def _is_mlp(module: nn.Module) -> bool:
    """An MLP or feed-forward module by its class name (T5's T5LayerFF, DistilBERT's FFN included)."""
    name = type(module).__name__.lower()
    return _class_says(module, "mlp", "feedforward", "feed_forward", "ffn") or name.endswith("ff")


def _is_moe_block(module: nn.Module) -> bool:
    """A MoE block: it holds an `experts` module, or a router beside modules with parameters
    (JetMoE's mlp: router, input_linear, output_linear)."""
    if isinstance(getattr(module, "experts", None), nn.Module):
        return True
    children = list(module.named_children())
    return any(_is_gate(name, child) for name, child in children) and any(
        not _is_gate(name, child) and next(child.parameters(), None) is not None for name, child in children
    )


def _sublayers(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layer's children, a ModuleList or ModuleDict among them replaced by its items ("layer.0",
    "layer.1": T5's sublayers). A container's own forward never runs, so it can be no unit."""
    found = []
    for name, child in layer.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found.extend((f"{name}.{item_name}", item) for item_name, item in child.named_children())
        else:
            found.append((name, child))
    return found


def _layer_paths(layer: nn.Module, moe: bool) -> dict[RecomputeUnit, list[str]]:
    """Each unit's paths in one layer, from its children's classes and names; a unit the layer
    lacks is absent."""
    children = _sublayers(layer)
    attention = [name for name, child in children if _class_says(child, "attention")]
    norms = [name for name, child in children if name not in attention and _class_says(child, "norm")]
    # An attention module can hold experts of its own (JetMoE's mixture of attention heads): it is
    # the attention, never the MoE block.
    moe_blocks = [(name, child) for name, child in children if moe and name not in attention and _is_moe_block(child)]
    gates = []
    if moe_blocks:
        mlp = []
        for block_name, block in moe_blocks:
            for name, child in block.named_children():
                if _is_gate(name, child):
                    gates.append(f"{block_name}.{name}")
                elif next(child.parameters(), None) is not None:
                    mlp.append(f"{block_name}.{name}")
        # An MLP beside the MoE block runs on every token (Granite's shared_mlp): it is MLP too.
        blocks = {name for name, _ in moe_blocks}
        mlp.extend(name for name, child in children if name not in attention and name not in blocks and _is_mlp(child))
    else:
        mlp = [name for name, child in children if name not in attention and _is_mlp(child)]
        if not mlp:
            # No module says it is the MLP (BERT: intermediate, output): the layer's other
            # children with parameters are.
            mlp = [
                name
                for name, child in children
                if name not in attention and name not in norms and next(child.parameters(), None) is not None
            ]
    paths = {
        RecomputeUnit.ATTN: attention,
        RecomputeUnit.MLP: mlp,
        RecomputeUnit.MOE_GATE: gates,
        RecomputeUnit.NORM: norms,
    }
    return {unit: found for unit, found in paths.items() if found}


@dataclasses.dataclass(frozen=True)
class _DerivedCallables(KeptCallables):
    """A derived unit. Its paths can differ between the layers of one model (a dense layer's
    MLP is "mlp", a MoE layer's is "mlp.experts"), so each layer finds its own; `paths` lists
    them all."""

    unit: RecomputeUnit
    moe: bool  # the model's config declares experts: look for MoE blocks

    def __init__(self, paths, unit: RecomputeUnit, moe: bool):
        super().__init__(paths)
        object.__setattr__(self, "unit", unit)
        object.__setattr__(self, "moe", moe)

    def find(self, site: nn.Module) -> list[tuple[object, str]]:
        paths = _layer_paths(site, self.moe).get(self.unit)
        return KeptCallables(paths).find(site) if paths else []


_logged_derived_maps: set = set()


def derived_target_map(model: nn.Module, layers: list[nn.Module] | None = None) -> RecomputeTargetMap:
    """A target map derived from the structure of the model's layers (the module docstring says
    how); units found in no layer are absent. Logged at INFO once per model class.

    Args:
        model: The transformers model, or a PEFT model of one.
        layers: The layers to derive from; None: `decoder_layers(model)`.

    Returns:
        The derived map, named "<model_type> (Hugging Face, derived)".

    Raises:
        ConfigError: The layers have no attention, MLP or norm children, or no layers are found.
    """
    model = _unwrapped(model)
    layers = decoder_layers(model) if layers is None else layers
    moe = _declares_experts(model)
    paths: dict[RecomputeUnit, list[str]] = {}
    for layer in layers:
        for unit, found in _layer_paths(layer, moe).items():
            paths.setdefault(unit, [])
            paths[unit].extend(path for path in found if path not in paths[unit])
    targets = {unit: _DerivedCallables(paths[unit], unit, moe) for unit in RecomputeUnit if unit in paths}
    if RecomputeUnit.MOE_GATE in paths:
        targets[RecomputeUnit.MOE_DISPATCH] = _ROUTING
    targets = {unit: targets[unit] for unit in RecomputeUnit if unit in targets}
    if not targets:
        raise ConfigError(
            f"sac_plugin: no target map can be derived for {type(model).__name__} (model_type "
            f"{bounded_repr(_model_type(model))}): its layers ({type(layers[0]).__name__}) have no "
            "attention, MLP or norm children; pass target_map=RecomputeTargetMap(...) naming the "
            "layer's submodules"
        )
    target_map = RecomputeTargetMap(f"{_model_type(model)} (Hugging Face, derived)", targets)
    if type(model) not in _logged_derived_maps:
        _logged_derived_maps.add(type(model))
        _logger.info(
            "%s: no shipped target map for model_type %r; derived from %s: %s",
            type(model).__name__,
            _model_type(model),
            type(layers[0]).__name__,
            "; ".join(
                f"{unit.value} -> {', '.join(t.paths) if isinstance(t, KeptCallables) else 'routing ops'}"
                for unit, t in targets.items()
            ),
        )
    return target_map


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers (decoder or encoder), in order: the outermost modules
    transformers itself checkpoints (GradientCheckpointingLayer), or else the longest ModuleList
    of one class. Never embeddings or heads.

    Args:
        model: The transformers model, or a PEFT model of one.

    Returns:
        The layers, first to last.

    Raises:
        ConfigError: The model has neither.
    """
    model = _unwrapped(model)
    layers, outer = [], []
    for name, module in model.named_modules():
        if _is_checkpointing_layer(module) and not any(name.startswith(prefix + ".") for prefix in outer):
            layers.append(module)
            outer.append(name)
    if layers:
        return layers
    repeated = [
        list(module)
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        and len(module)
        and len({type(item) for item in module}) == 1
        and next(module.parameters(), None) is not None
    ]
    if repeated:
        return max(repeated, key=len)
    raise ConfigError(
        f"{type(model).__name__} has no layers sac_plugin can find (no GradientCheckpointingLayer, no ModuleList of "
        "one class); pass wrap_sites=[the layers to checkpoint]"
    )


def _disabled_by_transformers(module: nn.Module) -> bool:
    """A layer sac_plugin checkpointed through transformers' hook whose checkpointing transformers
    has since turned off (model.gradient_checkpointing_disable()): it runs unchecked, so a new
    config may be applied to it."""
    return "_sac_undo" in vars(module) and getattr(module, "gradient_checkpointing", False) is False


def _undo(module: nn.Module, checkpointed_layer: bool) -> None:
    """Removes what apply_recompute_config set on one module (sac_plugin.remove_checkpointing,
    or a config applied again after gradient_checkpointing_disable())."""
    state = vars(module)
    if checkpointed_layer:
        state.pop("_gradient_checkpointing_func", None)
        state.pop("_sac_policy", None)
        state.pop("_sac_plan", None)
    if "gradient_checkpointing" in state:
        module.gradient_checkpointing = False
    state.pop("_sac_undo", None)


def _enable_through_transformers(model: nn.Module, config: RecomputeConfig, selected_layers) -> bool:
    """Turns transformers' own checkpointing on first, through its entry point
    (activation_checkpointing_enable; gradient_checkpointing_enable before transformers renamed
    it), with every_n_layers as the config's layer rule says, so that whatever transformers does
    when checkpointing is enabled (the model's own override of it, its flags) is done. The caller then hands each selected layer
    its own policy. Every other module transformers turned on is turned off again: the config's
    selection is what is checkpointed. A model that transformers says cannot be checkpointed but
    whose layers have the hook (JetMoE) is left to that hook alone.

    The forward hook transformers puts on the input embeddings (enable_input_require_grads) is
    removed again: it makes their output require grad for reentrant checkpointing, and the
    plugin's checkpoint is never reentrant. Being a local function, it would also make the model
    unpicklable (torch.save(model)). A hook the model had before is left."""
    if getattr(model, "supports_gradient_checkpointing", None) is not True:
        return
    hooked = "_require_grads_hook" in vars(model)
    every = config.every_nth_layer if config.first_layer == 0 and config.layer_ratio is None else 1
    kwargs = {"use_reentrant": False}  # each selected layer's own function replaces this one
    enable = getattr(type(model), "activation_checkpointing_enable", None)
    if enable is not None:
        enable(model, activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    else:
        type(model).gradient_checkpointing_enable(model, gradient_checkpointing_kwargs=kwargs)
    selected = {id(layer) for layer in selected_layers}
    for module in model.modules():
        if module is model.base_model or id(module) in selected or "_gradient_checkpointing_func" not in vars(module):
            continue
        module.gradient_checkpointing = False
        del vars(module)["_gradient_checkpointing_func"]
        module._sac_undo = functools.partial(_undo, module, True)
    if not hooked and "_require_grads_hook" in vars(model):
        model.disable_input_require_grads()


def _undo_model(model: nn.Module) -> None:
    _undo(model.base_model, False)
    vars(model.base_model).pop("_gradient_checkpointing_func", None)
    for name in _ENABLE_NAMES:
        if isinstance(vars(model).get(name), _KeepTheConfig):
            del vars(model)[name]


# transformers' entry points to its checkpointing: activation_checkpointing_enable, and
# gradient_checkpointing_enable before transformers renamed it.
_ENABLE_NAMES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


class _KeepTheConfig:
    """model.activation_checkpointing_enable after apply_recompute_config: transformers' Trainer
    (TrainingArguments(gradient_checkpointing=True)) calls it on the model it trains, and
    transformers' own would hand every layer torch's full recompute in place of the plugin's
    policy. Called as the Trainer calls it (no kwargs, or use_reentrant=False alone; every layer;
    no offload), checkpointing is on already and the layers keep the plugin's config; called
    asking for anything else, it raises, naming the fix. Once transformers has turned the
    plugin's layers off (activation_checkpointing_disable()), it is transformers' own again. An
    object holding its model (not a closure), so that the model pickles and a copy gets one bound
    to the copy."""

    __slots__ = ("model", "name")

    def __init__(self, model: nn.Module, name: str):
        self.model, self.name = model, name

    def __reduce__(self):
        return (_KeepTheConfig, (self.model, self.name))

    def __call__(self, *args, **kwargs):
        model = self.model
        layers = [module for module in model.modules() if "_sac_policy" in vars(module)]
        if not layers or any(_disabled_by_transformers(layer) for layer in layers):
            # The config is no longer on: transformers' own checkpointing, as asked.
            for module in model.modules():
                if _disabled_by_transformers(module):
                    module._sac_undo()
            vars(model).pop(self.name, None)
            return getattr(type(model), self.name)(model, *args, **kwargs)
        names = ("activation_checkpointing_kwargs", "every_n_layers", "offload")
        given = {**dict(zip(names, args)), **kwargs}
        if "gradient_checkpointing_kwargs" in given:
            given["activation_checkpointing_kwargs"] = given.pop("gradient_checkpointing_kwargs")
        checkpoint_kwargs = given.get("activation_checkpointing_kwargs")
        if (
            len(args) <= len(names)
            and set(given) <= set(names)
            and checkpoint_kwargs in (None, {}, {"use_reentrant": False})
            and given.get("every_n_layers", 1) == 1
            and given.get("offload", False) is False
        ):
            _logger.info(
                "%s.%s: the layers stay checkpointed by the config given to apply_recompute_config",
                type(model).__name__,
                self.name,
            )
            return None
        asked = ", ".join([*(bounded_repr(a) for a in args), *(f"{k}={bounded_repr(v)}" for k, v in kwargs.items())])
        raise ValueError(
            f"sac_plugin: {type(model).__name__}.{self.name}({asked}): the model's layers are checkpointed by the "
            "config given to sac_plugin.apply_recompute_config, which these arguments would replace; it accepts "
            "no kwargs (or use_reentrant=False alone), every_n_layers=1 and offload=False, which keep that config. "
            "Say what to keep, offload and checkpoint in the RecomputeConfig (every_nth_layer, offloaded_units), "
            "or call sac_plugin.remove_checkpointing(model) first to use transformers' own checkpointing"
        )


def _check_model(model, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"sac_plugin: {where}: model must be a transformers PreTrainedModel, got {describe_value(model)}"
        )
    if any("_sac_policy" in vars(module) and not _disabled_by_transformers(module) for module in model.modules()):
        raise ValueError(
            f"sac_plugin: {where}: {type(model).__name__} is already checkpointed by sac_plugin; apply a "
            "config once per model"
        )
    # Read the layers' flag, not model.is_gradient_checkpointing (deprecated in transformers 5).
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        raise ValueError(
            f"sac_plugin: {where}: {type(model).__name__} has transformers' gradient checkpointing enabled; "
            "call model.gradient_checkpointing_disable() first, or use gradient_checkpointing_kwargs(model, config) "
            "to run transformers' checkpointing with the plugin's policy"
        )


def _check_layers(model: nn.Module, layers, where: str, *, hook_needed: bool = True) -> None:
    """The layers must be transformers' GradientCheckpointingLayers, whose hook sac_plugin hands
    its policy (`hook_needed`). A model whose layers are not, and that transformers says cannot
    be checkpointed (ALBERT), is refused in transformers' own words."""
    for i, layer in enumerate(layers):
        if _is_checkpointing_layer(layer):
            continue
        if getattr(model, "supports_gradient_checkpointing", None) is False:
            raise TypeError(
                f"sac_plugin: {where}: {type(model).__name__} does not support activation checkpointing (transformers' "
                f"own refusal: its layers, {type(layer).__name__}, have no checkpointing hook); call "
                "sac_plugin.apply_selective_checkpointing on the layers to checkpoint them anyway"
            )
        if not hook_needed:
            continue
        raise TypeError(
            f"sac_plugin: {where}: decoder layer {i} ({type(layer).__name__}) is not a transformers "
            "GradientCheckpointingLayer (transformers >= 4.52 has them); upgrade transformers, or call "
            "sac_plugin.apply_selective_checkpointing on each layer and pass use_cache=False"
        )


def _units_by_layer(config: RecomputeConfig, target_map: RecomputeTargetMap, layers, selected) -> dict:
    """The config's units each selected layer has. A unit may be absent from some layers (a mixed
    stack: DeepSeek-V3's dense first layer has no router); one absent from every selected layer
    is an error naming it."""
    present = {index: [] for index in selected}
    for i, unit in enumerate(config.selected_units):
        target = target_map[unit]
        found_in = [index for index in selected if isinstance(target, KeptOps) or target.find(layers[index])]
        if not found_in:
            kinds = sorted({type(layers[index]).__name__ for index in selected})
            raise ConfigError(
                f"recompute config: {_unit_field(config, i)}: unit '{unit.value}' of {target_map.model_name} "
                f"({', '.join(target.paths)}) matches nothing in any of the {len(selected)} selected layers "
                f"({', '.join(kinds)})"
            )
        if len(found_in) < len(selected):
            _logger.debug(
                "unit '%s' (%s) is in layers %s only",
                unit.value,
                target_map.model_name,
                describe_layers(found_in, len(layers)),
            )
        for index in found_in:
            if isinstance(target, KeptCallables):
                for owner, name in target.find(layers[index]):
                    _layers.check_forward_runs(target_map, unit, owner, name, _unit_field(config, i))
            present[index].append(unit)
    for index in selected:
        for j, path in enumerate(config.force_recompute_modules):
            if not KeptCallables([path]).find(layers[index]):
                raise ConfigError(
                    f"recompute config: force_recompute_modules[{j}]: '{path}' matches nothing in "
                    f"{type(layers[index]).__name__} (layer {index})"
                )
    return present


def _unit_field(config: RecomputeConfig, i: int) -> str:
    """Where the i-th of config.selected_units is written: units[i] or offloaded_units[j]."""
    return f"units[{i}]" if i < len(config.units) else f"offloaded_units[{i - len(config.units)}]"


def _prepare(model: nn.Module, config: RecomputeConfig, target_map: RecomputeTargetMap, layers, selected):
    """Checks the config against the selected layers, then installs each layer's units; returns
    the policy. Nothing is changed unless every check passes."""
    check_target_map(target_map)
    policy = policy_for(config, target_map)
    present = _units_by_layer(config, target_map, layers, selected)
    for index in selected:
        # Each layer is prepared with the units it has (all checked above, so none raises).
        units = present[index]
        layer_map = RecomputeTargetMap(target_map.model_name, {unit: target_map[unit] for unit in units})
        layer_config = dataclasses.replace(
            config,
            units=[u for u in units if u in config.units],
            offloaded_units=[u for u in units if u in config.offloaded_units],
        )
        _layers.prepare_layers(model, layer_config, layer_map, [layers[index]], [0])
    return policy


def _map_for(
    model: nn.Module, config: RecomputeConfig, target_map: RecomputeTargetMap | None, layers
) -> RecomputeTargetMap:
    """The target map the config needs: none for a config without units (full recompute, ops)."""
    if target_map is not None:
        return target_map
    if not config.selected_units:
        return RecomputeTargetMap(f"{type(model).__name__} (no units)", {})
    if _model_type(model) in HF_TARGET_MAPS:
        return HF_TARGET_MAPS[_model_type(model)]
    return derived_target_map(model, layers)


def _keyword_batch(example_inputs):
    """A transformers model takes a keyword batch ({"input_ids": ..., "labels": ...})."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return example_inputs


def _plan_layers(model: nn.Module, config: RecomputeConfig, layers: list[nn.Module], example_inputs) -> list[Plan]:
    """One plan per layer within config.budget: each distinct layer (class, parameters, input
    shapes) profiled once on the inputs it gets from one forward of example_inputs, the budget
    split over the layers."""
    if example_inputs is None:
        raise ConfigError(
            "recompute config: a budget for a transformers model is planned on an example batch: pass "
            "example_inputs=batch (the keyword batch the model takes, such as {'input_ids': ..., 'labels': ...})"
        )
    # The planner imports torch._dynamo: imported when a budget is planned, not with this module.
    from ..planner import plan
    from ..planner._apply import _capture_inputs, layer_signature
    from ..planner._split import split, total_budget_bytes

    inputs = _capture_inputs(model, layers, _keyword_batch(example_inputs))
    plans, by_signature = [], {}
    for layer, (args, kwargs) in zip(layers, inputs):
        kwargs = {
            name: (False if name == "use_cache" else None if name in _CACHE_ARGUMENTS else value)
            for name, value in kwargs.items()
        }
        signature = layer_signature(layer, args, kwargs)
        if signature not in by_signature:
            by_signature[signature] = plan(layer, *args, budget=1.0, **kwargs)
        plans.append(by_signature[signature])
    total = total_budget_bytes(config.budget, plans)
    chosen = split(plans, total)
    _logger.info(
        "%s: budget %r = %.2f MiB over %d layers (%d distinct): they hold %.2f MiB",
        type(model).__name__,
        config.budget,
        total / 2**20,
        len(layers),
        len(by_signature),
        sum(p.held_bytes for p in chosen) / 2**20,
    )
    return chosen


def apply_recompute_config(
    model: nn.Module,
    config: RecomputeConfig | None = None,
    *,
    target_map: RecomputeTargetMap | None = None,
    wrap_sites=None,
    example_inputs=None,
) -> nn.Module:
    """Checkpoints a transformers model's layers as `config` says; returns the model.

    The layers are found by their class (decoder_layers; pass wrap_sites= to choose), the target
    map is the shipped one for model.config.model_type or one derived from the layers (pass
    target_map= to choose); a config without units needs none. A budget is planned per distinct
    layer on `example_inputs`, the keyword batch the model takes. Each selected layer is
    checkpointed through transformers' own per-layer hook (GradientCheckpointingLayer), handed
    the plugin's policy: transformers then also turns the KV cache off in training, as its
    gradient checkpointing does, so that the recompute does not write the cache a second time.
    sac_plugin.apply_recompute_config(model, config) calls this for a transformers model.

    A PEFT model (get_peft_model(model, LoraConfig(...))) is checkpointed in its base model's
    layers, which hold its adapters: they are recomputed, or kept, with the unit they are in.
    The config stays on when transformers enables its own checkpointing again as the Trainer
    does (TrainingArguments(gradient_checkpointing=True)); asked for anything else (offload,
    every_n_layers, other kwargs) that call raises.

    Args:
        model: The transformers model, or a PEFT model of one.
        config: What to keep and which layers to checkpoint; None keeps nothing (full recompute).
        target_map: What the config's units mean for the model; None: `target_map_for(model)`.
        wrap_sites: The layers to checkpoint, a list of modules; None: `decoder_layers(model)`.
        example_inputs: The keyword batch the model takes, on which a budget is planned.

    Returns:
        `model` (as given: a PEFT model stays one), its selected layers checkpointed.

    Raises:
        TypeError: `model` is not a transformers model, or an argument has the wrong type.
        ConfigError: The config cannot be applied to the model (a unit it lacks, example_inputs
            without a budget, a layer already checkpointed).
    """
    given, model = model, _unwrapped(model)
    _check_model(model, "huggingface.apply_recompute_config")
    if config is not None and not isinstance(config, RecomputeConfig):
        raise TypeError(
            "sac_plugin: huggingface.apply_recompute_config: config must be a RecomputeConfig or None, "
            f"got {describe_value(config)}"
        )
    config = RecomputeConfig() if config is None else config
    if example_inputs is not None and config.budget is None:
        raise ConfigError("apply_recompute_config: example_inputs are for planning a budget; the config sets no budget")
    layers = decoder_layers(model) if wrap_sites is None else _layers.wrap_sites(given, wrap_sites)
    _check_layers(model, layers, "huggingface.apply_recompute_config")
    selected = config.selected_layers(len(layers))
    target_map = None if config.budget is not None else _map_for(model, config, target_map, layers)
    # Layers whose checkpointing transformers turned off lose the stale state first (checked
    # above: nothing else is checkpointed), so disable-then-apply works.
    for module in model.modules():
        if _disabled_by_transformers(module):
            module._sac_undo()
    plans = None
    if config.budget is not None:
        plans = _plan_layers(model, config, [layers[i] for i in selected], example_inputs)
        policies = [p.policy for p in plans]
    else:
        policy = _prepare(model, config, target_map, layers, selected)
        policies = [policy] * len(selected)
    _enable_through_transformers(model, config, [layers[index] for index in selected])
    for position, (index, policy) in enumerate(zip(selected, policies)):
        layer = layers[index]
        layer._sac_policy = policy  # marks it checkpointed (reports, a second apply)
        if plans is not None:
            layer._sac_plan = plans[position]
        layer._gradient_checkpointing_func = _checkpoint_func(
            context_fn(policy), config.preserve_rng_state, policy.offload_inputs
        )
        layer.gradient_checkpointing = True
        layer._sac_undo = functools.partial(_undo, layer, True)
    # The base model turns use_cache off in training while this flag is set: a cache written in
    # the forward would be written again by the recompute.
    model.base_model.gradient_checkpointing = True
    model.base_model._sac_undo = functools.partial(_undo_model, model)
    for name in _ENABLE_NAMES:
        if hasattr(type(model), name):
            setattr(model, name, _KeepTheConfig(model, name))
            break
    if _logger.isEnabledFor(logging.INFO) and plans is None:
        _logger.info(
            "%s",
            _layers.describe_application(type(model).__name__, selected, len(layers), policies[0], config, target_map),
        )
    return given


def _offloading_config(config: RecomputeConfig) -> RecomputeConfig:
    """What `activation_checkpointing_enable(..., offload=True)` means for a config handed over as
    sac_plugin kwargs: what the config keeps (its units and ops) is offloaded instead, by the
    plugin's own offload (side streams, pinned host memory), never transformers' save_on_cpu on
    the compute stream, and so are the layers' inputs, which full recompute still holds
    (offload_inputs). The every-nth rule stays kept."""
    return dataclasses.replace(
        config,
        units=(),
        ops=(),
        offloaded_units=config.units + config.offloaded_units,
        offloaded_ops=tuple(config.ops) + tuple(config.offloaded_ops),
        offload_inputs=True,
    )


def _checkpoint_layer(
    function, *args, context_fn, preserve_rng_state: bool = True, use_reentrant: bool = False, **kwargs
):
    """torch's checkpoint as transformers calls a layer's _gradient_checkpointing_func, through the
    plugin's checkpoint_call, so that the layer's region holds its inputs (offload_inputs)."""
    if use_reentrant:
        raise ValueError("sac_plugin: a policy with offload_inputs checkpoints with use_reentrant=False, got True")
    return checkpoint_call(
        function, args, kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state, offload_inputs=True
    )


def _checkpoint_func(contexts, preserve_rng_state: bool, offload_inputs: bool):
    """A layer's _gradient_checkpointing_func: torch's checkpoint, or _checkpoint_layer where the
    policy offloads the inputs."""
    if offload_inputs:
        return functools.partial(_checkpoint_layer, context_fn=contexts, preserve_rng_state=preserve_rng_state)
    return functools.partial(
        checkpoint, use_reentrant=False, context_fn=contexts, preserve_rng_state=preserve_rng_state
    )


def _under_transformers_offload() -> bool:
    """Whether transformers' own offload wraps the checkpoint being entered: torch's save_on_cpu
    hooks on top when the checkpoint asks for its contexts, before it pushes its own (NOTE:
    [transformers' offload on another model instance])."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("save_on_cpu.")


def _checkpointed_module(frame) -> nn.Module | None:
    """The module whose forward torch.utils.checkpoint is about to run, read from the frame that
    calls a context_fn (NOTE: [kwargs on another model instance])."""
    for _ in range(4):
        if frame is None:
            return None
        # torch 2.15 calls context_fn from _checkpoint_without_reentrant_generator_impl
        if frame.f_code.co_name.startswith("_checkpoint_without_reentrant_generator"):
            function = frame.f_locals.get("fn")
            function = getattr(function, "__wrapped__", function)  # the region holds the inputs (offload_inputs)
            while function is not None:
                owner = getattr(function, "__self__", None)  # layer.__call__ (older transformers)
                if isinstance(owner, nn.Module):
                    return owner
                if not isinstance(function, functools.partial):
                    return None
                if function.args and isinstance(function.args[0], nn.Module):  # partial(forward, layer)
                    return function.args[0]
                function = function.func
            return None
        frame = frame.f_back
    return None


class _LayerContexts(str):
    """The `context_fn` of gradient_checkpointing_kwargs: the plugin's policy, for every layer it
    checkpoints.

    A str (what it keeps, for which model), so that TrainingArguments, which holds the kwargs,
    writes them as JSON (to_json_string, and the loggers' to_dict) and pickles them into each
    checkpoint it saves (training_args.bin): pickled, it is its config and target map, and the
    copy prepares the layers it checkpoints as another instance's kwargs do (below). Compared and
    hashed as an object, not as its text.

    NOTE: [kwargs on another model instance]
    The kwargs' units are callables installed on the layers of the model they were built on. The
    same dictionary can reach another instance: transformers' Trainer(model_init=...) builds a
    new model and enables checkpointing on it with the TrainingArguments' kwargs. Its layers have
    no units installed, so the policy would open none and keep nothing: full recompute, silently.
    So each call reads which layer checkpoint is about to run (the function transformers hands it
    is partial(forward, layer)); a layer not prepared yet gets the config's units installed from
    the same target map before its forward runs, and one that has none of them is an error naming
    it. A call whose layer cannot be read (checkpoint called on something else) is served as is.
    """

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __new__(
        cls, policy, config: RecomputeConfig, target_map: RecomputeTargetMap, layers, *, offloading: bool = False
    ):
        default = RecomputeConfig().to_dict()
        fields = ", ".join(f"{k}={v!r}" for k, v in config.to_dict().items() if v != default[k])
        return super().__new__(cls, f"sac_plugin policy for {target_map.model_name}: {fields or 'full recompute'}")

    def __init__(
        self, policy, config: RecomputeConfig, target_map: RecomputeTargetMap, layers, *, offloading: bool = False
    ):
        self.policy, self._config, self._target_map = policy, config, target_map
        self._contexts = context_fn(policy)
        # A checkpoint site per layer (NOTE: [What a site learns]): one context function serves
        # every layer here, and each layer must learn what its own recompute reaches.
        self._per_layer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._prepared = weakref.WeakSet(layers)
        self._offloading = offloading

    def __call__(self):
        layer = _checkpointed_module(sys._getframe(1))
        if layer is None:
            return self._contexts()
        if not self._offloading and _under_transformers_offload():
            return self._offload_through_the_plugin(layer)
        return self._contexts_for(layer)

    def _contexts_for(self, layer: nn.Module):
        if self._config.selected_units and layer not in self._prepared:
            self._prepare(layer)
        contexts = self._per_layer.get(layer)
        if contexts is None:
            contexts = self._per_layer[layer] = context_fn(self.policy, name=type(layer).__name__)
        return contexts()

    def __deepcopy__(self, memo):
        return self  # TrainingArguments are copied; the kwargs' policy and layers stay shared

    def __copy__(self):
        return self

    def __reduce__(self):
        return (_restored_contexts, (self._config, self._target_map, self._offloading))

    def _prepare(self, layer: nn.Module) -> None:
        names = {unit.value for unit in self._config.selected_units}
        found = [
            (owner, name, unit)
            for unit in self._config.selected_units
            if isinstance(self._target_map[unit], KeptCallables)
            for owner, name in self._target_map[unit].find(layer)
        ]
        callable_units = [u for u in self._config.selected_units if isinstance(self._target_map[u], KeptCallables)]
        if callable_units and not found:
            raise ConfigError(
                f"recompute config: gradient_checkpointing_kwargs were built for {self._target_map.model_name}, and "
                f"the layer checkpointed now ({type(layer).__name__}) has none of the units {sorted(names)}; build the "
                "kwargs on the model they are used with"
            )
        for owner, name, unit in found:
            _layers.check_forward_runs(self._target_map, unit, owner, name, "units")
        for owner, name, unit in found:
            run_in_unit(owner, name, unit.value)
        self._prepared.add(layer)
        _logger.debug(
            "%s: a layer not seen when the kwargs were built (another model instance) got units %s",
            type(layer).__name__,
            sorted(names),
        )

    def _offload_through_the_plugin(self, layer: nn.Module):
        """NOTE: [transformers' offload on another model instance]
        kwargs reach a model instance they were not built on with transformers' own offload when
        Trainer(model_init=...) builds the model and calls its activation_checkpointing_enable(...,
        offload=True): transformers then wraps each layer's checkpoint in save_on_cpu on the compute
        stream, which the plugin's region hooks override anyway (innermost saved-tensor hooks win),
        so nothing would be offloaded. The layer's checkpoint goes through the plugin's offload
        instead (the offloading contexts, and its checkpoint_call for the inputs) from this call on;
        this first call, already inside transformers' checkpoint, offloads what the contexts hold."""
        offloaded = self.offloading()
        current = vars(layer).get("_gradient_checkpointing_func")
        preserve = current.keywords.get("preserve_rng_state", True) if isinstance(current, functools.partial) else True
        layer._gradient_checkpointing_func = _checkpoint_func(offloaded, preserve, offloaded.policy.offload_inputs)
        _logger.info(
            "%s: transformers' offload (save_on_cpu) replaced by the plugin's for this layer", type(layer).__name__
        )
        return offloaded._contexts_for(layer)

    def offloading(self) -> _LayerContexts:
        """The same kwargs with what they keep offloaded instead (_offloading_config)."""
        if self._offloading:
            return self
        config = _offloading_config(self._config)
        offloaded = _LayerContexts(policy_for(config, self._target_map), config, self._target_map, [], offloading=True)
        offloaded._prepared = self._prepared
        return offloaded


def _restored_contexts(config: RecomputeConfig, target_map: RecomputeTargetMap, offloading: bool) -> _LayerContexts:
    """Unpickled kwargs: the same policy, with no layer prepared yet."""
    return _LayerContexts(policy_for(config, target_map), config, target_map, [], offloading=offloading)


class _PluginOffloadEnable:
    """model.activation_checkpointing_enable as gradient_checkpointing_kwargs leaves it: sac_plugin
    kwargs with offload=True are given the plugin's offload (_offloading_config) and reach
    transformers with offload=False, so that its save_on_cpu never wraps the plugin's checkpoint;
    every_n_layers and every other argument reach transformers as given. An object holding its
    model (not a closure), so that a copy of the model gets one bound to the copy."""

    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def __reduce__(self):
        return (_PluginOffloadEnable, (self.model,))

    def __call__(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False):
        kwargs = activation_checkpointing_kwargs
        contexts = kwargs.get("context_fn") if isinstance(kwargs, Mapping) else None
        if offload and isinstance(contexts, _LayerContexts):
            kwargs, offload = {**kwargs, "context_fn": contexts.offloading()}, False
        result = type(self.model).activation_checkpointing_enable(
            self.model, activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers, offload=offload
        )
        # transformers calls torch's checkpoint with the layer's inputs; where the policy offloads
        # them, each layer it checkpointed calls it through the plugin instead.
        contexts = kwargs.get("context_fn") if isinstance(kwargs, Mapping) else None
        if isinstance(contexts, _LayerContexts) and contexts.policy.offload_inputs:
            for module in self.model.modules():
                func = vars(module).get("_gradient_checkpointing_func")
                if isinstance(func, functools.partial) and func.keywords.get("context_fn") is contexts:
                    module._gradient_checkpointing_func = _checkpoint_func(
                        contexts, func.keywords.get("preserve_rng_state", True), True
                    )
        return result


def _remove_enable(model: nn.Module) -> None:
    vars(model).pop("activation_checkpointing_enable", None)
    vars(model).pop("_sac_undo", None)


def gradient_checkpointing_kwargs(
    model: nn.Module,
    config: RecomputeConfig | None = None,
    *,
    target_map: RecomputeTargetMap | None = None,
    wrap_sites=None,
) -> dict:
    """The checkpointing kwargs that make transformers' own checkpointing selective:

        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=huggingface.gradient_checkpointing_kwargs(model, config),
            every_n_layers=1, offload=False)

    (`gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` before transformers
    renamed it.) transformers chooses the layers (every_n_layers), so the config must select
    every layer. The units that are callables are installed here on each layer (decoder_layers,
    or wrap_sites), as apply_recompute_config does; a layer of another instance the kwargs reach
    (Trainer(model_init=...)) gets them when it is first checkpointed. offload=True offloads
    what the config keeps through the plugin (on this model: it is the model whose
    activation_checkpointing_enable this leaves the plugin's). A budget is planned per layer: use
    apply_recompute_config.

    Args:
        model: The transformers model, or a PEFT model of one.
        config: What to keep; it selects every layer. None keeps nothing (full recompute).
        target_map: What the config's units mean for the model; None: `target_map_for(model)`.
        wrap_sites: The layers the units are installed on; None: `decoder_layers(model)`.

    Returns:
        The kwargs (use_reentrant, context_fn, preserve_rng_state) for transformers'
            `activation_checkpointing_kwargs` (or `gradient_checkpointing_kwargs`).

    Raises:
        TypeError: `model` is not a transformers model, or `config` is not a RecomputeConfig.
        ConfigError: The config sets a budget or selects fewer than every layer, or cannot be
            applied to the model.
    """
    given, model = model, _unwrapped(model)
    _check_model(model, "huggingface.gradient_checkpointing_kwargs")
    config = RecomputeConfig() if config is None else config
    if not isinstance(config, RecomputeConfig):
        raise TypeError(
            "sac_plugin: huggingface.gradient_checkpointing_kwargs: config must be a RecomputeConfig or "
            f"None, got {describe_value(config)}"
        )
    if config.budget is not None:
        raise ConfigError(
            "recompute config: gradient_checkpointing_kwargs hands every layer one policy, and a budget plans one per "
            "layer; use huggingface.apply_recompute_config(model, config, example_inputs=batch)"
        )
    if config.every_nth_layer != 1 or config.first_layer != 0 or config.layer_ratio not in (None, 1.0):
        raise ConfigError(
            "recompute config: transformers' gradient checkpointing checkpoints every decoder layer, so "
            "every_nth_layer, first_layer and layer_ratio cannot select fewer; pass every_n_layers= to "
            "activation_checkpointing_enable, or use huggingface.apply_recompute_config(model, config) to checkpoint "
            "some layers"
        )
    layers = decoder_layers(model) if wrap_sites is None else _layers.wrap_sites(given, wrap_sites)
    _check_layers(model, layers, "huggingface.gradient_checkpointing_kwargs", hook_needed=False)
    target_map = _map_for(model, config, target_map, layers)
    policy = _prepare(model, config, target_map, layers, list(range(len(layers))))
    if hasattr(type(model), "activation_checkpointing_enable") and "activation_checkpointing_enable" not in vars(model):
        model.activation_checkpointing_enable = _PluginOffloadEnable(model)
        if "_sac_undo" not in vars(model):
            model._sac_undo = functools.partial(_remove_enable, model)
    return {
        "use_reentrant": False,
        "context_fn": _LayerContexts(policy, config, target_map, layers),
        "preserve_rng_state": config.preserve_rng_state,
    }
