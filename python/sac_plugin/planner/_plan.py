"""A memory-budget plan for one layer: which calls to keep, chosen from a measured profile.

    plan = sac_plugin.plan(layer, x, cos, sin, budget=0.3)   # 30% of its no-checkpointing bytes
    sac_plugin.apply_selective_checkpointing(layer, plan.policy)
    print(plan.table()); plan.plot("plan.png"); plan.save("plan.json")

The budget bounds the bytes the checkpointed layer holds between forward and backward, counted
as sac_plugin.memory and benchmarks/bench_memory.py count them: what full recompute holds anyway (the
layer's inputs: the floor) plus the outputs the plan keeps. A fraction is of the bytes the layer
holds without checkpointing; an int is bytes. The kept outputs are chosen by an exact 0/1
knapsack (knapsack.py) that maximises the kernel time the recompute skips.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..policy import Policy, bounded_repr, describe_value
from .. import _rule
from . import _knapsack as knapsack
from ._profile import LayerProfile, ProfiledCall, profile_layer

FORMAT = "sac_plugin.plan"
VERSION = 1
PARETO_BUDGETS = tuple(i / 20 for i in range(21))


class PlanError(ValueError):
    """A budget or a plan file that cannot be used; the message says what is wrong and what is right."""


def check_budget(budget, where: str = "budget"):
    """A fraction in [0, 1] (float) or a byte count >= 0 (int)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"sac_plugin: {where} must be a fraction of the layer's no-checkpointing activation bytes "
                        f"(a float from 0.0 to 1.0) or a byte count (an int >= 0), got {describe_value(budget)}")
    if isinstance(budget, float) and not (math.isfinite(budget) and 0.0 <= budget <= 1.0):
        raise PlanError(f"sac_plugin: {where} as a fraction must be from 0.0 to 1.0, got {budget!r}; pass an int "
                        "for a byte count")
    if isinstance(budget, int) and budget < 0:
        raise PlanError(f"sac_plugin: {where} as a byte count must be >= 0, got {budget}")
    return budget


def _overload(op: str) -> str:
    """The single overload a profiled op name means: "aten::mm" -> "aten::mm.default"."""
    return op if "." in op.partition("::")[2] else op + ".default"


class Plan:
    """The calls one layer keeps within a byte budget, and what that is predicted to cost."""

    def __init__(self, profile: LayerProfile, budget, kept: frozenset[tuple[str, int]], *, table_cache=None):
        self.profile = profile
        self.budget = budget
        self.kept = frozenset(kept)
        by_key = {(c.op, c.index): c for c in profile.calls}
        self.kept_bytes = sum(by_key[k].bytes for k in self.kept)
        self.held_bytes = profile.full_recompute_bytes + self.kept_bytes
        self.recompute_seconds = self.full_recompute_seconds - sum(by_key[k].seconds for k in self.kept)
        calls: dict[str, list[int]] = {}
        for op, index in sorted(self.kept):
            calls.setdefault(_overload(op), []).append(index)
        self.policy = Policy(kept_calls=calls)
        self._knapsack = table_cache

    # --- what it is -------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return budget_in_bytes(self.budget, self.profile)

    @property
    def full_recompute_seconds(self) -> float:
        """Kernel time of the calls a recompute that keeps nothing runs."""
        return sum(c.seconds for c in self.profile.calls if c.recomputed)

    def __repr__(self) -> str:
        mib = 2**20
        return (f"Plan(budget={self.budget!r}: {self.budget_bytes / mib:.2f} MiB, keeps {len(self.kept)} of "
                f"{len(self.profile.calls)} calls, holds {self.held_bytes / mib:.2f} MiB of "
                f"{self.profile.no_checkpoint_bytes / mib:.2f}, recompute {self.recompute_seconds * 1e3:.3f} ms of "
                f"{self.full_recompute_seconds * 1e3:.3f})")

    def rows(self) -> list[dict]:
        """Per op and unit: calls, bytes, time, and how many of them are kept."""
        groups: dict[tuple[str, str], dict] = {}
        for c in self.profile.calls:
            row = groups.setdefault((c.op, c.unit), {"op": c.op, "unit": c.unit, "calls": 0, "kept": 0, "bytes": 0,
                                                     "kept_bytes": 0, "seconds": 0.0, "saved_seconds": 0.0,
                                                     "not_keepable": c.why_not_keepable})
            kept = (c.op, c.index) in self.kept
            row["calls"] += 1
            row["bytes"] += c.bytes
            row["seconds"] += c.seconds
            row["kept"] += kept
            row["kept_bytes"] += c.bytes if kept else 0
            row["saved_seconds"] += c.seconds if kept else 0.0
        return sorted(groups.values(), key=lambda r: (-r["seconds"], r["op"], r["unit"]))

    def table(self) -> str:
        mib = 2**20
        lines = [repr(self), f"{'op':<48}{'unit':<14}{'calls':>6}{'kept':>6}{'MiB':>9}{'kept MiB':>10}"
                             f"{'ms':>9}{'saved ms':>10}  not keepable"]
        for r in self.rows():
            lines.append(f"{r['op']:<48}{r['unit'] or '-':<14}{r['calls']:>6}{r['kept']:>6}{r['bytes'] / mib:>9.3f}"
                         f"{r['kept_bytes'] / mib:>10.3f}{r['seconds'] * 1e3:>9.3f}{r['saved_seconds'] * 1e3:>10.3f}"
                         f"  {r['not_keepable']}")
        return "\n".join(lines)

    # --- other budgets ------------------------------------------------------------------------------

    def pareto(self, budgets=PARETO_BUDGETS) -> list[dict]:
        """For each budget (fractions from 0 to 1 by default): the plan's predicted held bytes and
        recompute time. One knapsack table answers them all."""
        solver = self._solver()
        points = []
        for budget in budgets:
            kept = _choose(self.profile, check_budget(budget, "pareto: budget"), solver)
            plan = Plan(self.profile, budget, kept, table_cache=solver)
            points.append({"budget": budget, "budget_bytes": plan.budget_bytes, "held_bytes": plan.held_bytes,
                           "kept_bytes": plan.kept_bytes, "kept_calls": len(kept),
                           "recompute_seconds": plan.recompute_seconds})
        return points

    def with_budget(self, budget) -> Plan:
        """The same profile planned for another budget (no new measurement)."""
        return Plan(self.profile, check_budget(budget), _choose(self.profile, budget, self._solver()),
                    table_cache=self._solver())

    def evaluate(self, policy: Policy) -> dict:
        """What a hand-written policy is predicted to hold and recompute on this profile: kept ops,
        every-nth rules, kept calls, and kept units (by each call's innermost unit)."""
        if not isinstance(policy, Policy):
            raise TypeError(f"sac_plugin: Plan.evaluate: policy must be a sac_plugin.Policy, got {describe_value(policy)}")
        kept = [c for c in self.profile.calls if (c.op, c.index) in self.calls_kept_by(policy)]
        kept_bytes = sum(c.bytes for c in kept)
        return {"held_bytes": self.profile.full_recompute_bytes + kept_bytes, "kept_bytes": kept_bytes,
                "recompute_seconds": self.full_recompute_seconds - sum(c.seconds for c in kept if c.recomputed)}

    def calls_kept_by(self, policy: Policy) -> frozenset[tuple[str, int]]:
        """The profiled calls, as (op, index among the op's calls), that `policy` keeps: each
        asked of the one keep rule (docs/semantics.md) with its op, index and innermost unit."""
        if not isinstance(policy, Policy):
            raise TypeError(f"sac_plugin: Plan.calls_kept_by: policy must be a sac_plugin.Policy, got "
                            f"{describe_value(policy)}")
        return _kept_by(policy, self.profile)

    def _solver(self) -> knapsack.Knapsack:
        if self._knapsack is None:
            self._knapsack = _solver_for(self.profile)
        return self._knapsack

    # --- plot ------------------------------------------------------------------------------------

    def plot(self, path, policies: Mapping[str, Policy] | None = None, *, title: str | None = None) -> Path:
        """A PNG of the Pareto curve (held bytes against recompute time), this plan and the
        hand-written `policies` (default: sac_plugin.planner.reference_policies()) marked."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("sac_plugin: Plan.plot needs matplotlib, which is not installed; install the extra: "
                              "pip install 'sac_plugin[plot]' (or pip install matplotlib)") from None
        path = _path_of(path, "plot")
        from ._reference import reference_policies

        policies = reference_policies() if policies is None else policies
        base = self.profile.no_checkpoint_bytes or 1
        points = self.pareto()
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        ax.step([p["held_bytes"] / base for p in points], [p["recompute_seconds"] * 1e3 for p in points],
                where="post", marker=".", label="plan (Pareto curve)")
        # Policies can land on one point (the units policy of a layer that opens no units keeps
        # what "attention kept" keeps): each gets its own hollow marker, the first ones largest and
        # drawn on top, so a marker under another still shows as a ring around it.
        markers = ["o", "s", "D", "^", "v", "P", "X", "*"]
        count = len(policies)
        for i, (name, policy) in enumerate(policies.items()):
            e = self.evaluate(policy)
            ax.scatter([e["held_bytes"] / base], [e["recompute_seconds"] * 1e3], marker=markers[i % len(markers)],
                       s=40 + 45 * (count - i), facecolors="none", edgecolors=f"C{i + 1}", linewidths=1.6,
                       zorder=3 + count - i, label=name)
        ax.scatter([self.held_bytes / base], [self.recompute_seconds * 1e3], marker="x", s=70, color="black",
                   zorder=4 + count, label=f"this plan (budget {self.budget})")
        ax.set_xlabel("activation bytes held / no checkpointing")
        ax.set_ylabel("recompute kernel time (ms)")
        ax.set_title(title or "sac_plugin memory-budget plan")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def curve(self) -> str:
        """The Pareto curve as text, for terminals."""
        base = self.profile.no_checkpoint_bytes or 1
        lines = [f"{'budget':>7}{'held MiB':>10}{'held/none':>10}{'kept calls':>11}{'recompute ms':>14}"]
        for p in self.pareto():
            lines.append(f"{p['budget']:>7.2f}{p['held_bytes'] / 2**20:>10.3f}{p['held_bytes'] / base:>10.3f}"
                         f"{p['kept_calls']:>11}{p['recompute_seconds'] * 1e3:>14.3f}")
        return "\n".join(lines)

    # --- files -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        p = self.profile
        return {
            "format": FORMAT, "version": VERSION, "torch": torch.__version__.split("+")[0],
            "budget": self.budget,
            "no_checkpoint_bytes": p.no_checkpoint_bytes, "full_recompute_bytes": p.full_recompute_bytes,
            "runs": p.runs,
            "calls": [{"op": c.op, "index": c.index, "unit": c.unit, "bytes": c.bytes, "seconds": c.seconds,
                       "not_keepable": c.why_not_keepable, "recomputed": c.recomputed} for c in p.calls],
            "kept": [[op, index] for op, index in sorted(self.kept)],
        }

    def save(self, path) -> Path:
        path = _path_of(path, "save")
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path) -> Plan:
        path = _path_of(path, "load")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise PlanError(f"sac_plugin: plan file {path}: cannot read it: {error}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"sac_plugin: plan file {path}: not valid JSON: {error}") from None
        return cls.from_dict(data, where=f"plan file {path}")

    @classmethod
    def from_dict(cls, data, where: str = "plan") -> Plan:
        def fail(message):
            raise PlanError(f"sac_plugin: {where}: {message}")

        if not isinstance(data, Mapping):
            fail(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            fail(f"'format' must be {FORMAT!r}, got {bounded_repr(data.get('format'))}: not a sac_plugin plan")
        if data.get("version") != VERSION:
            fail(f"version {bounded_repr(data.get('version'))} is not supported; this sac_plugin reads version {VERSION}")
        known = {"format", "version", "torch", "budget", "no_checkpoint_bytes", "full_recompute_bytes", "runs",
                 "calls", "kept"}
        for key in data:
            if key not in known:
                fail(f"unknown key {bounded_repr(key)}; known keys: {', '.join(sorted(known))}")
        for key in known - {"torch"}:
            if key not in data:
                fail(f"missing key {key!r}")
        try:
            budget = check_budget(data["budget"], "budget")
        except (TypeError, ValueError) as error:
            fail(str(error).removeprefix("sac_plugin: "))
        for key in ("no_checkpoint_bytes", "full_recompute_bytes", "runs"):
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 0:
                fail(f"{key!r} must be an int >= 0, got {bounded_repr(data[key])}")
        if not isinstance(data["calls"], list):
            fail(f"'calls' must be a list, got {type(data['calls']).__name__}")
        calls = []
        fields = {"op": str, "index": int, "unit": str, "bytes": int, "seconds": (int, float), "not_keepable": str,
                  "recomputed": bool}
        for i, call in enumerate(data["calls"]):
            if not isinstance(call, Mapping) or set(call) != set(fields):
                fail(f"calls[{i}] must be an object with keys {', '.join(fields)}, got {bounded_repr(call)}")
            for key, kind in fields.items():
                value = call[key]
                if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind) or \
                        (key in ("index", "bytes", "seconds") and not 0 <= value < math.inf):
                    fail(f"calls[{i}].{key} must be a finite non-negative "
                         f"{kind.__name__ if isinstance(kind, type) else 'number'}, got {bounded_repr(value)}")
            calls.append(ProfiledCall(call["op"], call["index"], call["unit"], call["bytes"], float(call["seconds"]),
                                      call["not_keepable"], call["recomputed"]))
        by_key = {(c.op, c.index): c for c in calls}
        if len(by_key) != len(calls):
            fail("calls lists one (op, index) twice")
        if not isinstance(data["kept"], list):
            fail(f"'kept' must be a list of [op, index] pairs, got {type(data['kept']).__name__}")
        kept = set()
        for i, pair in enumerate(data["kept"]):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], int)):
                fail(f"kept[{i}] must be an [op, index] pair, got {bounded_repr(pair)}")
            call = by_key.get(tuple(pair))
            if call is None:
                fail(f"kept[{i}] = {bounded_repr(pair)} is not a profiled call")
            if not call.keepable:
                fail(f"kept[{i}] = {bounded_repr(pair)} cannot be kept: {call.why_not_keepable}")
            kept.add(tuple(pair))
        profile = LayerProfile(tuple(calls), data["no_checkpoint_bytes"], data["full_recompute_bytes"], data["runs"])
        try:
            result = cls(profile, budget, frozenset(kept))
        except ValueError as error:  # an op this torch does not have
            fail(f"its kept calls do not make a policy here: {error}")
        if result.held_bytes > result.budget_bytes and result.kept:
            fail(f"it keeps {result.kept_bytes} bytes, so it holds {result.held_bytes}, over its budget of "
                 f"{result.budget_bytes} bytes")
        return result


def budget_in_bytes(budget, profile: LayerProfile) -> int:
    if isinstance(budget, float):
        return int(budget * profile.no_checkpoint_bytes)
    return int(budget)


def _kept_by(policy: Policy, profile: LayerProfile) -> frozenset[tuple[str, int]]:
    """The profiled calls `policy` keeps: the one C++ rule (docs/semantics.md), asked call by call
    in the order the forward made them, through the call decider that also numbers the calls for
    every-nth and kept-call rules exactly as the engines do (a call in a recomputed unit takes no
    number). Each call is asked with the innermost unit it ran in."""
    decider = _rule.CallDecider(policy)
    kept = set()
    for call in profile.calls:
        units = (call.unit,) if call.unit else ()
        decision = decider.decide(_overload(call.op), False, units)
        # A call after the recompute stops is decided as kept but not held (NOTE: [Kept outputs
        # the recompute never reaches]): it holds no bytes and saves no time.
        if decision.keep and call.keepable:
            kept.add((call.op, call.index))
    return frozenset(kept)


def _solver_for(profile: LayerProfile) -> knapsack.Knapsack:
    items = [c for c in profile.calls if c.keepable and c.bytes > 0]
    capacity = max(0, profile.no_checkpoint_bytes - profile.full_recompute_bytes)
    capacity = min(capacity, sum(c.bytes for c in items))
    solver = knapsack.Knapsack([c.bytes for c in items], [c.seconds for c in items], capacity)
    solver.items = items
    return solver


def _choose(profile: LayerProfile, budget, solver: knapsack.Knapsack) -> frozenset[tuple[str, int]]:
    """Free calls (keepable, no new bytes) always; the rest by knapsack within the budget minus
    the floor. A budget under the floor keeps only free calls (nothing less is possible). A
    budget over the layer's no-checkpointing bytes is planned as that: no plan holds more than
    the layer holds without checkpointing (the solver's capacity is that difference)."""
    capacity = min(budget_in_bytes(budget, profile) - profile.full_recompute_bytes, solver.max_capacity)
    kept = {(c.op, c.index) for c in profile.calls if c.keepable and c.bytes == 0 and c.seconds > 0}
    if capacity > 0:
        if capacity >= sum(solver.weights):
            return frozenset(kept | {(c.op, c.index) for c in solver.items})
        kept |= {(solver.items[i].op, solver.items[i].index) for i in solver.solve(capacity)}
    return frozenset(kept)


def _path_of(path, method: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"sac_plugin: Plan.{method} expects a path (str or os.PathLike), got {describe_value(path)}")
    return Path(path)


def plan(module: torch.nn.Module, *example_args, budget=0.3, runs: int = 5, warmup: int = 1,
         **example_kwargs) -> Plan:
    """Profiles `module` on the example inputs (warm-up, then `runs` timed forwards and backwards;
    the RNG state, gradients and buffers are restored afterwards) and keeps, within `budget`, the
    calls that save the most recompute time. budget: a fraction of the bytes the module holds
    between forward and backward without checkpointing (float, 0.0 to 1.0), or bytes (int)."""
    from ..checkpointing import check_checkpointable

    check_budget(budget)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sac_plugin: plan: module must be a torch.nn.Module, got {describe_value(module)}")
    if "_sac_policy" in module.__dict__:
        raise ValueError(f"sac_plugin: plan: {type(module).__name__} is already checkpointed with "
                         f"{module._sac_policy}; plan the module before apply_selective_checkpointing")
    check_checkpointable(module, "plan: module")
    # A plan measures what autograd saves for backward: it profiles with grad enabled (and outside
    # inference mode) wherever it is called from, as a layer planned on its first call is.
    with torch.inference_mode(False), torch.enable_grad():
        profile = profile_layer(module, example_args, example_kwargs, runs=runs, warmup=warmup)

    solver = _solver_for(profile)
    return Plan(profile, budget, _choose(profile, budget, solver), table_cache=solver)
