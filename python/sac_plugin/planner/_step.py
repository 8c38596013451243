"""Planning a training step for a peak-memory budget: profile the step once with full recompute of
every layer, measuring the device's peak in each stretch of it (_step_profile.py); profile each
distinct layer (the per-layer planner); choose one point of each layer's curve so that the modelled
peak (_step_peaks.py) stays within the budget for the least predicted step time; apply, run the
step again, measure, and tighten where the measurement is over. The result is a StepPlan
(_step_plan.py).

    plan = sac_plugin.plan_step(model, lambda: model.loss(tokens, targets).backward(), peak_bytes=8 << 30)
    assert plan.measured_peak <= 8 << 30
    print(plan.table()); plan.save("step.json")
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..checkpointing import apply_selective_checkpointing, check_checkpointable, remove_checkpointing
from .._validation import describe_value
from .._wrap_sites import given_or_declared
from . import _fields
from ._cost import PlanError, unreachable_budget
from ._plan import Plan, profile_and_plan
from ._split import candidates
from ._step_peaks import LayerChoice, choose, lowest_peak
from ._step_plan import MiB, StepPlan
from ._step_profile import StepWatch, copy_to, run_step

log = logging.getLogger("sac_plugin")


def _check_count(name: str, value, least: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"sac_plugin: plan_step: {name} must be an int >= {least} ({what}), got {describe_value(value)}"
        )


def _find_layers(model: torch.nn.Module, layers) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each layer to plan: `layers`, or the model's declared wrap sites
    (recompute_wrap_sites(), as apply_recompute_config finds them)."""
    layers, where = given_or_declared(
        model,
        layers,
        caller="plan_step",
        argument="layers",
        noun="layers",
        elements="the model's submodules",
        containers=(list, tuple),
        prefix="sac_plugin: plan_step: ",
    )
    if not layers:
        raise ValueError(f"sac_plugin: {where} is empty: plan_step plans at least one layer")
    names = {id(module): name for name, module in model.named_modules()}
    found = []
    for i, layer in enumerate(layers):
        if id(layer) not in names or layer is model:
            raise ValueError(
                f"sac_plugin: {where}[{i}] ({type(layer).__name__}) is not a submodule of the {type(model).__name__}"
            )
        check_checkpointable(layer, f"plan_step: layer {names[id(layer)]!r}")
        found.append((names[id(layer)], layer))
    return found


def _device_of(model: torch.nn.Module) -> torch.device:
    if not torch.accelerator.is_available():
        raise ValueError(
            "sac_plugin: plan_step: measuring a step's peak needs an accelerator's memory statistics "
            "(torch.accelerator), and none is available"
        )
    kind = torch.accelerator.current_accelerator().type
    for p in model.parameters():
        if p.device.type == kind:
            return p.device
    places = sorted({str(p.device) for p in model.parameters()}) or ["no parameters"]
    raise ValueError(
        f"sac_plugin: plan_step: measuring a step's peak needs the model on the {kind} accelerator "
        f"(its memory statistics), but its parameters are on {', '.join(places)}"
    )


def _profile_layers(watch: StepWatch, modules, device, plan_arguments) -> list[Plan]:
    """Each layer's plan (sac_plugin.plan's) in forward order, each distinct layer profiled once on
    device copies of the inputs it got. The copies are this function's alone: they are freed when
    it returns, so the runs that verify a plan measure none of them."""
    by_signature: dict = {}
    layer_plans = []
    for index in watch.order:
        signature = watch.signatures[index]
        if signature not in by_signature:
            args, kwargs = watch.inputs[signature]
            args = tuple(copy_to(a, device) for a in args)
            kwargs = {k: copy_to(v, device) for k, v in kwargs.items()}
            by_signature[signature] = profile_and_plan(modules[index], args, kwargs, **plan_arguments)
        layer_plans.append(by_signature[signature])
    return layer_plans


def _options(choice_plan: Plan, name: str, input_bytes: int, offload: bool, extra_budgets) -> list[LayerChoice]:
    """One layer's candidates, full recompute first: its Pareto points, two-way and (with offload)
    three-way, and with offload the same again with its inputs offloaded."""
    full = Plan(choice_plan.profile, 0, frozenset(), offload=choice_plan.offload)
    plans = [full] + candidates(choice_plan, extra_budgets)
    if choice_plan.offload is not None:
        plans += candidates(choice_plan.without_offload(), extra_budgets)
    options, seen = [], set()
    for p in plans:
        for inputs in (False, True) if offload and choice_plan.offload is not None and input_bytes else (False,):
            option = LayerChoice(name, p, inputs, input_bytes)
            if option._terms() not in seen:
                seen.add(option._terms())
                options.append(option)
    return options


def plan_step(
    model: torch.nn.Module,
    step: Callable[[], object],
    *,
    peak_bytes: int,
    layers=None,
    offload: bool = False,
    runs: int = 3,
    warmup: int = 1,
    max_rounds: int = 3,
    offload_bandwidth: tuple[float, float] | None = None,
    offload_min_bytes: int | None = None,
    preserve_rng_state: bool = True,
) -> StepPlan:
    """Plans one training step so that the device's peak allocated memory stays within
    `peak_bytes`, for the least predicted step time, applies the plan to the layers and returns it.

    `step` is called with no arguments and runs one step's forward, loss and backward on `model`
    (a closure over the model and a batch; no optimizer step: it must not change the parameters, and
    a step that calls an optimizer's step or changes a parameter in place is refused by name).
    Each run of it starts from the state plan_step was called in: parameter gradients, buffers and
    the RNG state are restored after it. The layers are `layers` (the model's submodules, each
    called once per step) or the model's `recompute_wrap_sites()`. The model must be on an
    accelerator: the peak is the device's `max_memory_allocated`.

    The step runs once with full recompute of every layer, measured window by window; each distinct
    layer (type, parameter and input shapes) is profiled once (`sac_plugin.plan`); each layer takes
    one of its plans so that the modelled peak of every window is within the budget
    (docs/memory-budget.md, "Planning a step for a peak"). With offload=True a layer may offload
    outputs and its inputs (Policy(offload_inputs=True)), which lets a plan go below full
    recompute's peak. The step then runs with the plan applied; where the measured peak is over the
    budget, the plan is made again for a budget lowered by the excess, at most `max_rounds` times.
    A budget no plan reaches is a PlanError naming the lowest reachable peak. On any error the
    model is left unchanged.

    runs and warmup are each layer's profile's (sac_plugin.plan); offload_bandwidth and
    offload_min_bytes (with offload=True) are sac_plugin.plan's too; preserve_rng_state is
    apply_selective_checkpointing's.

    Args:
        model: The model, on an accelerator.
        step: Runs one forward, loss and backward of `model` when called with no arguments.
        peak_bytes: The budget: the device's peak allocated bytes over the step.
        layers: The layers to plan, each called once per step; None: `model.recompute_wrap_sites()`.
        offload: Whether plans may offload outputs and the layers' inputs to pinned host memory.
        runs: Timed forwards per layer profile.
        warmup: Untimed forwards per layer profile, before the timed ones.
        max_rounds: How many times the step runs with a plan applied, tightening the budget.
        offload_bandwidth: `sac_plugin.plan`'s: (device_to_host, host_to_device) copy bandwidths in
            bytes per second; None: measured.
        offload_min_bytes: `sac_plugin.plan`'s: outputs smaller than this are not offloaded.
        preserve_rng_state: apply_selective_checkpointing's.

    Returns:
        The plan, applied to the layers.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument is out of range, or the model is not on an accelerator.
        PlanError: No plan reaches `peak_bytes`; the message names the lowest reachable peak, which
            is also the error's `lowest_bytes`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sac_plugin: plan_step: model must be a torch.nn.Module, got {describe_value(model)}")
    if not callable(step):
        raise TypeError(
            "sac_plugin: plan_step: step must be a callable that runs one training step (forward, loss "
            f"and backward) when called with no arguments, got {describe_value(step)}"
        )
    if isinstance(peak_bytes, bool) or not isinstance(peak_bytes, int) or not 1 <= peak_bytes <= _fields.INT64_MAX:
        raise ValueError(
            "sac_plugin: plan_step: peak_bytes must be an int from 1 to 2**63 - 1 (bytes of device memory, "
            f"such as 8 * 2**30), got {describe_value(peak_bytes)}"
        )
    if not isinstance(offload, bool):
        raise TypeError(f"sac_plugin: plan_step: offload must be True or False, got {describe_value(offload)}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(
            f"sac_plugin: plan_step: preserve_rng_state must be True or False, got {describe_value(preserve_rng_state)}"
        )
    _check_count("runs", runs, 1, "timed forwards per layer")
    _check_count("warmup", warmup, 0, "untimed forwards per layer")
    _check_count("max_rounds", max_rounds, 1, "runs of the step with a plan applied")
    if not offload and (offload_bandwidth is not None or offload_min_bytes is not None):
        raise ValueError("sac_plugin: plan_step: offload_bandwidth and offload_min_bytes only apply with offload=True")
    named = _find_layers(model, layers)
    device = _device_of(model)
    names = [name for name, _ in named]
    modules = [module for _, module in named]

    applied: list[torch.nn.Module] = []

    def apply(policies) -> None:
        for module, policy in zip(modules, policies):
            apply_selective_checkpointing(module, policy, preserve_rng_state=preserve_rng_state)
            applied.append(module)

    def undo() -> None:
        while applied:
            remove_checkpointing(applied.pop())

    try:
        # 1. The step with full recompute of every layer, window by window.
        apply([None] * len(modules))
        watch = run_step(step, model, modules, names, device, capture=True)
        undo()
        windows = tuple(watch.windows)
        order = watch.order
        # 2. Each distinct layer, profiled once on the inputs it got.
        plan_arguments = {"budget": 1.0, "runs": runs, "warmup": warmup}
        if offload:
            plan_arguments.update(
                offload=True, offload_bandwidth=offload_bandwidth, offload_min_bytes=offload_min_bytes
            )
        layer_plans = _profile_layers(watch, modules, device, plan_arguments)
        full_recompute_peak = max(w.peak for w in windows)

        def options_for(target: int) -> list[list[LayerChoice]]:
            # The room full recompute leaves, spread over 1 to all layers, as extra budgets.
            room = max(0, target - full_recompute_peak)
            count = len(order)
            return [
                _options(
                    layer_plan,
                    names[index],
                    watch.input_bytes[index],
                    offload,
                    [layer_plan.profile.full_recompute_bytes + room * k // count for k in range(1, count + 1)],
                )
                for layer_plan, index in zip(layer_plans, order)
            ]

        # 3. Choose, apply, measure; where the measurement is over, choose again for a budget lowered
        # by the excess. Full recompute is the profiled step itself: where it fits, it is the last
        # resort when the lowered budget is below every plan, or the rounds run out.
        full_recompute = [layer[0] for layer in options_for(peak_bytes)]
        target, measured, fell_back = peak_bytes, [], False
        while True:
            options = options_for(target)
            chosen = choose(windows, options, target) if len(measured) < max_rounds else None
            if chosen is None and not measured:
                lowest = lowest_peak(windows, options)
                how = (
                    "each layer keeping, offloading or recomputing each call and offloading its inputs"
                    if offload
                    else "full recompute of every layer; offload=True may go lower"
                )
                raise unreachable_budget(
                    "plan_step",
                    f"peak_bytes={peak_bytes} ({peak_bytes / MiB:.2f} MiB)",
                    "the lowest reachable peak",
                    lowest,
                    how,
                )
            if chosen is None:
                if fell_back or full_recompute_peak > peak_bytes:
                    raise PlanError(
                        f"sac_plugin: plan_step: no plan kept the measured peak within peak_bytes="
                        f"{peak_bytes} ({peak_bytes / MiB:.2f} MiB): {len(measured)} plans measured "
                        f"{', '.join(map(str, measured))} bytes"
                    )
                chosen, fell_back = full_recompute, True
            result = StepPlan(peak_bytes, windows, tuple(chosen), offload=offload)
            apply([choice.policy for choice in chosen])
            run = run_step(step, model, modules, names, device, capture=False)
            peak = max(w.peak for w in run.windows)
            measured.append(peak)
            log.info(
                "sac_plugin: plan_step: round %d: predicted peak %d bytes, measured %d, budget %d",
                len(measured),
                result.predicted_peak,
                peak,
                peak_bytes,
            )
            if peak <= peak_bytes:
                result.measured_peak = peak
                result.measured_windows = tuple(w.peak for w in run.windows)
                return result
            undo()
            # The model was short by the excess: assume it is short by as much again, and never
            # take a plan predicted as high as this one.
            target = min(target - (peak - peak_bytes), result.predicted_peak - 1)
    except BaseException:
        undo()
        raise


__all__ = ["plan_step"]
