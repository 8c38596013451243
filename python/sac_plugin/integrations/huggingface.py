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

Every other model gets a map derived from its layers' own structure (`derived_target_map`):
"attn" is the layer's child whose class is an attention module; on a model whose config declares
experts (num_experts, num_local_experts, n_routed_experts, ...), the MoE block is the child that
holds an "experts" module, "mlp" is its experts and shared experts, "moe_gate" its router and
expert gates, "moe_dispatch" the routing ops; otherwise "mlp" is the child whose class is an MLP
or feed-forward (or, where there is none, the layer's other children with parameters: BERT's
intermediate and output); "norm" is the layer's own norm children. A unit a layer lacks is
absent from it (DeepSeek-V3's first dense layer has no "moe_gate"); a unit must match in at
least one selected layer.

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
from collections.abc import Mapping

from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _layers
from .._logging import describe_layers
from .._logging import logger as _logger
from ..checkpointing import context_fn
from ..config import ConfigError, RecomputeConfig, check_target_map, policy_for
from ..planner import Plan, plan, split, total_budget_bytes
from ..planner._apply import _capture_inputs, layer_signature
from ..policy import bounded_repr, describe_value
from ..targets import KeptCallables, KeptOps, RecomputeTargetMap, RecomputeUnit

__all__ = ['apply_recompute_config', 'decoder_layers', 'derived_target_map', 'gradient_checkpointing_kwargs',
           'is_hf_model', 'target_map_for']

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
    return RecomputeTargetMap(name, {
        RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp"]),
        RecomputeUnit.NORM: _NORMS,
    })


HF_TARGET_MAPS: Mapping[str, RecomputeTargetMap] = {
    "llama": _dense("llama (Hugging Face)"),
    "mistral": _dense("mistral (Hugging Face)"),
    "qwen2": _dense("qwen2 (Hugging Face)"),
    "mixtral": RecomputeTargetMap("mixtral (Hugging Face)", {
        RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp.experts"]),
        RecomputeUnit.MOE_GATE: KeptCallables(["mlp.gate"]),
        RecomputeUnit.MOE_DISPATCH: _ROUTING,
        RecomputeUnit.NORM: _NORMS,
    }),
    "qwen2_moe": RecomputeTargetMap("qwen2_moe (Hugging Face)", {
        RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp.experts", "mlp.shared_expert"]),
        RecomputeUnit.MOE_GATE: KeptCallables(["mlp.gate", "mlp.shared_expert_gate"]),
        RecomputeUnit.MOE_DISPATCH: _ROUTING,
        RecomputeUnit.NORM: _NORMS,
    }),
    "gpt2": RecomputeTargetMap("gpt2 (Hugging Face)", {
        RecomputeUnit.ATTN: KeptCallables(["attn"]),
        RecomputeUnit.MLP: KeptCallables(["mlp"]),
        RecomputeUnit.NORM: KeptCallables(["ln_1", "ln_2"]),
    }),
}


def is_hf_model(model) -> bool:
    """A transformers model, told without importing transformers."""
    return isinstance(model, nn.Module) and type(model).__module__.startswith("transformers.") \
        and hasattr(model, "config") and isinstance(getattr(model.config, "model_type", None), str)


def _model_type(model: nn.Module):
    return getattr(getattr(model, "config", None), "model_type", None)


def target_map_for(model: nn.Module) -> RecomputeTargetMap:
    """The target map for a transformers model: the shipped one for its config.model_type, else
    one derived from its layers (derived_target_map)."""
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


def _layer_paths(layer: nn.Module, moe: bool) -> dict[RecomputeUnit, list[str]]:
    """Each unit's paths in one layer, from its children's classes and names; a unit the layer
    lacks is absent."""
    children = list(layer.named_children())
    attention = [name for name, child in children if _class_says(child, "attention")]
    norms = [name for name, child in children if _class_says(child, "norm")]
    moe_blocks = [(name, child) for name, child in children
                  if moe and isinstance(getattr(child, "experts", None), nn.Module)]
    gates = []
    if moe_blocks:
        mlp = []
        for block_name, block in moe_blocks:
            for name, child in block.named_children():
                if _is_gate(name, child):
                    gates.append(f"{block_name}.{name}")
                elif "expert" in name.lower():
                    mlp.append(f"{block_name}.{name}")
    else:
        mlp = [name for name, child in children
               if name not in attention and _class_says(child, "mlp", "feedforward", "feed_forward")]
        if not mlp:
            # No module says it is the MLP (BERT: intermediate, output): the layer's other
            # children with parameters are.
            mlp = [name for name, child in children
                   if name not in attention and name not in norms and next(child.parameters(), None) is not None]
    paths = {RecomputeUnit.ATTN: attention, RecomputeUnit.MLP: mlp, RecomputeUnit.MOE_GATE: gates,
             RecomputeUnit.NORM: norms}
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
    how); units found in no layer are absent. Logged at INFO once per model class."""
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
        raise ConfigError(f"sac_plugin: no target map can be derived for {type(model).__name__} (model_type "
                          f"{bounded_repr(_model_type(model))}): its layers ({type(layers[0]).__name__}) have no "
                          "attention, MLP or norm children; pass target_map=RecomputeTargetMap(...) naming the "
                          "layer's submodules")
    target_map = RecomputeTargetMap(f"{_model_type(model)} (Hugging Face, derived)", targets)
    if type(model) not in _logged_derived_maps:
        _logged_derived_maps.add(type(model))
        _logger.info("%s: no shipped target map for model_type %r; derived from %s: %s", type(model).__name__,
                     _model_type(model), type(layers[0]).__name__,
                     "; ".join(f"{unit.value} -> {', '.join(t.paths) if isinstance(t, KeptCallables) else 'routing ops'}"
                               for unit, t in targets.items()))
    return target_map


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers (decoder or encoder), in order: the outermost modules
    transformers itself checkpoints (GradientCheckpointingLayer), or else the longest ModuleList
    of one class. Never embeddings or heads."""
    layers, outer = [], []
    for name, module in model.named_modules():
        if _is_checkpointing_layer(module) and not any(name.startswith(prefix + ".") for prefix in outer):
            layers.append(module)
            outer.append(name)
    if layers:
        return layers
    repeated = [list(module) for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)
                and len({type(item) for item in module}) == 1 and next(module.parameters(), None) is not None]
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


def _check_model(model, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"sac_plugin: {where}: model must be a transformers PreTrainedModel, got {describe_value(model)}")
    if any("_sac_policy" in vars(module) and not _disabled_by_transformers(module) for module in model.modules()):
        raise ValueError(f"sac_plugin: {where}: {type(model).__name__} is already checkpointed by sac_plugin; apply a "
                         "config once per model")
    # Read the layers' flag, not model.is_gradient_checkpointing (deprecated in transformers 5).
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        raise ValueError(
            f"sac_plugin: {where}: {type(model).__name__} has transformers' gradient checkpointing enabled; "
            "call model.gradient_checkpointing_disable() first, or use gradient_checkpointing_kwargs(model, config) "
            "to run transformers' checkpointing with the plugin's policy"
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
            _logger.debug("unit '%s' (%s) is in layers %s only", unit.value, target_map.model_name,
                          describe_layers(found_in, len(layers)))
        for index in found_in:
            present[index].append(unit)
    for index in selected:
        for j, path in enumerate(config.force_recompute_modules):
            if not KeptCallables([path]).find(layers[index]):
                raise ConfigError(f"recompute config: force_recompute_modules[{j}]: '{path}' matches nothing in "
                                  f"{type(layers[index]).__name__} (layer {index})")
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
        layer_config = dataclasses.replace(config, units=[u for u in units if u in config.units],
                                           offloaded_units=[u for u in units if u in config.offloaded_units])
        _layers.prepare_layers(model, layer_config, layer_map, [layers[index]], [0])
    return policy


def _map_for(model: nn.Module, config: RecomputeConfig, target_map: RecomputeTargetMap | None,
             layers) -> RecomputeTargetMap:
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
    inputs = _capture_inputs(model, layers, _keyword_batch(example_inputs))
    plans, by_signature = [], {}
    for layer, (args, kwargs) in zip(layers, inputs):
        kwargs = {name: (False if name == "use_cache" else None if name in _CACHE_ARGUMENTS else value)
                  for name, value in kwargs.items()}
        signature = layer_signature(layer, args, kwargs)
        if signature not in by_signature:
            by_signature[signature] = plan(layer, *args, budget=1.0, **kwargs)
        plans.append(by_signature[signature])
    total = total_budget_bytes(config.budget, plans)
    chosen = split(plans, total)
    _logger.info("%s: budget %r = %.2f MiB over %d layers (%d distinct): they hold %.2f MiB", type(model).__name__,
                 config.budget, total / 2**20, len(layers), len(by_signature),
                 sum(p.held_bytes for p in chosen) / 2**20)
    return chosen


def apply_recompute_config(model: nn.Module, config: RecomputeConfig | None = None, *,
                           target_map: RecomputeTargetMap | None = None, wrap_sites=None,
                           example_inputs=None) -> nn.Module:
    """Checkpoints a transformers model's layers as `config` says; returns the model.

    The layers are found by their class (decoder_layers; pass wrap_sites= to choose), the target
    map is the shipped one for model.config.model_type or one derived from the layers (pass
    target_map= to choose); a config without units needs none. A budget is planned per distinct
    layer on `example_inputs`, the keyword batch the model takes. Each selected layer is
    checkpointed through transformers' own per-layer hook (GradientCheckpointingLayer), handed
    the plugin's policy: transformers then also turns the KV cache off in training, as its
    gradient checkpointing does, so that the recompute does not write the cache a second time.
    sac_plugin.apply_recompute_config(model, config) calls this for a transformers model.
    """
    _check_model(model, "huggingface.apply_recompute_config")
    if config is not None and not isinstance(config, RecomputeConfig):
        raise TypeError("sac_plugin: huggingface.apply_recompute_config: config must be a RecomputeConfig or None, "
                        f"got {describe_value(config)}")
    config = RecomputeConfig() if config is None else config
    if example_inputs is not None and config.budget is None:
        raise ConfigError("apply_recompute_config: example_inputs are for planning a budget; the config sets no budget")
    layers = decoder_layers(model) if wrap_sites is None else _layers.wrap_sites(model, wrap_sites)
    for i, layer in enumerate(layers):
        if not _is_checkpointing_layer(layer):
            raise TypeError(
                f"sac_plugin: huggingface.apply_recompute_config: decoder layer {i} ({type(layer).__name__}) is not a "
                "transformers GradientCheckpointingLayer (transformers >= 4.52 has them); upgrade transformers, or "
                "call sac_plugin.apply_selective_checkpointing on each layer and pass use_cache=False"
            )
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
    for position, (index, policy) in enumerate(zip(selected, policies)):
        layer = layers[index]
        layer._sac_policy = policy  # marks it checkpointed (reports, a second apply)
        if plans is not None:
            layer._sac_plan = plans[position]
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint, use_reentrant=False, context_fn=context_fn(policy), preserve_rng_state=config.preserve_rng_state)
        layer.gradient_checkpointing = True
        layer._sac_undo = functools.partial(_undo, layer, True)
    # The base model turns use_cache off in training while this flag is set: a cache written in
    # the forward would be written again by the recompute.
    model.base_model.gradient_checkpointing = True
    model.base_model._sac_undo = functools.partial(_undo, model.base_model, False)
    if _logger.isEnabledFor(logging.INFO) and plans is None:
        _logger.info("%s", _layers.describe_application(type(model).__name__, selected, len(layers), policies[0],
                                                        config, target_map))
    return model


def gradient_checkpointing_kwargs(model: nn.Module, config: RecomputeConfig | None = None, *,
                                  target_map: RecomputeTargetMap | None = None, wrap_sites=None) -> dict:
    """The `gradient_checkpointing_kwargs` that make transformers' own checkpointing selective:

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=huggingface.gradient_checkpointing_kwargs(model, config))

    transformers checkpoints every layer, so the config must select every layer. The units that
    are callables are installed here on each layer (decoder_layers, or wrap_sites), as
    apply_recompute_config does. A budget is planned per layer: use apply_recompute_config.
    """
    _check_model(model, "huggingface.gradient_checkpointing_kwargs")
    config = RecomputeConfig() if config is None else config
    if not isinstance(config, RecomputeConfig):
        raise TypeError("sac_plugin: huggingface.gradient_checkpointing_kwargs: config must be a RecomputeConfig or "
                        f"None, got {describe_value(config)}")
    if config.budget is not None:
        raise ConfigError(
            "recompute config: gradient_checkpointing_kwargs hands every layer one policy, and a budget plans one per "
            "layer; use huggingface.apply_recompute_config(model, config, example_inputs=batch)"
        )
    if config.every_nth_layer != 1 or config.first_layer != 0 or config.layer_ratio not in (None, 1.0):
        raise ConfigError(
            "recompute config: transformers' gradient checkpointing checkpoints every decoder layer, so "
            "every_nth_layer, first_layer and layer_ratio cannot select fewer; use "
            "huggingface.apply_recompute_config(model, config) to checkpoint some layers"
        )
    layers = decoder_layers(model) if wrap_sites is None else _layers.wrap_sites(model, wrap_sites)
    target_map = _map_for(model, config, target_map, layers)
    policy = _prepare(model, config, target_map, layers, list(range(len(layers))))
    return {"use_reentrant": False, "context_fn": context_fn(policy), "preserve_rng_state": config.preserve_rng_state}
