"""Applying a budget to a model's wrap sites (RecomputeConfig.budget): plan each distinct layer
once, split the budget, checkpoint every site with its plan's policy, and log the choice."""

from __future__ import annotations

import logging
import warnings

import torch
from torch.utils._pytree import tree_leaves

from .. import _compat
from .._forwards import InstanceForward
from ..checkpointing import apply_selective_checkpointing
from ._cost import byte_budget
from ._plan import Plan, profile_and_plan
from ._split import split, total_budget_bytes

log = logging.getLogger("sac_plugin")


def layer_signature(site: torch.nn.Module, args, kwargs) -> tuple:
    """What makes two layers the same planning problem: type, parameters and input shapes.

    Args:
        site: The layer.
        args: Its positional inputs.
        kwargs: Its keyword inputs.

    Returns:
        A hashable key, equal for two layers that plan alike.
    """

    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
        return ("value", type(value).__name__)

    params = tuple((name, tuple(p.shape), p.dtype) for name, p in site.named_parameters())
    return (type(site).__qualname__, params, tuple(describe(a) for a in tree_leaves((args, kwargs))))


def _describe(plan: Plan) -> str:
    return (
        f"keeps {len(plan.kept)} of {len(plan.profile.calls)} calls, holds {plan.held_bytes / 2**20:.2f} MiB of "
        f"{plan.profile.no_checkpoint_bytes / 2**20:.2f} MiB, recompute {plan.recompute_seconds * 1e3:.2f} ms of "
        f"{plan.full_recompute_seconds * 1e3:.2f} ms"
    )


def _capture_inputs(model, sites, example_inputs):
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[1], dict)
        and isinstance(example_inputs[0], tuple)
    ):
        args, kwargs = example_inputs
    elif isinstance(example_inputs, tuple):
        args, kwargs = example_inputs, {}
    else:
        raise TypeError(
            "sac_plugin: apply_recompute_config: example_inputs must be the model's positional arguments "
            f"as a tuple, or (args, kwargs), got {type(example_inputs).__name__}"
        )
    captured = {}

    def hook(index):
        def capture(module, call_args, call_kwargs):
            if index not in captured:

                def detach(v):
                    return v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v

                captured[index] = (tuple(detach(a) for a in call_args), {k: detach(v) for k, v in call_kwargs.items()})

        return capture

    handles = [site.register_forward_pre_hook(hook(i), with_kwargs=True) for i, site in enumerate(sites)]
    try:
        with torch.random.fork_rng():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in range(len(sites)) if i not in captured]
    if missing:
        raise ValueError(
            f"sac_plugin: apply_recompute_config: the example forward never called wrap sites {missing}; "
            "pass inputs that run every checkpointed layer"
        )
    return [captured[i] for i in range(len(sites))]


def apply_budget(model, sites, budget, example_inputs, *, preserve_rng_state: bool) -> None:
    """Checkpoints each wrap site with the plan a budget gives it.

    With `example_inputs`, the model runs once to capture each site's inputs, each distinct layer
    (layer_signature) is profiled once, and the total budget is split over the sites. Without
    them each site is planned on its first call within an equal share of the budget.

    Args:
        model: The model the sites belong to, run on `example_inputs`.
        sites: The wrap sites to checkpoint.
        budget: RecomputeConfig.budget: a fraction of the sites' activation bytes, or bytes.
        example_inputs: The model's positional arguments as a tuple, or (args, kwargs); or None.
        preserve_rng_state: apply_selective_checkpointing's.
    """
    if example_inputs is None:
        share = budget if isinstance(budget, float) else byte_budget(budget // max(1, len(sites)))
        cache: dict = {}
        for site in sites:
            _PlanOnFirstCall.install(site)
            site._sac_plan_request = (share, cache, preserve_rng_state)
        log.info(
            "sac_plugin: budget %r: %d layers are planned on their first call, each within %r",
            budget,
            len(sites),
            share,
        )
        return
    inputs = _capture_inputs(model, sites, example_inputs)
    plans, by_signature = [], {}
    for site, (args, kwargs) in zip(sites, inputs):
        signature = layer_signature(site, args, kwargs)
        if signature not in by_signature:
            by_signature[signature] = profile_and_plan(site, args, kwargs, budget=1.0)
        plans.append(by_signature[signature])
    total = total_budget_bytes(budget, plans)
    chosen = split(plans, total)
    for i, (site, plan) in enumerate(zip(sites, chosen)):
        apply_selective_checkpointing(site, plan.policy, preserve_rng_state=preserve_rng_state)
        log.info("sac_plugin: layer %d (%s): %s", i, type(site).__name__, _describe(plan))
    log.info(
        "sac_plugin: budget %r = %.2f MiB over %d layers (%d distinct): they hold %.2f MiB, recompute %.2f ms per step",
        budget,
        total / 2**20,
        len(sites),
        len(by_signature),
        sum(p.held_bytes for p in chosen) / 2**20,
        sum(p.recompute_seconds for p in chosen) * 1e3,
    )


def _why_not_plan_now() -> str | None:
    """Why a layer cannot be profiled where it is first called, or None when it can."""
    if _compat.is_compiling():
        return "it is first called while torch.compile traces it, where the profiling passes cannot run"
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        return (
            "it is first called inside another checkpointed region (or under saved_tensors_hooks), where the "
            "profiling passes would change what the outer region saves"
        )
    return None


_warned_fallbacks: set = set()


@torch._dynamo.disable
def _settle(module: torch.nn.Module, plan: Plan | None, reason: str | None, preserve_rng_state: bool) -> None:
    """Replaces the pending plan by checkpointing: the plan's policy, or full recompute with one
    warning per layer type and reason. Never leaves the layer unchecked. Run eagerly even under
    torch.compile: it changes the module, once."""
    module.__dict__.pop("forward", None)
    module.__dict__.pop("__prepare_scriptable__", None)
    module.__dict__.pop("_sac_plan_request", None)
    if plan is None:
        key = (type(module).__qualname__, reason.split(":")[0])
        if key not in _warned_fallbacks:
            _warned_fallbacks.add(key)
            warnings.warn(
                f"sac_plugin: a memory budget could not be planned for {type(module).__name__}: {reason}; "
                "it is checkpointed with full recompute instead (plan it with example_inputs at "
                "apply_recompute_config to plan before any call)",
                UserWarning,
                stacklevel=4,
            )
        log.info("sac_plugin: %s: budget not planned (%s); full recompute", type(module).__name__, reason)
    apply_selective_checkpointing(
        module, plan.policy if plan is not None else None, preserve_rng_state=preserve_rng_state
    )


class _PlanOnFirstCall(InstanceForward):
    """A wrap site's forward until its first call: plans the layer on that call's inputs (once
    per distinct layer), checkpoints it with the plan's policy, then runs the call. Where the
    layer cannot be planned (profiling raised, torch.compile is tracing, an outer checkpoint is
    running) it is checkpointed with full recompute, with one warning: never left unchecked."""

    __slots__ = ()
    what = "waiting for its first call to plan a memory budget (apply_recompute_config with a budget)"

    def __call__(self, *args, **kwargs):
        module = self.module
        share, cache, preserve_rng_state = module._sac_plan_request
        reason = _why_not_plan_now()
        plan = None
        if reason is None:
            signature = layer_signature(module, args, kwargs)
            plan = cache.get(signature)
            if plan is None:
                # The profiling passes run the class's own forward: the pending one steps aside
                # (and _settle below replaces it whatever happens).
                module.__dict__.pop("forward")
                try:
                    with torch.enable_grad():
                        plan = profile_and_plan(module, args, kwargs, budget=share)
                except Exception as error:  # noqa: BLE001 - any failure falls back, saying why
                    reason = f"profiling it raised {type(error).__name__}: {str(error).splitlines()[0][:300]}"
                else:
                    cache[signature] = plan
                    log.info("sac_plugin: planned %s within %r: %s", type(module).__name__, share, _describe(plan))
        _settle(module, plan, reason, preserve_rng_state)
        return module(*args, **kwargs)
