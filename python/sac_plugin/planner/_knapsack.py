"""0/1 knapsack: the calls to keep that save the most recompute time within a byte capacity.

Exact dynamic programming over bytes. The byte grid is the greatest common divisor of the
weights (tensor sizes share large powers of two, so this is usually exact); when the capacity
spans more than MAX_CELLS grid cells, weights are rounded *up* to a coarser grid and the
capacity down, so the answer can only be under the budget, never over. Every answer is checked
against the true bytes before it is returned (torch's Hirschberg knapsack has overshot its
budget, pytorch#197871), then topped up greedily with whatever still fits in true bytes.
One table answers every capacity up to the largest, which is how a Pareto curve is drawn.
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
        rest = sorted((i for i in range(len(self.weights)) if i not in taken and self.values[i] > 0),
                      key=lambda i: (-self.values[i] / self.weights[i], i))
        for i in rest:  # what rounding left out and still fits
            if used + self.weights[i] <= capacity:
                chosen.append(i)
                used += self.weights[i]
        return sorted(chosen)


def solve(weights: Sequence[int], values: Sequence[float], capacity: int) -> list[int]:
    return Knapsack(weights, values, capacity).solve(capacity)
