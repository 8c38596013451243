"""The context_fn that gradient_checkpointing_kwargs hands transformers (_LayerContexts): the
plugin's policy for every layer transformers checkpoints, on the model the kwargs were built on
or on another instance; and the checkpoint function a layer whose policy offloads its inputs is
handed instead of torch's."""

from __future__ import annotations

import dataclasses
import functools
import sys
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _layers
from .._config_policy import policy_for
from .._forwards import checkpoint_call, run_in_unit
from .._logging import logger as _logger
from ..checkpointing import context_fn
from ..config import ConfigError, RecomputeConfig
from ..targets import KeptCallables, RecomputeTargetMap


def _offloading_config(config: RecomputeConfig) -> RecomputeConfig:
    """What `activation_checkpointing_enable(..., offload=True)` means for a config handed over as
    sac_plugin kwargs: what the config keeps (its kept units and ops) is offloaded instead, by the
    plugin's own offload (side streams, pinned host memory), never transformers' save_on_cpu on
    the compute stream, and so are the layers' inputs, which full recompute still holds
    (offload_inputs). The every-nth rule stays kept."""
    return dataclasses.replace(
        config,
        kept_units=(),
        kept_ops=(),
        offloaded_units=config.kept_units + config.offloaded_units,
        offloaded_ops=config.kept_ops + config.offloaded_ops,
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
            _layers.check_forward_runs(self._target_map, unit, owner, name, self._config.field_of(unit))
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
