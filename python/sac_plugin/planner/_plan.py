"""A memory-budget plan for one layer: which calls to keep, offload or recompute, chosen from a
measured profile.

    plan = sac_plugin.plan(layer, x, cos, sin, budget=0.3)   # 30% of its no-checkpointing bytes
    sac_plugin.apply_selective_checkpointing(layer, plan.policy)
    print(plan.table()); plan.plot("plan.png"); plan.save("plan.json")

The budget bounds the bytes the checkpointed layer holds between forward and backward, counted
as sac_plugin.memory and benchmarks/bench_memory.py count them: what full recompute holds anyway (the
layer's inputs: the floor) plus the outputs the plan keeps. A fraction is of the bytes the layer
holds without checkpointing; an int is bytes. The kept outputs are chosen by an exact 0/1
knapsack (planner/_knapsack.py) that maximises the kernel time the recompute skips.

What a call costs, with offload too (the three-way model), is _cost.py's; choosing the calls for
a budget is _solve.py's; the file a plan saves is _plan_file.py's. This module holds the Plan,
what it reports (tables, curves, a plot) and `plan`, which profiles a layer and plans it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .._validation import bounded_repr, describe_value
from ..policy import Policy
from . import _fields
from . import _plan_file as plan_file
from ._cost import (
    OFFLOAD_MIN_BYTES,
    OffloadModel,
    PlanError,
    budget_in_bytes,
    call_key,
    check_budget,
    copy_costs,
    unreachable_budget,
    is_byte_count,
    is_rate,
    exposed_copy_seconds,
    step_overhead,
)
from ._profile import (
    LayerProfile,
    ProfiledCall,
    accelerator_device,
    measure_offload_bandwidth,
    profile_layer,
)
from ._rule_calls import held_by, plan_policy
from ._solve import Solver

PARETO_BUDGETS = tuple(i / 20 for i in range(21))

log = logging.getLogger("sac_plugin")
_warned_offload_unavailable: set[str] = set()


class Plan:
    """The calls one layer keeps (and, with an offload model, offloads) within a byte budget, and
    what that is predicted to cost.

    Made by `sac_plugin.plan` (which profiles the layer), `Plan.from_profile` or `Plan.load`;
    `policy` is what `apply_selective_checkpointing` takes. A call is named by (op, index), its
    index counted among the forward's calls of the op.

    Args:
        profile: The layer's measured calls and activation bytes.
        budget: A fraction of the layer's no-checkpointing bytes (float) or bytes (int).
        kept: The calls kept on the device. With anything kept or offloaded, the calls that route
            tokens are kept too: the plan's policy holds them.
        offloaded: The calls offloaded to pinned host memory.
        offload: The offload model that prices the copies (None: a keep-or-recompute plan).
        solver: The solver that chose the calls, reused by `with_budget` and `pareto`.

    Attributes:
        profile: The profile the plan was chosen from.
        budget: The budget as given.
        kept: The kept calls, as (op, index) pairs.
        offloaded: The offloaded calls, as (op, index) pairs.
        offload: The offload model, or None.
        kept_bytes: Bytes of the kept outputs.
        held_bytes: Bytes held between forward and backward: full recompute's floor plus the kept.
        offloaded_bytes: Bytes held in pinned host memory.
        recompute_seconds: Kernel time of the calls the recompute runs.
        copy_seconds: Copy time no compute hides.
        overhead_seconds: What the plan adds to a step: recompute plus exposed copies.

    Raises:
        ValueError: An offloaded call without an offload model, or one a plan may not offload.
    """

    def __init__(
        self,
        profile: LayerProfile,
        budget: float | int,
        kept: frozenset[tuple[str, int]],
        offloaded: frozenset[tuple[str, int]] = frozenset(),
        *,
        offload: OffloadModel | None = None,
        solver: Solver | None = None,
    ):
        self.profile = profile
        self.budget = budget
        self.offload = offload
        self._solver_cache = solver
        self.copies = solver.copies if solver is not None else copy_costs(profile, offload) if offload else {}
        self.offloaded = frozenset(offloaded)
        not_offloadable = sorted(self.offloaded - self.copies.keys())
        if not_offloadable:
            raise ValueError(
                f"sac_plugin: Plan: {not_offloadable[0]} cannot be offloaded: "
                + (
                    "there is no OffloadModel (offload=...)"
                    if offload is None
                    else "not a profiled call a plan may offload"
                )
            )
        # The plan holds what its policy holds, asked of the one rule: a keep-flag region whole,
        # the routing calls once anything is kept (NOTE: [A plan keeps a keep-flag region whole
        # or recomputes it whole]). A profile of ops this torch lacks (a plan file from another
        # torch, made-up ops) makes no policy: its calls are counted as given, and `policy` says why.
        self.kept, self._policy = frozenset(kept), None
        try:
            policy = plan_policy(profile, self.kept, self.offloaded, offload)
            self.kept, self.offloaded = held_by(policy, profile)
            self._policy = policy
        except ValueError:
            pass
        by_key = {call_key(c): c for c in profile.calls}
        self.kept_bytes = sum(by_key[k].bytes for k in self.kept)
        self.held_bytes = profile.full_recompute_bytes + self.kept_bytes
        self.offloaded_bytes = sum(by_key[k].bytes for k in self.offloaded)
        self.recompute_seconds = step_overhead(profile, self.kept | self.offloaded, frozenset(), {})
        self.copy_seconds = exposed_copy_seconds(profile, self.kept, self.offloaded, self.copies)
        self.overhead_seconds = step_overhead(profile, self.kept, self.offloaded, self.copies)

    @classmethod
    def from_profile(
        cls, profile: LayerProfile, budget: float | int = 0.3, *, offload: OffloadModel | None = None
    ) -> Plan:
        """The plan for `budget` from a profile, with no measurement.

        Keeps or recomputes each call or, with an OffloadModel, keeps, offloads or recomputes it
        (the three-way model in planner/_cost.py), for the least predicted step time.

        Args:
            profile: The layer's measured calls (`profile_layer`, or made up).
            budget: A fraction of the layer's no-checkpointing bytes (float from 0.0 to 1.0), or
                bytes: an int >= 2 or a string with a unit ("512MiB").
            offload: The offload model, or None for keep or recompute only.

        Returns:
            The plan.

        Raises:
            TypeError: offload is not an OffloadModel, or budget is not a number.
            PlanError: budget is out of range.
        """
        if offload is not None and not isinstance(offload, OffloadModel):
            raise TypeError(
                f"sac_plugin: Plan.from_profile: offload must be None or an OffloadModel, got {describe_value(offload)}"
            )
        solver = Solver(profile, offload)
        budget = check_budget(budget)
        return cls(profile, budget, *solver.choose(budget), offload=offload, solver=solver)

    # --- what it is -------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The plan as a policy: kept_calls, and offloaded_calls, offload_min_bytes and
        host_memory_limit with an offload model; a torch_remat region opened with recompute=False
        is named whole in kept_units or recomputed_units (docs/memory-budget.md)."""
        if self._policy is None:
            self._policy = plan_policy(self.profile, self.kept, self.offloaded, self.offload)
        return self._policy

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes."""
        return budget_in_bytes(self.budget, self.profile)

    @property
    def full_recompute_seconds(self) -> float:
        """Kernel time of the calls a recompute that keeps nothing runs."""
        return sum(c.seconds for c in self.profile.calls if c.recomputed)

    def outcome(self, call: ProfiledCall) -> str:
        """What the plan does with one profiled call.

        Args:
            call: A call of the plan's profile.

        Returns:
            "keep", "offload" or "recompute" for a call the recompute runs, "-" for one it never runs.
        """
        key = call_key(call)
        if key in self.kept:
            return "keep"
        if key in self.offloaded:
            return "offload"
        return "recompute" if call.recomputed else "-"

    def __repr__(self) -> str:
        mib = 2**20
        offloads = ""
        if self.offload is not None:
            offloads = (
                f", offloads {len(self.offloaded)} ({self.offloaded_bytes / mib:.2f} MiB on the host, "
                f"copies {self.copy_seconds * 1e3:.3f} ms exposed)"
            )
        return (
            f"Plan(budget={self.budget!r}: {self.budget_bytes / mib:.2f} MiB, keeps {len(self.kept)} of "
            f"{len(self.profile.calls)} calls{offloads}, holds {self.held_bytes / mib:.2f} MiB of "
            f"{self.profile.no_checkpoint_bytes / mib:.2f}, recompute {self.recompute_seconds * 1e3:.3f} ms of "
            f"{self.full_recompute_seconds * 1e3:.3f})"
        )

    def rows(self) -> list[dict]:
        """The plan by op and unit.

        Returns:
            One dict per (op, unit), most kernel time first: its calls, bytes, time, and how many
            of them are kept and offloaded, with their bytes and the time they save.
        """
        groups: dict[tuple[str, str], dict] = {}
        for c in self.profile.calls:
            row = groups.setdefault(
                (c.op, c.unit),
                {
                    "op": c.op,
                    "unit": c.unit,
                    "calls": 0,
                    "kept": 0,
                    "offloaded": 0,
                    "bytes": 0,
                    "kept_bytes": 0,
                    "seconds": 0.0,
                    "saved_seconds": 0.0,
                    "not_keepable": c.why_not_keepable,
                },
            )
            kept = call_key(c) in self.kept
            row["calls"] += 1
            row["bytes"] += c.bytes
            row["seconds"] += c.seconds
            row["kept"] += kept
            row["offloaded"] += call_key(c) in self.offloaded
            row["kept_bytes"] += c.bytes if kept else 0
            row["saved_seconds"] += c.seconds if kept else 0.0
        return sorted(groups.values(), key=lambda r: (-r["seconds"], r["op"], r["unit"]))

    def call_rows(self) -> list[dict]:
        """The plan call by call.

        Returns:
            One dict per call the recompute would run with new bytes, in the forward's order: its
            outcome and, where it may be offloaded, its predicted copies (a CopyCost) and, where
            not, why not.
        """
        rows = []
        for c in self.profile.calls:
            if not (c.keepable and c.bytes > 0):
                continue
            why = self.offload.why_not_offloadable(c) if self.offload is not None else "no offload model"
            rows.append(
                {
                    "op": c.op,
                    "index": c.index,
                    "unit": c.unit,
                    "bytes": c.bytes,
                    "seconds": c.seconds,
                    "outcome": self.outcome(c),
                    "copy": self.copies.get(call_key(c)),
                    "not_offloadable": why,
                }
            )
        return rows

    def table(self) -> str:
        """The plan as text, for reading.

        Returns:
            Its summary (the plan's repr), a row per op and unit and, with an offload model, a
            row per call with its copies and whether they hide, one line each.
        """
        mib = 2**20
        rows, call_rows = self.rows(), self.call_rows() if self.offload is not None else []
        # Columns as wide as their longest name, so that no name runs into the next column.
        op_width = max(
            [48, *(len(r["op"]) + 2 for r in rows), *(len(f"{r['op']} #{r['index']}") + 2 for r in call_rows)]
        )
        unit_width = max([14, *(len(r["unit"] or "-") + 2 for r in [*rows, *call_rows])])
        lines = [
            repr(self),
            f"{'op':<{op_width}}{'unit':<{unit_width}}{'calls':>6}{'kept':>6}{'MiB':>9}{'kept MiB':>10}"
            f"{'ms':>9}{'saved ms':>10}  not keepable",
        ]
        for r in rows:
            lines.append(
                f"{r['op']:<{op_width}}{r['unit'] or '-':<{unit_width}}{r['calls']:>6}{r['kept']:>6}"
                f"{r['bytes'] / mib:>9.3f}{r['kept_bytes'] / mib:>10.3f}{r['seconds'] * 1e3:>9.3f}"
                f"{r['saved_seconds'] * 1e3:>10.3f}  {r['not_keepable']}"
            )
        if self.offload is None:
            return "\n".join(lines)
        lines += [
            "",
            f"per call (copies: {self.offload.d2h_bytes_per_s / 1e9:.3f} GB/s to the host, "
            f"{self.offload.h2d_bytes_per_s / 1e9:.3f} GB/s back; each alone, hidden behind the forward's kernel time "
            "after it and the recompute's before it)",
            f"{'call':<{op_width}}{'unit':<{unit_width}}{'MiB':>9}{'ms':>9}  {'outcome':<10}{'d2h ms':>9}{'h2d ms':>9}"
            f"{'window ms':>11}{'back win ms':>12}{'exposed ms':>12}  hides",
        ]
        for r in call_rows:
            copy = r["copy"]
            if copy is None:
                copies = f"{'-':>9}{'-':>9}{'-':>11}{'-':>12}{'-':>12}  - ({r['not_offloadable']})"
            else:
                copies = (
                    f"{copy.to_host * 1e3:>9.3f}{copy.to_device * 1e3:>9.3f}{copy.forward_window * 1e3:>11.3f}"
                    f"{copy.backward_window * 1e3:>12.3f}"
                    f"{copy.exposed * 1e3:>12.3f}  {'yes' if copy.hides else 'no'}"
                )
            lines.append(
                f"{r['op'] + ' #' + str(r['index']):<{op_width}}{r['unit'] or '-':<{unit_width}}{r['bytes'] / mib:>9.3f}"
                f"{r['seconds'] * 1e3:>9.3f}  {r['outcome']:<10}{copies}"
            )
        return "\n".join(lines)

    # --- other budgets ------------------------------------------------------------------------------

    def pareto(self, budgets: Iterable[float | int] = PARETO_BUDGETS) -> list[dict]:
        """The plans for other budgets, predicted from the same profile (one knapsack table answers
        them all).

        Args:
            budgets: Budgets as `plan` takes them; fractions from 0 to 1 by 0.05 by default.

        Returns:
            One dict per budget: the plan's predicted held bytes, recompute time and overhead
            (recompute plus exposed copies). With an offload model, also what it offloads and the
            two-way plan's held bytes and overhead at the same budget.

        Raises:
            TypeError: A budget that is not a number.
            PlanError: A budget out of range.
        """
        points = []
        for budget in budgets:
            plan = self.with_budget(check_budget(budget, "pareto: budget"))
            point = {
                "budget": budget,
                "budget_bytes": plan.budget_bytes,
                "held_bytes": plan.held_bytes,
                "kept_bytes": plan.kept_bytes,
                "kept_calls": len(plan.kept),
                "recompute_seconds": plan.recompute_seconds,
                "overhead_seconds": plan.overhead_seconds,
            }
            if self.offload is not None:
                two_way = plan.without_offload()
                point.update(
                    {
                        "offloaded_calls": len(plan.offloaded),
                        "offloaded_bytes": plan.offloaded_bytes,
                        "copy_seconds": plan.copy_seconds,
                        "two_way_held_bytes": two_way.held_bytes,
                        "two_way_overhead_seconds": two_way.overhead_seconds,
                    }
                )
            points.append(point)
        return points

    def with_budget(self, budget: float | int) -> Plan:
        """The same profile (and offload model) planned for another budget, with no new measurement.

        Args:
            budget: A fraction (float from 0.0 to 1.0), or bytes: an int >= 2 or a string with a
                unit ("512MiB"); 0 and 1 are refused (NOTE: [A budget has one reading]).

        Returns:
            The plan for `budget`.

        Raises:
            TypeError: A budget that is not a number.
            PlanError: A budget out of range.
        """
        budget = check_budget(budget)
        solver = self._solver()
        return Plan(self.profile, budget, *solver.choose(budget), offload=self.offload, solver=solver)

    def without_offload(self) -> Plan:
        """The two-way plan (keep or recompute) for the same profile and budget.

        Returns:
            A plan without an offload model.
        """
        solver = self._solver().without_offload()
        return Plan(self.profile, self.budget, *solver.choose(self.budget), solver=solver)

    def _solver(self) -> Solver:
        if self._solver_cache is None:
            self._solver_cache = Solver(self.profile, self.offload)
        return self._solver_cache

    def evaluate(self, policy: Policy) -> dict:
        """What a hand-written policy is predicted to hold and recompute on this profile.

        Each call is asked of the one rule with its op, index and innermost unit, so kept and
        offloaded ops, every-nth rules, calls and units all count.

        Args:
            policy: The policy to evaluate.

        Returns:
            A dict of held_bytes, kept_bytes, offloaded_bytes and recompute_seconds; with an
            offload model, also overhead_seconds: recompute plus the copies no window hides.

        Raises:
            TypeError: policy is not a sac_plugin.Policy.
        """
        if not isinstance(policy, Policy):
            raise TypeError(
                f"sac_plugin: Plan.evaluate: policy must be a sac_plugin.Policy, got {describe_value(policy)}"
            )
        kept, offloaded = held_by(policy, self.profile)
        kept_bytes = sum(c.bytes for c in self.profile.calls if call_key(c) in kept)
        result = {
            "held_bytes": self.profile.full_recompute_bytes + kept_bytes,
            "kept_bytes": kept_bytes,
            "offloaded_bytes": sum(c.bytes for c in self.profile.calls if call_key(c) in offloaded),
            "recompute_seconds": step_overhead(self.profile, kept | offloaded, frozenset(), {}),
        }
        if self.offload is not None:
            # A policy may offload a call under the plan's size floor: price every call's copies.
            copies = copy_costs(self.profile, dataclasses.replace(self.offload, min_bytes=0))
            result["overhead_seconds"] = step_overhead(self.profile, kept, offloaded, copies)
        return result

    def calls_kept_by(self, policy: Policy) -> frozenset[tuple[str, int]]:
        """The profiled calls `policy` keeps on the device.

        Each call is asked of the one rule (docs/semantics.md) with its op, index and innermost
        unit; an offloaded call under the policy's offload_min_bytes, or past its
        host_memory_limit, stays on the device as the runtime keeps it (docs/offload.md). These
        are the forward's decisions: a call the forward writes later whose output the runtime
        cannot copy alone is among them, although the runtime frees it at the write and
        evaluate() counts it as recomputed, holding nothing.

        Args:
            policy: The policy to ask.

        Returns:
            The calls, as (op, index among the op's calls).

        Raises:
            TypeError: policy is not a sac_plugin.Policy.
        """
        if not isinstance(policy, Policy):
            raise TypeError(
                f"sac_plugin: Plan.calls_kept_by: policy must be a sac_plugin.Policy, got {describe_value(policy)}"
            )
        return held_by(policy, self.profile, decided=True)[0]

    def calls_offloaded_by(self, policy: Policy) -> frozenset[tuple[str, int]]:
        """The profiled calls `policy` offloads to host memory, as calls_kept_by counts them.

        Args:
            policy: The policy to ask.

        Returns:
            The calls, as (op, index among the op's calls).

        Raises:
            TypeError: policy is not a sac_plugin.Policy.
        """
        if not isinstance(policy, Policy):
            raise TypeError(
                f"sac_plugin: Plan.calls_offloaded_by: policy must be a sac_plugin.Policy, got {describe_value(policy)}"
            )
        return held_by(policy, self.profile)[1]

    # --- plot ------------------------------------------------------------------------------------

    def plot(
        self, path: str | os.PathLike, policies: Mapping[str, Policy] | None = None, *, title: str | None = None
    ) -> Path:
        """Draws the Pareto curve (held bytes against the time the plan adds to a step) as a PNG.

        This plan and the hand-written policies are marked on it. With an offload model the
        three-way curve is drawn beside the two-way one.

        Args:
            path: Where to write the PNG (str or os.PathLike).
            policies: Names and policies to mark (default: sac_plugin.planner.reference_policies()).
            title: The chart's title.

        Returns:
            The path written.

        Raises:
            ImportError: matplotlib is not installed (the `plot` extra).
            TypeError: path is not a path.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "sac_plugin: Plan.plot needs matplotlib, which is not installed; install the extra: "
                "pip install 'sac_plugin[plot]' (or pip install matplotlib)"
            ) from None
        path = _path_of(path, "plot")
        from ._reference import reference_policies

        policies = reference_policies() if policies is None else policies
        base = self.profile.no_checkpoint_bytes or 1
        points = self.pareto()
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        if self.offload is None:
            ax.step(
                [p["held_bytes"] / base for p in points],
                [p["recompute_seconds"] * 1e3 for p in points],
                where="post",
                marker=".",
                label="plan (Pareto curve)",
            )
        else:
            ax.step(
                [p["two_way_held_bytes"] / base for p in points],
                [p["two_way_overhead_seconds"] * 1e3 for p in points],
                where="post",
                marker=".",
                label="keep or recompute",
            )
            ax.step(
                [p["held_bytes"] / base for p in points],
                [p["overhead_seconds"] * 1e3 for p in points],
                where="post",
                marker=".",
                color="C9",
                label="keep, offload or recompute",
            )
        # Policies can land on one point (the units policy of a layer that opens no units keeps
        # what "attention kept" keeps): each gets its own hollow marker, the first ones largest and
        # drawn on top, so a marker under another still shows as a ring around it.
        markers = ["o", "s", "D", "^", "v", "P", "X", "*"]
        count = len(policies)
        for i, (name, policy) in enumerate(policies.items()):
            e = self.evaluate(policy)
            seconds = e.get("overhead_seconds", e["recompute_seconds"])
            ax.scatter(
                [e["held_bytes"] / base],
                [seconds * 1e3],
                marker=markers[i % len(markers)],
                s=40 + 45 * (count - i),
                facecolors="none",
                edgecolors=f"C{i + 1}",
                linewidths=1.6,
                zorder=3 + count - i,
                label=name,
            )
        ax.scatter(
            [self.held_bytes / base],
            [self.overhead_seconds * 1e3],
            marker="x",
            s=70,
            color="black",
            zorder=4 + count,
            label=f"this plan (budget {self.budget})",
        )
        ax.set_xlabel("activation bytes held / no checkpointing")
        ax.set_ylabel("recompute kernel time (ms)" if self.offload is None else "recompute + exposed copy time (ms)")
        ax.set_title(title or "sac_plugin memory-budget plan")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def curve(self) -> str:
        """The Pareto curve as text, for terminals.

        Returns:
            A line per budget of `pareto()`; with an offload model, the two-way curve's overhead
            beside the three-way one's.
        """
        base = self.profile.no_checkpoint_bytes or 1
        header = f"{'budget':>7}{'held MiB':>10}{'held/none':>10}{'kept calls':>11}{'recompute ms':>14}"
        if self.offload is not None:
            header += f"{'offloaded':>10}{'host MiB':>10}{'copy ms':>9}{'total ms':>10}{'2-way ms':>10}"
        lines = [header]
        for p in self.pareto():
            line = (
                f"{p['budget']:>7.2f}{p['held_bytes'] / 2**20:>10.3f}{p['held_bytes'] / base:>10.3f}"
                f"{p['kept_calls']:>11}{p['recompute_seconds'] * 1e3:>14.3f}"
            )
            if self.offload is not None:
                line += (
                    f"{p['offloaded_calls']:>10}{p['offloaded_bytes'] / 2**20:>10.3f}"
                    f"{p['copy_seconds'] * 1e3:>9.3f}{p['overhead_seconds'] * 1e3:>10.3f}"
                    f"{p['two_way_overhead_seconds'] * 1e3:>10.3f}"
                )
            lines.append(line)
        return "\n".join(lines)

    # --- files -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The plan as the JSON-ready dict a plan file holds.

        Returns:
            The plan file's contents, in the current version: the profile's calls, the budget, the
            kept and offloaded calls and the offload model (`from_dict` reads it back).
        """
        return plan_file.plan_to_dict(self.profile, self.budget, self.kept, self.offloaded, self.offload)

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the plan as a JSON file that `Plan.load` reads.

        Args:
            path: Where to write it (str or os.PathLike).

        Returns:
            The path written.

        Raises:
            TypeError: path is not a path.
        """
        return plan_file.write_plan_file(_path_of(path, "save"), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Reads a plan file written by `save` (this version or an earlier one).

        Args:
            path: The file (str or os.PathLike).

        Returns:
            The plan.

        Raises:
            TypeError: path is not a path.
            PlanError: The file cannot be read, is not JSON, or is not a valid plan here; the
                message names the field.
        """
        path = _path_of(path, "load")
        return cls.from_dict(plan_file.read_plan_file(path, "plan file"), where=f"plan file {path}")

    @classmethod
    def from_dict(cls, data: object, where: str = "plan") -> Plan:
        """A plan from to_dict's form.

        Reads this version, version 2 (without "rng_state_bytes": its floor does not count the
        checkpoint's RNG state) or version 1 (keep or recompute only, without "offload" and
        "offloaded"). Every field is checked against its declaration (planner/_plan_file.py).

        Args:
            data: The dict.
            where: What to call it in messages.

        Returns:
            The plan.

        Raises:
            PlanError: Anything wrong, named.
        """
        try:
            return cls._from_checked_dict(data)
        except _fields.FileError as error:
            raise PlanError(f"sac_plugin: {where}: {error}") from None

    @classmethod
    def _from_checked_dict(cls, data) -> Plan:
        """The plan `data` makes, checked (_fields.FileError) field by field by the plan file and
        then as only a made plan can be: held bytes within its budget, offloaded bytes within its
        host cap, and a policy this torch can build."""
        fail = _fields.FileError
        contents = plan_file.plan_contents(data)
        offload = contents.offload
        result = cls(contents.profile, contents.budget, contents.kept, contents.offloaded, offload=offload)
        if result.held_bytes > result.budget_bytes and result.kept:
            raise fail(
                f"it keeps {result.kept_bytes} bytes, so it holds {result.held_bytes}, over its budget of "
                f"{result.budget_bytes} bytes"
            )
        # The offloads as the file lists them: the plan would keep on the device what the host cap
        # leaves out, as the runtime does, but a file over its own cap is not one a plan wrote.
        offloaded_bytes = sum(c.bytes for c in contents.profile.calls if call_key(c) in contents.offloaded)
        if (
            offload is not None
            and offload.host_memory_limit is not None
            and offloaded_bytes > offload.host_memory_limit
        ):
            raise fail(
                f"it offloads {offloaded_bytes} bytes, over its host_memory_limit of {offload.host_memory_limit} bytes"
            )
        try:
            result.policy
        except ValueError as error:  # an op this torch does not have
            raise fail(f"its calls do not make a policy here: {error}") from None
        return result


def _path_of(path, method: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"sac_plugin: Plan.{method} expects a path (str or os.PathLike), got {describe_value(path)}")
    return Path(path)


def _check_offload_arguments(offload, offload_bandwidth, host_memory_limit, offload_min_bytes) -> None:
    if not isinstance(offload, bool):
        raise TypeError(f"sac_plugin: plan: offload must be True or False, got {describe_value(offload)}")
    named = (
        ("offload_bandwidth", offload_bandwidth),
        ("host_memory_limit", host_memory_limit),
        ("offload_min_bytes", offload_min_bytes),
    )
    given = [name for name, value in named if value is not None]
    if given and not offload:
        raise ValueError(f"sac_plugin: plan: {', '.join(given)} only apply with offload=True")
    pair = isinstance(offload_bandwidth, (tuple, list)) and len(offload_bandwidth) == 2
    if offload_bandwidth is not None and not (pair and all(map(is_rate, offload_bandwidth))):
        raise ValueError(
            "sac_plugin: plan: offload_bandwidth must be (device_to_host, host_to_device) bytes per "
            f"second, two finite numbers > 0, got {bounded_repr(offload_bandwidth)}"
        )
    if host_memory_limit is not None and not is_byte_count(host_memory_limit):
        raise ValueError(
            "sac_plugin: plan: host_memory_limit must be None (no cap) or an int from 0 to 2**63 - 1 "
            f"(bytes), got {bounded_repr(host_memory_limit)}"
        )
    if offload_min_bytes is not None and not is_byte_count(offload_min_bytes):
        raise ValueError(
            f"sac_plugin: plan: offload_min_bytes must be an int from 0 to 2**63 - 1 (bytes), got "
            f"{bounded_repr(offload_min_bytes)}"
        )


def _offload_model(
    module, args, kwargs, offload_bandwidth, host_memory_limit, offload_min_bytes
) -> OffloadModel | None:
    """The offload model for a plan with offload=True: the given bandwidths, else the ones timed
    on the layer's accelerator; None (with one logged warning per reason) where there is neither."""
    if offload_bandwidth is None:
        device = accelerator_device(module, args, kwargs)
        if device is None:
            if not torch.accelerator.is_available():
                reason = "no accelerator is available"
            else:
                reason = f"the layer's parameters and inputs are not on the {torch.accelerator.current_accelerator()}"
            if reason not in _warned_offload_unavailable:
                _warned_offload_unavailable.add(reason)
                log.warning(
                    "sac_plugin: plan: offload=True, but %s and no offload_bandwidth was given: the plan "
                    "keeps or recomputes each call (pass offload_bandwidth=(device_to_host, host_to_device) "
                    "bytes per second to plan offload for another machine)",
                    reason,
                )
            return None
        offload_bandwidth = measure_offload_bandwidth(device)
        log.info(
            "sac_plugin: plan: copies between %s and pinned host memory: %.3f GB/s to the host, %.3f GB/s back",
            device,
            offload_bandwidth[0] / 1e9,
            offload_bandwidth[1] / 1e9,
        )
    return OffloadModel(
        float(offload_bandwidth[0]),
        float(offload_bandwidth[1]),
        OFFLOAD_MIN_BYTES if offload_min_bytes is None else offload_min_bytes,
        host_memory_limit,
    )


def plan(
    module: torch.nn.Module,
    *example_args: object,
    budget: float | int = 0.3,
    runs: int = 5,
    warmup: int = 1,
    offload: bool = False,
    offload_bandwidth: tuple[float, float] | None = None,
    host_memory_limit: int | None = None,
    offload_min_bytes: int | None = None,
    **example_kwargs: object,
) -> Plan:
    """Profiles `module` on the example inputs and plans it for `budget`.

    The profile is a warm-up, then `runs` timed forwards and backwards; the RNG state, gradients
    and buffers are restored afterwards. The plan keeps, within the budget, the calls that save
    the most recompute time. offload=True plans three outcomes per call, keep, offload or
    recompute, for the least predicted step time (the three-way model, docs/memory-budget.md).
    With neither an accelerator nor offload_bandwidth the plan is two-way, with one logged warning.

    Args:
        module: The layer to plan (not yet checkpointed).
        *example_args: Its positional inputs for the profile.
        budget: A fraction of the bytes the module holds between forward and backward without
            checkpointing (float, 0.0 to 1.0), or bytes: an int >= 2 or a string with a unit
            ("512MiB"); 0 and 1 are refused (NOTE: [A budget has one reading]).
        runs: Timed forwards and backwards.
        warmup: Untimed forwards and backwards first.
        offload: Plan offload to pinned host memory too.
        offload_bandwidth: (device_to_host, host_to_device) bytes per second; by default timed on
            the layer's accelerator.
        host_memory_limit: The most host bytes offloaded (None: no cap).
        offload_min_bytes: Calls under this many bytes are never offloaded (default: the
            Policy's, 1 MiB).
        **example_kwargs: Its keyword inputs for the profile.

    Returns:
        The plan.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: The module is already checkpointed, or an offload argument without
            offload=True or out of range.
        PlanError: budget is out of range, or below what full recompute holds (the message names
            both; `lowest_bytes` is the latter).
    """
    result = profile_and_plan(
        module,
        example_args,
        example_kwargs,
        budget=budget,
        runs=runs,
        warmup=warmup,
        offload=offload,
        offload_bandwidth=offload_bandwidth,
        host_memory_limit=host_memory_limit,
        offload_min_bytes=offload_min_bytes,
    )
    floor = result.profile.full_recompute_bytes
    if result.budget_bytes < floor:
        # Every plan holds at least what full recompute holds: none keeps within this budget.
        raise unreachable_budget(
            "plan",
            f"budget={budget!r} ({result.budget_bytes} bytes)",
            "the least a plan holds",
            floor,
            "full recompute (the layer's inputs and the RNG state its checkpoint saves)",
        )
    return result


def profile_and_plan(
    module: torch.nn.Module,
    example_args: tuple,
    example_kwargs: dict,
    *,
    budget: float | int,
    runs: int = 5,
    warmup: int = 1,
    offload: bool = False,
    offload_bandwidth: tuple[float, float] | None = None,
    host_memory_limit: int | None = None,
    offload_min_bytes: int | None = None,
) -> Plan:
    """`plan`, its arguments checked the same way, for a budget that may be below full
    recompute's floor: that plan is full recompute. For the callers that profile a layer to plan
    it again (budget 1.0, then with_budget), whatever its floor."""
    from ..checkpointing import check_checkpointable

    budget = check_budget(budget)
    _check_offload_arguments(offload, offload_bandwidth, host_memory_limit, offload_min_bytes)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sac_plugin: plan: module must be a torch.nn.Module, got {describe_value(module)}")
    if "_sac_policy" in module.__dict__:
        raise ValueError(
            f"sac_plugin: plan: {type(module).__name__} is already checkpointed with "
            f"{module._sac_policy}; plan the module before apply_selective_checkpointing"
        )
    check_checkpointable(module, "plan: module")
    # A plan measures what autograd saves for backward: it profiles with grad enabled (and outside
    # inference mode) wherever it is called from, as a layer planned on its first call is.
    with torch.inference_mode(False), torch.enable_grad():
        profile = profile_layer(module, example_args, example_kwargs, runs=runs, warmup=warmup)
    model = None
    if offload:
        model = _offload_model(
            module, example_args, example_kwargs, offload_bandwidth, host_memory_limit, offload_min_bytes
        )
    return Plan.from_profile(profile, budget, offload=model)
