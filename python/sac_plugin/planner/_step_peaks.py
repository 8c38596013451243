"""The peak model of a planned training step (docs/memory-budget.md, "Planning a step for a
peak"): the profiling step runs with full recompute and is split into windows at each layer's
forward end and at each layer's output gradient; each window's measured peak plus what the plan's
layers hold there beyond full recompute (LayerChoice's terms, summed by window_peaks) is the
modelled peak. `choose` is a multiple-choice knapsack over the layers in forward order; the
per-call decision within a layer is the per-layer planner's (Plan.with_budget, split.candidates):
this module only chooses which of its plans each layer takes.
"""

from __future__ import annotations

import dataclasses

import torch

from ..policy import Policy
from ._cost import CopyCost
from ._plan import Plan
from ._plan_file import WINDOW_KINDS

MAX_CELLS = 1 << 14

FORWARD, HEAD, BACKWARD = WINDOW_KINDS


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
        if w.kind == FORWARD:
            peaks.append(w.peak + prefix[w.layer] + layers[w.layer].forward_extra)
        elif w.kind == HEAD:
            peaks.append(w.peak + prefix[count] + layers[-1].head_extra)
        else:
            before = layers[w.layer - 1].fetched_back if w.layer > 0 else 0
            peaks.append(w.peak + prefix[w.layer] + before + layers[w.layer].own_backward)
    return peaks


def _by_kind(windows: tuple[Window, ...], count: int):
    forward, backward, head = [0] * count, [0] * count, 0
    for w in windows:
        if w.kind == FORWARD:
            forward[w.layer] = w.peak
        elif w.kind == BACKWARD:
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


__all__ = ["BACKWARD", "FORWARD", "HEAD", "LayerChoice", "Window", "choose", "lowest_peak", "window_peaks"]
