"""A model's budget split over its layers: each distinct layer is profiled once, each wrap site
picks one point of its layer's Pareto curve, and the points are chosen together (a
multiple-choice knapsack over bytes) to save the most step time in total (recompute, and exposed
copies where a plan offloads), not by an even split. The answer is checked against the true bytes before it is used."""

from __future__ import annotations

import torch

from ._cost import budget_in_bytes, byte_budget
from ._plan import Plan

CANDIDATE_FRACTIONS = tuple(i / 40 for i in range(41))
MAX_CELLS = 1 << 14


def candidates(plan: Plan, extra_budgets=()) -> list[Plan]:
    """Plans of one layer at budgets across its curve, without repeats of the same choice."""
    seen, points = set(), []
    for budget in list(CANDIDATE_FRACTIONS) + [byte_budget(b) for b in extra_budgets]:
        candidate = plan.with_budget(budget)
        choice = (candidate.kept, candidate.offloaded)
        if choice not in seen:
            seen.add(choice)
            points.append(candidate)
    return points


def split(site_plans: list[Plan], total_bytes: int) -> list[Plan]:
    """One plan per site (sites sharing a Plan object are the same layer, solved once), holding
    at most `total_bytes` together where possible, maximising the step time saved."""
    if not site_plans:
        return []
    even_share = total_bytes // len(site_plans)
    options: dict[int, list[Plan]] = {}
    for plan in site_plans:
        if id(plan) not in options:
            options[id(plan)] = candidates(plan, extra_budgets=[even_share])
    grid = max(1, -(-max(total_bytes, 1) // MAX_CELLS))
    cells = total_bytes // grid
    neg = float("-inf")
    best = torch.full((cells + 1,), neg, dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for plan in site_plans:
        layer = options[id(plan)]
        new = torch.full_like(best, neg)
        pick = torch.full((cells + 1,), -1, dtype=torch.long)
        for j, option in enumerate(layer):
            w = -(-option.held_bytes // grid)  # rounded up: fits in cells => fits in bytes
            if w > cells:
                continue
            saved = option.full_recompute_seconds - option.overhead_seconds
            candidate = torch.full_like(best, neg)
            candidate[w:] = best[: cells + 1 - w] + saved
            better = candidate > new
            new = torch.where(better, candidate, new)
            pick = torch.where(better, torch.full_like(pick, j), pick)
        best = new
        choices.append(pick)
    if not torch.isfinite(best).any():
        # Even the floors do not fit: every site keeps only what its smallest plan keeps.
        return [min(options[id(p)], key=lambda o: o.held_bytes) for p in site_plans]
    cell = int(torch.argmax(best))
    chosen = [None] * len(site_plans)
    for i in range(len(site_plans) - 1, -1, -1):
        j = int(choices[i][cell])
        option = options[id(site_plans[i])][j]
        chosen[i] = option
        cell -= -(-option.held_bytes // grid)
    used = sum(p.held_bytes for p in chosen)
    if used > total_bytes:  # rounded-up weights make this impossible; never hand out an overshoot
        raise RuntimeError(f"sac_plugin: budget split holds {used} bytes, over the total {total_bytes}")
    return chosen


def total_budget_bytes(budget, site_plans: list[Plan]) -> int:
    """A fraction is of the summed no-checkpointing bytes of the sites; an int is bytes."""
    if isinstance(budget, float):
        return int(budget * sum(p.profile.no_checkpoint_bytes for p in site_plans))
    return int(budget)


__all__ = ["budget_in_bytes", "candidates", "split", "total_budget_bytes"]
