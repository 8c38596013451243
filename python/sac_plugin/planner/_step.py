"""Planning a training step for a peak-memory budget: profile the step once with full recompute of
every layer, measuring the device's peak in each stretch of it; profile each distinct layer (the
per-layer planner); choose one point of each layer's curve so that the modelled peak stays within
the budget for the least predicted step time; apply, run the step again, measure, and tighten
where the measurement is over.

    plan = sac_plugin.plan_step(model, lambda: model.loss(tokens, targets).backward(), peak_bytes=8 << 30)
    assert plan.measured_peak <= 8 << 30
    print(plan.table()); plan.save("step.json")

The peak model is docs/memory-budget.md's ("Planning a step for a peak"): the profiling step runs
with full recompute and is split into windows at each layer's forward end and at each layer's
output gradient; each window's measured peak plus what the plan's layers hold there beyond full
recompute (LayerChoice's terms, summed by window_peaks) is the modelled peak. `choose` is a
multiple-choice knapsack over the layers in forward order; the per-call decision within a layer is
the per-layer planner's (Plan.with_budget, split.candidates): this module only chooses which of
its plans each layer takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from .._forwards import _offloadable_input as offloadable_input
from ..checkpointing import apply_selective_checkpointing, check_checkpointable, remove_checkpointing
from .._validation import bounded_repr, describe_value
from ..policy import Policy
from . import _fields
from ._apply import layer_signature
from ._cost import CopyCost, PlanError, unreachable_budget
from ._plan import Plan, profile_and_plan
from ._plan_file import read_plan_file, write_plan_file
from ._profile import leaves_no_trace
from ._split import candidates

FORMAT = "sac_plugin.step_plan"
VERSION = 1
READABLE_VERSIONS = (1,)
MAX_CELLS = 1 << 14
MiB = 2**20

log = logging.getLogger("sac_plugin")

_FORWARD, _HEAD, _BACKWARD = "forward", "head", "backward"


@dataclasses.dataclass(frozen=True)
class Window:
    """One stretch of the profiled step and the peak the device reached in it under full recompute:
    `kind` "forward" (layer `layer`'s forward, from the end of the one before), "head" (from the
    last layer's forward to its gradient: the loss and its backward), or "backward" (layer `layer`'s
    backward, until its input's gradient). `layer` counts in forward order; None for the head."""

    kind: str
    layer: int | None
    peak: int


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer's part of a step plan: its qualified name in the model, the per-layer plan it
    takes, whether it offloads its inputs, and the device bytes of those inputs."""

    name: str
    plan: Plan
    offload_inputs: bool = False
    input_bytes: int = 0

    @property
    def delta(self) -> int:
        """Device bytes it holds between forward and backward beyond full recompute."""
        return self.plan.kept_bytes - (self.input_bytes if self.offload_inputs else 0)

    @property
    def forward_extra(self) -> int:
        """Device bytes beyond full recompute that its forward may hold at once."""
        return self.plan.kept_bytes + self.plan.offloaded_bytes

    @property
    def fetched_back(self) -> int:
        """Bytes copied back to the device while the backward is in the layer after it."""
        return self.plan.offloaded_bytes + (self.input_bytes if self.offload_inputs else 0)

    @property
    def own_backward(self) -> int:
        """Bytes beyond full recompute in its own backward: its offloaded outputs, fetched back when
        its recompute begins and held to its end, where recomputed ones would go as they are used."""
        return self.plan.offloaded_bytes

    @property
    def head_extra(self) -> int:
        """As the last layer, bytes beyond its delta in the head: its inputs' copies to the host,
        queued after its forward, may not have run yet."""
        return self.input_bytes if self.offload_inputs else 0

    @property
    def input_copy_seconds(self) -> float:
        """The input copies' time that the layer's compute does not hide (its forward kernel time
        standing in for the windows each way)."""
        if not self.offload_inputs or self.plan.offload is None:
            return 0.0
        window = sum(c.seconds for c in self.plan.profile.calls)
        model = self.plan.offload
        return CopyCost(
            self.input_bytes / model.d2h_bytes_per_s, self.input_bytes / model.h2d_bytes_per_s, window, window
        ).exposed

    @property
    def overhead_seconds(self) -> float:
        return self.plan.overhead_seconds + self.input_copy_seconds

    @property
    def policy(self) -> Policy:
        if not self.offload_inputs:
            return self.plan.policy
        p = self.plan.policy
        return Policy(
            kept_calls=p.kept_calls,
            kept_units=p.kept_units,
            recomputed_units=p.recomputed_units,
            offloaded_calls=p.offloaded_calls,
            offload_min_bytes=p.offload_min_bytes,
            host_memory_limit=p.host_memory_limit,
            offload_inputs=True,
        )

    def _terms(self) -> tuple:
        return (
            self.delta,
            self.forward_extra,
            self.fetched_back,
            self.own_backward,
            self.head_extra,
            self.overhead_seconds,
        )


def window_peaks(windows: tuple[Window, ...], layers) -> list[int]:
    """Each window's modelled peak with `layers` (one LayerChoice per layer, in forward order):
    the measured full-recompute peak plus what the plan adds there (the module docstring)."""
    count = len(layers)
    prefix = [0]
    for choice in layers:
        prefix.append(prefix[-1] + choice.delta)
    peaks = []
    for w in windows:
        if w.kind == _FORWARD:
            peaks.append(w.peak + prefix[w.layer] + layers[w.layer].forward_extra)
        elif w.kind == _HEAD:
            peaks.append(w.peak + prefix[count] + layers[-1].head_extra)
        else:
            before = layers[w.layer - 1].fetched_back if w.layer > 0 else 0
            peaks.append(w.peak + prefix[w.layer] + before + layers[w.layer].own_backward)
    return peaks


def _by_kind(windows: tuple[Window, ...], count: int):
    forward, backward, head = [0] * count, [0] * count, 0
    for w in windows:
        if w.kind == _FORWARD:
            forward[w.layer] = w.peak
        elif w.kind == _BACKWARD:
            backward[w.layer] = w.peak
        else:
            head = w.peak
    return forward, backward, head


def choose(windows: tuple[Window, ...], options: list[list[LayerChoice]], peak: int) -> list[LayerChoice] | None:
    """The options (one per layer, in forward order) of least total overhead whose modelled peak is
    within `peak` in every window; None when none is. A knapsack over the layers in forward order
    whose state is the prefix of their deltas, on a grid whose cells round each delta up (never
    under-counted), and the bytes the layer before fetches back (a layer's backward window depends
    on its own choice and the one before): a row per distinct value."""
    count = len(options)
    forward, backward, head = _by_kind(windows, count)
    negative = sum(max(0, -min(o.delta for o in layer)) for layer in options)
    positive = sum(max(0, max(o.delta for o in layer)) for layer in options)
    grid = max(1, -(-(negative + positive) // MAX_CELLS))
    base = -(-negative // grid)
    cells = base + -(-positive // grid) + count + 1
    values = (torch.arange(cells, dtype=torch.int64) - base) * grid  # each cell's prefix, an upper bound
    inf = float("inf")
    cost = torch.full((1, cells), inf, dtype=torch.float64)  # rows: what the layer before fetches back
    cost[0, base] = 0.0
    fetched = torch.zeros((1, 1), dtype=torch.int64)
    picks = []
    for j, layer in enumerate(options):
        rows = sorted({o.fetched_back for o in layer})
        row_of = {f: i for i, f in enumerate(rows)}
        best = torch.full((len(rows), cells), inf, dtype=torch.float64)
        pick = torch.full((len(rows), cells), -1, dtype=torch.long)
        came_from = torch.full((len(rows), cells), -1, dtype=torch.long)
        for k, option in enumerate(layer):
            fits = (values + forward[j] + option.forward_extra <= peak) & (
                values + backward[j] + fetched + option.own_backward <= peak
            )
            source, source_row = torch.where(fits, cost + option.overhead_seconds, inf).min(dim=0)
            step = -(-option.delta // grid)
            shifted = torch.full((cells,), inf, dtype=torch.float64)
            rows_from = torch.zeros((cells,), dtype=torch.long)
            if step >= 0:
                shifted[step:], rows_from[step:] = source[: cells - step], source_row[: cells - step]
            else:
                shifted[: cells + step], rows_from[: cells + step] = source[-step:], source_row[-step:]
            if j + 1 == count:
                shifted = torch.where(values + head + option.head_extra <= peak, shifted, inf)
            row = row_of[option.fetched_back]
            better = shifted < best[row]
            best[row] = torch.where(better, shifted, best[row])
            pick[row] = torch.where(better, k, pick[row])
            came_from[row] = torch.where(better, rows_from, came_from[row])
        cost = best
        fetched = torch.tensor(rows, dtype=torch.int64)[:, None]
        picks.append((pick, came_from))
    if not torch.isfinite(cost).any():
        return None
    # The first of equal costs: the least fetched back, then the least held.
    row, cell = divmod(int(torch.argmin(cost)), cells)
    chosen = [None] * count
    for j in range(count - 1, -1, -1):
        pick, came_from = picks[j]
        option = options[j][int(pick[row, cell])]
        chosen[j] = option
        row = int(came_from[row, cell])
        cell -= -(-option.delta // grid)
    return chosen


def lowest_peak(windows: tuple[Window, ...], options: list[list[LayerChoice]]) -> int:
    """The lowest budget `choose` finds a plan for (a binary search: a larger budget only loosens
    every window). Full recompute of every layer is among the options, so it is at most the
    profiled step's peak."""
    high = max(window_peaks(windows, [layer[0] for layer in options]))
    low = 0
    while low < high:
        middle = (low + high) // 2
        if choose(windows, options, middle) is None:
            low = middle + 1
        else:
            high = middle
    return high


# --- profiling the step -------------------------------------------------------------------------------


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _to(value, device):
    """A copy of each tensor argument on `device`, detached, with its requires_grad."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True).requires_grad_(value.requires_grad)
    return value


class _StepWatch:
    """The hooks of the profiling step: they close a window (read the device's peak since the
    last one and reset it) at each layer's forward end and each layer's output gradient, count
    each layer's calls, and keep a host copy of the inputs of the first layer of each kind."""

    def __init__(self, layers, device, capture: bool = True):
        self.capture = capture
        self.layers = layers
        self.device = device
        self.order: list[int] = []  # indices into layers, in the order the forward called them
        self.calls = [0] * len(layers)
        self.grads: list[int] = []  # positions (in forward order) in the order their gradients came
        self.windows: list[Window] = []
        self.inputs: dict = {}  # signature -> host copies of (args, kwargs)
        self.signatures: list = [None] * len(layers)
        self.input_bytes = [0] * len(layers)
        self._handles = []

    def close(self, kind: str, layer: int | None) -> None:
        self.windows.append(Window(kind, layer, torch.accelerator.max_memory_allocated(self.device.index)))
        torch.accelerator.reset_peak_memory_stats(self.device.index)

    def __enter__(self):
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._before(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._after(index)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return False

    def _before(self, index):
        def hook(module, args, kwargs):
            self.calls[index] += 1
            if self.calls[index] > 1 or not self.capture:
                return None
            signature = layer_signature(module, args, kwargs)
            self.signatures[index] = signature
            if signature not in self.inputs:
                self.inputs[signature] = (
                    tuple(_to(a, "cpu") for a in args),
                    {k: _to(v, "cpu") for k, v in kwargs.items()},
                )
            # What Policy(offload_inputs=True) takes off the device: the positional inputs the
            # runtime offloads (the activation through the stack), each storage once.
            seen = set()
            for t in args:
                if offloadable_input(t) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    self.input_bytes[index] += t.untyped_storage().nbytes()
            return None

        return hook

    def _after(self, index):
        def hook(module, args, output):
            if self.calls[index] > 1:
                return None
            position = len(self.order)
            self.order.append(index)
            self.close(_FORWARD, position)
            grads = [t for t in _tensors(output) if t.requires_grad]
            if grads:
                grads[0].register_hook(lambda grad: self._gradient(position))
            return None

        return hook

    def _gradient(self, position: int) -> None:
        if self.grads:
            self.close(_BACKWARD, self.grads[-1])
        else:
            self.close(_HEAD, None)
        self.grads.append(position)

    def finish(self, names) -> None:
        """Closes the last window and checks that the step is a stack the model describes."""
        if self.grads:
            self.close(_BACKWARD, self.grads[-1])
        for index, calls in enumerate(self.calls):
            if calls != 1:
                raise ValueError(
                    f"sac_plugin: plan_step: the step called layer {names[index]!r} {calls} times; "
                    "plan_step plans a step that calls each layer once"
                )
        count = len(self.order)
        if self.grads != list(range(count - 1, -1, -1)):
            missing = [names[self.order[p]] for p in range(count) if p not in self.grads]
            if missing:
                raise ValueError(
                    f"sac_plugin: plan_step: the step's backward never reached the output of layer "
                    f"{missing[0]!r}; plan_step plans a step whose loss depends on every layer"
                )
            raise ValueError(
                "sac_plugin: plan_step: the step's backward did not run the layers in the reverse of "
                "their forward order, which the peak model assumes"
            )


def _no_trace(model: torch.nn.Module, device: torch.device):
    """Every run of the step starts from the state plan_step was called in: parameter gradients,
    buffers (kept on the host meanwhile: no device bytes) and the RNG streams are restored."""
    return leaves_no_trace(model, [device.index or 0] if device.type == "cuda" else [], buffers_on_host=True)


# Why a step may not change the parameters, as both refusals below say it.
_SAME_STATE = (
    "plan_step runs the step several times from the same state, so the step must run forward, loss and backward only"
)


def _parameters_named(names: list[str]) -> str:
    """The parameters as a message names them: 1 parameter (a), 5 parameters (a, b, c and 2 more)."""
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''} ({listed})"


@contextlib.contextmanager
def _parameters_unchanged(model: torch.nn.Module):
    """The step runs several times from the same state, so it must not change the parameters: an
    optimizer's step on this thread is refused before it changes anything (the parameters and the
    optimizer's state stay as they were), and any other in-place change of a parameter (its
    version counter moved) is refused by name after the step."""
    names = {id(p): name for name, p in model.named_parameters()}
    versions = [(name, p, p._version) for name, p in model.named_parameters()]
    thread = threading.get_ident()

    def refuse(optimizer, args, kwargs):
        if threading.get_ident() != thread:
            return None
        ours = [names[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in names]
        if not ours:
            return None
        raise ValueError(
            f"sac_plugin: plan_step: the step calls {type(optimizer).__name__}.step(), which would change "
            f"{_parameters_named(ours)} and the optimizer's state; {_SAME_STATE}: call the optimizer after "
            "plan_step (refused before it ran: nothing was changed)"
        )

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()
    changed = [name for name, p, version in versions if p._version != version]
    if changed:
        raise ValueError(
            f"sac_plugin: plan_step: the step changed {_parameters_named(changed)} in place; {_SAME_STATE}, "
            "without changing the parameters (this change stays: plan_step keeps no copy of the parameters "
            "to undo it)"
        )


def _run(step: Callable[[], object], model, layers, names, device, *, capture: bool) -> _StepWatch:
    """One run of the step, window by window (the hooks allocate nothing on the device, so the
    largest window's peak is the step's)."""
    watch = _StepWatch(layers, device, capture)
    with watch, _no_trace(model, device), _parameters_unchanged(model):
        torch.accelerator.synchronize(device)
        torch.accelerator.reset_peak_memory_stats(device.index)
        step()
        torch.accelerator.synchronize(device)
        watch.finish(names)
    return watch


# --- the plan -------------------------------------------------------------------------------------------


class StepPlan:
    """A training step's plan: one LayerChoice per layer in forward order, the profiled step's
    windows, the budget, the modelled peak and the peak measured with the plan applied.

    `plan_step` makes one, and `StepPlan.load` reads one back; the constructor is theirs.

    Args:
        peak_bytes: The budget: the device's peak allocated bytes over the step.
        windows: The profiled step's windows (kind, layer, peak): each layer's forward, the head
            (loss and its backward), each layer's backward, with the peak full recompute reached.
        layers: One choice per layer (name, plan, offload_inputs, input_bytes): the layer's
            qualified name, the per-layer Plan it takes, whether it offloads its inputs, and the
            device bytes of those inputs.
        measured_peak: The step's peak measured with the plan applied; None before it ran.
        measured_windows: Each window's peak measured with the plan applied; None before it ran.
        offload: Whether the plan was allowed to offload.
    """

    def __init__(
        self,
        peak_bytes: int,
        windows: tuple[Window, ...],
        layers: tuple[LayerChoice, ...],
        *,
        measured_peak: int | None = None,
        measured_windows: tuple[int, ...] | None = None,
        offload: bool = False,
    ):
        self.peak_bytes = peak_bytes
        self.windows = tuple(windows)
        self.layers = tuple(layers)
        self.measured_peak = measured_peak
        # Each window's peak measured with the plan applied (None before it runs).
        self.measured_windows = None if measured_windows is None else tuple(measured_windows)
        self.offload = offload

    @property
    def full_recompute_peak(self) -> int:
        """The profiled step's peak: full recompute of every layer, measured."""
        return max(w.peak for w in self.windows)

    @property
    def predicted_peak(self) -> int:
        """The modelled peak with the plan applied: the highest window's."""
        return max(window_peaks(self.windows, self.layers))

    @property
    def overhead_seconds(self) -> float:
        """Predicted time the plan adds to a step over no checkpointing: recompute and exposed copies."""
        return sum(choice.overhead_seconds for choice in self.layers)

    @property
    def policies(self) -> dict[str, Policy]:
        """Each layer's policy, by its qualified name in the model."""
        return {choice.name: choice.policy for choice in self.layers}

    def apply(self, model: torch.nn.Module, *, preserve_rng_state: bool = True) -> torch.nn.Module:
        """Checkpoints each planned layer of `model` (found by its qualified name) with its policy.
        Every layer is found and checked before any is changed.

        Args:
            model: The model the plan was made for (or one of the same structure).
            preserve_rng_state: apply_selective_checkpointing's.

        Returns:
            `model`, its planned layers checkpointed.

        Raises:
            TypeError: `model` is not a torch.nn.Module.
            ValueError: A planned layer is missing, or is already checkpointed.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"sac_plugin: StepPlan.apply: model must be a torch.nn.Module, got {describe_value(model)}")
        modules = dict(model.named_modules())
        found = []
        for choice in self.layers:
            layer = modules.get(choice.name)
            if layer is None:
                raise ValueError(
                    f"sac_plugin: StepPlan.apply: {type(model).__name__} has no submodule "
                    f"{choice.name!r}, which the plan plans"
                )
            check_checkpointable(layer, f"StepPlan.apply: layer {choice.name!r}")
            found.append(layer)
        policies = [choice.policy for choice in self.layers]
        for layer, policy in zip(found, policies):
            apply_selective_checkpointing(layer, policy, preserve_rng_state=preserve_rng_state)
        return model

    def __repr__(self) -> str:
        measured = (
            "not measured"
            if self.measured_peak is None
            else f"measured {self.measured_peak} ({self.measured_peak / MiB:.2f} MiB)"
        )
        return (
            f"StepPlan(peak_bytes={self.peak_bytes} ({self.peak_bytes / MiB:.2f} MiB): predicted peak "
            f"{self.predicted_peak} ({self.predicted_peak / MiB:.2f} MiB), {measured}; full recompute "
            f"{self.full_recompute_peak / MiB:.2f} MiB; {len(self.layers)} layers, overhead "
            f"{self.overhead_seconds * 1e3:.3f} ms)"
        )

    def rows(self) -> list[dict]:
        """What each layer keeps and offloads, and what that costs.

        Returns:
            One dict per layer, in forward order: name, offload_inputs, kept_calls, kept_bytes,
                offloaded_calls, offloaded_bytes (its inputs included where it offloads them),
                held_bytes and overhead_seconds.
        """
        return [
            {
                "name": c.name,
                "offload_inputs": c.offload_inputs,
                "kept_calls": len(c.plan.kept),
                "kept_bytes": c.plan.kept_bytes,
                "offloaded_calls": len(c.plan.offloaded),
                "offloaded_bytes": c.plan.offloaded_bytes + (c.input_bytes if c.offload_inputs else 0),
                "held_bytes": c.plan.held_bytes,
                "overhead_seconds": c.overhead_seconds,
            }
            for c in self.layers
        ]

    def table(self) -> str:
        """Per layer what it keeps and offloads and what that costs; per window the measured
        full-recompute peak and the plan's modelled one.

        Returns:
            The table, as text.
        """
        lines = [
            repr(self),
            f"{'layer':<28}{'inputs':>8}{'kept':>6}{'kept MiB':>10}{'offloaded':>10}{'host MiB':>10}"
            f"{'held MiB':>10}{'overhead ms':>13}",
        ]
        for r in self.rows():
            lines.append(
                f"{r['name']:<28}{'host' if r['offload_inputs'] else 'device':>8}{r['kept_calls']:>6}"
                f"{r['kept_bytes'] / MiB:>10.3f}{r['offloaded_calls']:>10}{r['offloaded_bytes'] / MiB:>10.3f}"
                f"{r['held_bytes'] / MiB:>10.3f}{r['overhead_seconds'] * 1e3:>13.3f}"
            )
        lines += ["", f"{'window':<36}{'full recompute MiB':>20}{'modelled MiB':>14}{'measured MiB':>14}"]
        measured = self.measured_windows or (None,) * len(self.windows)
        for w, peak, seen in zip(self.windows, window_peaks(self.windows, self.layers), measured):
            lines.append(
                f"{self._window_name(w):<36}{w.peak / MiB:>20.3f}{peak / MiB:>14.3f}"
                + (f"{seen / MiB:>14.3f}" if seen is not None else f"{'-':>14}")
            )
        return "\n".join(lines)

    def _window_name(self, w: Window) -> str:
        return "head (loss and its backward)" if w.kind == _HEAD else f"{w.kind} {self.layers[w.layer].name}"

    # --- plot -------------------------------------------------------------------------------------------

    def plot(self, path, *, layer: str | None = None, title: str | None = None) -> Path:
        """A PNG of the step's memory: each window's measured full-recompute peak and this plan's
        modelled one, against the budget and the measured peak. With `layer` (a planned layer's
        name), that layer's Pareto curve instead (Plan.plot). Needs matplotlib.

        Args:
            path: The PNG file to write.
            layer: A planned layer's qualified name, or None for the whole step.
            title: The plot's title; None: a default.

        Returns:
            The path written.

        Raises:
            ValueError: `layer` is not a planned layer.
            ImportError: matplotlib is not installed.
        """
        if layer is not None:
            by_name = {c.name: c for c in self.layers}
            if layer not in by_name:
                raise ValueError(
                    f"sac_plugin: StepPlan.plot: layer must be one of the planned layers "
                    f"({', '.join(by_name)}), got {bounded_repr(layer)}"
                )
            return by_name[layer].plan.plot(path, title=title)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "sac_plugin: StepPlan.plot needs matplotlib, which is not installed; install the extra: "
                "pip install 'sac_plugin[plot]' (or pip install matplotlib)"
            ) from None
        path = _path_of(path, "plot")
        names = [self._window_name(w) for w in self.windows]
        positions = range(len(self.windows))
        fig, ax = plt.subplots(figsize=(max(6.4, 0.45 * len(names)), 4.4))
        ax.step(
            positions, [w.peak / MiB for w in self.windows], where="mid", marker=".", label="full recompute (measured)"
        )
        ax.step(
            positions,
            [p / MiB for p in window_peaks(self.windows, self.layers)],
            where="mid",
            marker=".",
            color="C9",
            label="this plan (modelled)",
        )
        ax.axhline(self.peak_bytes / MiB, color="C3", linestyle="--", label="peak_bytes")
        if self.measured_peak is not None:
            ax.axhline(self.measured_peak / MiB, color="black", linestyle=":", label="measured peak with the plan")
        ax.set_xticks(list(positions))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("device MiB allocated (peak in the window)")
        ax.set_title(title or "sac_plugin step plan")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    # --- files ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The plan as plain data: the step plan file's JSON object.

        Returns:
            A dict that `from_dict` reads back to an equal plan.
        """
        return {
            "format": FORMAT,
            "version": VERSION,
            "torch": torch.__version__.split("+")[0],
            "peak_bytes": self.peak_bytes,
            "measured_peak": self.measured_peak,
            "measured_windows": None if self.measured_windows is None else list(self.measured_windows),
            "offload": self.offload,
            "windows": [{"kind": w.kind, "layer": w.layer, "peak": w.peak} for w in self.windows],
            "layers": [
                {
                    "name": c.name,
                    "offload_inputs": c.offload_inputs,
                    "input_bytes": c.input_bytes,
                    "plan": c.plan.to_dict(),
                }
                for c in self.layers
            ],
        }

    def save(self, path) -> Path:
        """Writes the plan as a JSON step plan file.

        Args:
            path: The file.

        Returns:
            The path written.

        Raises:
            TypeError: `path` is not a str or os.PathLike.
        """
        return write_plan_file(_path_of(path, "save"), self.to_dict())

    @classmethod
    def load(cls, path) -> StepPlan:
        """Reads a step plan file that `save` wrote.

        Args:
            path: The file.

        Returns:
            The plan.

        Raises:
            TypeError: `path` is not a str or os.PathLike.
            PlanError: The file cannot be read, or is not a valid step plan.
        """
        path = _path_of(path, "load")
        return cls.from_dict(read_plan_file(path, "step plan file"), where=f"step plan file {path}")

    @classmethod
    def from_dict(cls, data, where: str = "step plan") -> StepPlan:
        """A step plan from to_dict's form; every field is checked against its declaration and
        each layer's plan as Plan.from_dict checks it: anything wrong is a PlanError naming it.

        Args:
            data: The plan as to_dict gives it (a parsed step plan file).
            where: What error messages call the data.

        Returns:
            The plan.

        Raises:
            PlanError: A field is missing, has the wrong type, or contradicts another.
        """
        try:
            return cls._from_checked_dict(data, where)
        except _fields.FileError as error:
            raise PlanError(f"sac_plugin: {where}: {error}") from None

    @classmethod
    def _from_checked_dict(cls, data, where: str) -> StepPlan:
        fail = _fields.FileError
        if not isinstance(data, Mapping):
            raise fail(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise fail(
                f"'format' must be {FORMAT!r}, got {bounded_repr(data.get('format'))}: not a sac_plugin step plan"
            )
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
            raise fail(
                f"version {bounded_repr(version)} is not supported; this sac_plugin reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        fields = _fields.check_object(data, _STEP_FIELDS, "", version)
        if fields["peak_bytes"] < 1:
            raise fail(f"peak_bytes must be an int >= 1, got {fields['peak_bytes']}")
        layers = []
        for i, entry in enumerate(fields["layers"]):
            layer = _fields.check_object(entry, _LAYER_FIELDS, f"layers[{i}]", version)
            try:
                layer_plan = Plan.from_dict(layer["plan"], where=f"{where}: layers[{i}].plan")
            except PlanError as error:
                raise fail(str(error).removeprefix(f"sac_plugin: {where}: ")) from None
            if layer["offload_inputs"] and layer_plan.offload is None:
                raise fail(f"layers[{i}] offloads its inputs but its plan has no offload model")
            layers.append(LayerChoice(layer["name"], layer_plan, layer["offload_inputs"], layer["input_bytes"]))
        if not layers:
            raise fail("layers is empty: a step plan plans at least one layer")
        names = [c.name for c in layers]
        if len(set(names)) != len(names):
            raise fail("layers names one layer twice")
        windows = []
        for i, entry in enumerate(fields["windows"]):
            w = _fields.check_object(entry, _WINDOW_FIELDS, f"windows[{i}]", version)
            windows.append(Window(w["kind"], w["layer"], w["peak"]))
        expected = (
            [(_FORWARD, j) for j in range(len(layers))]
            + [(_HEAD, None)]
            + [(_BACKWARD, j) for j in range(len(layers) - 1, -1, -1)]
        )
        if [(w.kind, w.layer) for w in windows] != expected:
            raise fail(
                f"windows must be, in order, the forward of each of the {len(layers)} layers, the head and "
                "each layer's backward in reverse"
            )
        seen = fields["measured_windows"]
        if seen is not None and len(seen) != len(windows):
            raise fail(f"measured_windows has {len(seen)} peaks for {len(windows)} windows")
        return cls(
            fields["peak_bytes"],
            tuple(windows),
            tuple(layers),
            measured_peak=fields["measured_peak"],
            measured_windows=seen,
            offload=fields["offload"],
        )


_STEP_FIELDS = (
    _fields.Field("format", _fields.TEXT),
    _fields.Field("version", _fields.COUNT),
    _fields.Field("torch", _fields.TEXT, required=False),
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
_WINDOW_FIELDS = (
    _fields.Field(
        "kind", _fields.Kind("one of 'forward', 'head', 'backward'", lambda v: v in (_FORWARD, _HEAD, _BACKWARD))
    ),
    _fields.Field("layer", _fields.OPTIONAL_COUNT),
    _fields.Field("peak", _fields.COUNT),
)
_LAYER_FIELDS = (
    _fields.Field("name", _fields.TEXT),
    _fields.Field("offload_inputs", _fields.FLAG),
    _fields.Field("input_bytes", _fields.COUNT),
    _fields.Field("plan", _fields.OBJECT),
)


def _path_of(path, method: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"sac_plugin: StepPlan.{method} expects a path (str or os.PathLike), got {describe_value(path)}"
        )
    return Path(path)


# --- plan_step ------------------------------------------------------------------------------------------


def _check_count(name: str, value, least: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"sac_plugin: plan_step: {name} must be an int >= {least} ({what}), got {describe_value(value)}"
        )


def _find_layers(model: torch.nn.Module, layers) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each layer to plan: `layers`, or the model's declared wrap sites
    (recompute_wrap_sites(), as apply_recompute_config finds them)."""
    if layers is None:
        declared = getattr(model, "recompute_wrap_sites", None)
        if not callable(declared):
            raise ValueError(
                f"sac_plugin: plan_step: {type(model).__name__} declares no layers (no "
                "recompute_wrap_sites() method); pass layers=[the layers to checkpoint]"
            )
        layers, where = declared(), f"{type(model).__name__}.recompute_wrap_sites()"
    else:
        where = "plan_step: layers"
    if isinstance(layers, (str, bytes, torch.nn.Module)) or not isinstance(layers, (list, tuple)):
        raise TypeError(f"sac_plugin: {where} must be a list of the model's submodules, got {describe_value(layers)}")
    if not layers:
        raise ValueError(f"sac_plugin: {where} is empty: plan_step plans at least one layer")
    names = {id(module): name for name, module in model.named_modules()}
    found, seen = [], {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"sac_plugin: {where}[{i}] must be an nn.Module, got {describe_value(layer)}")
        if id(layer) in seen:
            raise ValueError(
                f"sac_plugin: {where} lists one {type(layer).__name__} twice (at {seen[id(layer)]} and {i})"
            )
        seen[id(layer)] = i
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


def _profile_layers(watch: _StepWatch, modules, device, plan_arguments) -> list[Plan]:
    """Each layer's plan (sac_plugin.plan's) in forward order, each distinct layer profiled once on
    device copies of the inputs it got. The copies are this function's alone: they are freed when
    it returns, so the runs that verify a plan measure none of them."""
    by_signature: dict = {}
    layer_plans = []
    for index in watch.order:
        signature = watch.signatures[index]
        if signature not in by_signature:
            args, kwargs = watch.inputs[signature]
            args = tuple(_to(a, device) for a in args)
            kwargs = {k: _to(v, device) for k, v in kwargs.items()}
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
        watch = _run(step, model, modules, names, device, capture=True)
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
            run = _run(step, model, modules, names, device, capture=False)
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


__all__ = ["LayerChoice", "StepPlan", "Window", "choose", "lowest_peak", "plan_step", "window_peaks"]
