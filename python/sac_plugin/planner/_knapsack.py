"""0/1 knapsack: the calls to keep that save the most recompute time within a byte capacity.

Exact dynamic programming over bytes. The byte grid is the greatest common divisor of the
weights (tensor sizes share large powers of two, so this is usually exact); when the capacity
spans more than MAX_CELLS grid cells, weights are rounded *up* to a coarser grid and the
capacity down, so the answer can only be under the budget, never over. Every answer is checked
against the true bytes before it is returned (torch's Hirschberg knapsack has overshot its
budget, pytorch#197871), then topped up greedily with whatever still fits in true bytes.
One table answers every capacity up to the largest, which is how a Pareto curve is drawn.

PairKnapsack is the same over two capacities at once, device and host bytes: each item is kept,
offloaded or neither (the planner's three outcomes where its host-memory cap binds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

MAX_CELLS = 1 << 16


class Knapsack:
    def __init__(self, weights: Sequence[int], values: Sequence[float], max_capacity: int):
        if len(weights) != len(values):
            raise ValueError(f"knapsack: {len(weights)} weights but {len(values)} values")
        for i, (w, v) in enumerate(zip(weights, values)):
            if not isinstance(w, int) or w <= 0:
                raise ValueError(f"knapsack: weight {i} must be a positive int (bytes), got {w!r}")
            if not v >= 0:
                raise ValueError(f"knapsack: value {i} must be >= 0 (seconds), got {v!r}")
        self.weights = [int(w) for w in weights]
        self.values = [float(v) for v in values]
        self.max_capacity = max(0, int(max_capacity))
        fitting = [w for w in self.weights if w <= self.max_capacity]
        grid = math.gcd(*fitting) if fitting else 1
        if self.max_capacity // grid > MAX_CELLS:
            grid = -(-self.max_capacity // MAX_CELLS)  # coarser: ceil, so cells <= MAX_CELLS
        self.grid = grid
        self.cells = self.max_capacity // grid
        # Rounded up: a set that fits in grid cells fits in true bytes.
        self._cells_of = [-(-w // grid) for w in self.weights]
        self._keep = torch.zeros(len(self.weights), self.cells + 1, dtype=torch.bool)
        best = torch.zeros(self.cells + 1, dtype=torch.float64)
        # One thread: rows of at most 65,537 cells gain nothing from intra-op threads, and on a
        # busy machine handing each of thousands of small ops to a pool costs more than the op.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i, (cells, value) in enumerate(zip(self._cells_of, self.values)):
                if cells > self.cells or value <= 0:
                    continue
                candidate = best[: self.cells + 1 - cells] + value
                better = candidate > best[cells:]
                self._keep[i, cells:] = better
                best[cells:] = torch.where(better, candidate, best[cells:])
        finally:
            torch.set_num_threads(threads)
        self._best = best

    def solve(self, capacity: int) -> list[int]:
        """Indices of the items to take: the most value whose true weight is <= capacity."""
        capacity = int(capacity)
        if capacity > self.max_capacity:
            raise ValueError(f"knapsack: capacity {capacity} exceeds the table's {self.max_capacity}")
        if capacity <= 0:
            return []
        cell = capacity // self.grid
        chosen = []
        for i in range(len(self.weights) - 1, -1, -1):
            if cell >= 0 and self._keep[i, cell]:
                chosen.append(i)
                cell -= self._cells_of[i]
        used = sum(self.weights[i] for i in chosen)
        if used > capacity:  # cannot happen with rounded-up weights; never return an overshoot
            raise RuntimeError(f"knapsack: the solution holds {used} bytes, over its capacity {capacity}")
        taken = set(chosen)
        rest = sorted(
            (i for i in range(len(self.weights)) if i not in taken and self.values[i] > 0),
            key=lambda i: (-self.values[i] / self.weights[i], i),
        )
        for i in rest:  # what rounding left out and still fits
            if used + self.weights[i] <= capacity:
                chosen.append(i)
                used += self.weights[i]
        return sorted(chosen)


def solve(weights: Sequence[int], values: Sequence[float], capacity: int) -> list[int]:
    return Knapsack(weights, values, capacity).solve(capacity)


MAX_PAIR_CELLS = 1 << 16
MAX_PAIR_CHOICES = 1 << 24  # items x cells: the int8 choices kept for the walk back


def _grid(weights: Sequence[int], capacity: int) -> int:
    fitting = [w for w in weights if w <= capacity]
    return math.gcd(*fitting) if fitting else 1


class PairKnapsack:
    """Each item goes to the device (its weight against the device capacity, value keep_values[i]),
    to the host (its weight against the host capacity, value host_values[i], None where the host
    may not take it) or to neither (value 0): the most value within both capacities.

    Exact dynamic programming over a grid of device cells x host cells (each axis on the gcd of its
    weights) while the table has at most MAX_PAIR_CELLS cells and the walk-back choices at most
    MAX_PAIR_CHOICES bytes; beyond that the axis with more cells is made coarser, weights rounded up
    and capacities down, so an answer can only be under a capacity, never over. One table answers
    every device capacity up to max_capacity (at the one host capacity)."""

    def __init__(
        self,
        weights: Sequence[int],
        keep_values: Sequence[float],
        host_values: Sequence[float | None],
        max_capacity: int,
        host_capacity: int,
    ):
        if not len(weights) == len(keep_values) == len(host_values):
            raise ValueError(
                f"knapsack: {len(weights)} weights, {len(keep_values)} keep values and {len(host_values)} host values"
            )
        for i, w in enumerate(weights):
            if not isinstance(w, int) or w <= 0:
                raise ValueError(f"knapsack: weight {i} must be a positive int (bytes), got {w!r}")
        self.weights = [int(w) for w in weights]
        self.max_capacity = max(0, int(max_capacity))
        self.host_capacity = max(0, int(host_capacity))
        offered = [i for i, v in enumerate(host_values) if v is not None and v > 0]
        self.device_grid = _grid(self.weights, self.max_capacity)
        self.host_grid = _grid([self.weights[i] for i in offered], self.host_capacity)
        limit = min(MAX_PAIR_CELLS, max(1, MAX_PAIR_CHOICES // max(1, len(self.weights))))
        while (self.max_capacity // self.device_grid + 1) * (self.host_capacity // self.host_grid + 1) > limit:
            if self.max_capacity // self.device_grid >= self.host_capacity // self.host_grid:
                self.device_grid *= 2
            else:
                self.host_grid *= 2
        rows, cols = self.max_capacity // self.device_grid + 1, self.host_capacity // self.host_grid + 1
        # Rounded up: a set that fits in cells fits in true bytes.
        self._device_cells = [-(-w // self.device_grid) for w in self.weights]
        self._host_cells = [-(-w // self.host_grid) for w in self.weights]
        self._host_offered = [v is not None and v > 0 for v in host_values]
        self._choice = torch.zeros(len(self.weights), rows, cols, dtype=torch.int8)
        best = torch.zeros(rows, cols, dtype=torch.float64)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in Knapsack: small tensors, many ops
        try:
            for i in range(len(self.weights)):
                d, h = self._device_cells[i], self._host_cells[i]
                if d < rows and keep_values[i] > 0:
                    candidate = best[: rows - d] + float(keep_values[i])
                    better = candidate > best[d:]
                    self._choice[i, d:][better] = 1
                    keep = best.clone()
                    keep[d:] = torch.where(better, candidate, best[d:])
                else:
                    keep = best
                if self._host_offered[i] and h < cols:
                    candidate = best[:, : cols - h] + float(host_values[i])
                    better = candidate > keep[:, h:]
                    self._choice[i, :, h:][better] = 2
                    keep = keep.clone() if keep is best else keep
                    keep[:, h:] = torch.where(better, candidate, keep[:, h:])
                best = keep
        finally:
            torch.set_num_threads(threads)
        self._rows, self._cols = rows, cols

    def solve(self, capacity: int) -> tuple[list[int], list[int]]:
        """(device items, host items): the most value within `capacity` device bytes and the host
        capacity, in true bytes."""
        capacity = int(capacity)
        if capacity > self.max_capacity:
            raise ValueError(f"knapsack: capacity {capacity} exceeds the table's {self.max_capacity}")
        row, col = max(0, capacity) // self.device_grid, self._cols - 1
        device, host = [], []
        for i in range(len(self.weights) - 1, -1, -1):
            choice = int(self._choice[i, row, col])
            if choice == 1:
                device.append(i)
                row -= self._device_cells[i]
            elif choice == 2:
                host.append(i)
                col -= self._host_cells[i]
        if (
            sum(self.weights[i] for i in device) > max(0, capacity)
            or sum(self.weights[i] for i in host) > self.host_capacity
        ):
            raise RuntimeError("knapsack: the solution is over a capacity: rounded-up weights make this impossible")
        return sorted(device), sorted(host)
