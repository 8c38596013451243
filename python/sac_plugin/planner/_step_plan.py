"""A training step's plan as a value (`StepPlan`): one LayerChoice per layer in forward order, the
profiled step's windows and the budget; what it predicts and measured, its table and plot, and its
file (planner/_plan_file.py's step plan format). `plan_step` (planner/_step.py) makes one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .._plot import finish_chart, import_matplotlib
from ..checkpointing import apply_selective_checkpointing, check_checkpointable
from .._validation import bounded_repr, describe_value
from ..policy import Policy
from . import _fields
from . import _plan_file as plan_file
from ._cost import PlanError
from ._plan import Plan
from ._step_peaks import HEAD, LayerChoice, Window, window_peaks

MiB = 2**20


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
        return "head (loss and its backward)" if w.kind == HEAD else f"{w.kind} {self.layers[w.layer].name}"

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
        plt = import_matplotlib(
            "matplotlib.pyplot",
            "sac_plugin: StepPlan.plot needs matplotlib, which is not installed; install the extra: "
            "pip install 'sac_plugin[plot]' (or pip install matplotlib)",
            agg=True,
        )
        path = plan_file.path_of(path, "StepPlan.plot")
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
        return finish_chart(plt, fig, ax, path, title or "sac_plugin step plan")

    # --- files ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The plan as plain data: the step plan file's JSON object.

        Returns:
            A dict that `from_dict` reads back to an equal plan.
        """
        return plan_file.step_plan_to_dict(self)

    def save(self, path) -> Path:
        """Writes the plan as a JSON step plan file.

        Args:
            path: The file.

        Returns:
            The path written.

        Raises:
            TypeError: `path` is not a str or os.PathLike.
        """
        return plan_file.write_plan_file(plan_file.path_of(path, "StepPlan.save"), self.to_dict())

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
        path = plan_file.path_of(path, "StepPlan.load")
        return cls.from_dict(plan_file.read_plan_file(path, "step plan file"), where=f"step plan file {path}")

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
        contents = plan_file.step_plan_contents(data, where, Plan.from_dict)
        return cls(
            contents.peak_bytes,
            tuple(Window(*window) for window in contents.windows),
            tuple(LayerChoice(*layer) for layer in contents.layers),
            measured_peak=contents.measured_peak,
            measured_windows=contents.measured_windows,
            offload=contents.offload,
        )


__all__ = ["StepPlan"]
