"""Hugging Face transformers: target maps for decoder (and encoder) layers, and one call to checkpoint a model.

    from sac_plugin.integrations import huggingface
    huggingface.apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))

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

Beside it: a model's structure (_huggingface_layers.py), transformers' own per-layer hook
(_huggingface_hook.py), a config made ready on the layers (_huggingface_prepare.py) and the
context_fn of gradient_checkpointing_kwargs (_huggingface_contexts.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence

from torch import nn

from .. import _layers
from .._logging import logger as _logger
from .._validation import bounded_repr, describe_value
from ..config import ConfigError, RecomputeConfig
from ..targets import KeptCallables, RecomputeTargetMap
from ..units import RecomputeUnit
from ..checkpointing import context_fn
from ._huggingface_contexts import _checkpoint_func, _LayerContexts

# Pickled kwargs (a Trainer checkpoint's training_args.bin) may name their restorer by this public
# module, so it is importable from here too.
from ._huggingface_contexts import _restored_contexts  # noqa: F401
from ._huggingface_hook import (
    _check_layers,
    _check_model,
    _disabled_by_transformers,
    _enable_through_transformers,
    _undo,
)
from ._huggingface_layers import (
    _NORMS,
    _ROUTING,
    _declares_experts,
    _dense,
    _is_checkpointing_layer,
    _layer_paths,
    _model_type,
    _unwrapped,
)
from ._huggingface_prepare import _plan_layers, _prepare

__all__ = [
    "apply_recompute_config",
    "decoder_layers",
    "derived_target_map",
    "gradient_checkpointing_kwargs",
    "is_hf_model",
    "target_map_for",
]


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


def apply_recompute_config(
    model: nn.Module,
    config: RecomputeConfig | None = None,
    *,
    target_map: RecomputeTargetMap | None = None,
    wrap_sites: Sequence[nn.Module] | None = None,
    example_inputs: Mapping | None = None,
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
