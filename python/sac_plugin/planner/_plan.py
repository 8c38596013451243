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
a budget is _solve.py's; the file a plan saves is _plan_file.py's; what it predicts for other
budgets and policies, its tables and its plot are _plan_evaluation.py's, _plan_tables.py's and
_plan_plot.py's; the offload model `plan` builds is _plan_offload.py's. This module holds the Plan
as a value and `plan`, which profiles a layer and plans it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .._validation import describe_value
from ..policy import Policy
from . import _fields
from . import _plan_evaluation as plan_evaluation
from . import _plan_file as plan_file
from . import _plan_plot as plan_plot
from . import _plan_tables as plan_tables
from ._cost import (
    OffloadModel,
    PlanError,
    budget_in_bytes,
    call_key,
    check_budget,
    copy_costs,
    exposed_copy_seconds,
    step_overhead,
    unreachable_budget,
)
from ._plan_evaluation import check_policy
from ._plan_offload import check_offload_arguments, offload_model
from ._profile import LayerProfile, ProfiledCall, profile_layer
from ._rule_calls import held_by, plan_policy
from ._solve import Solver

PARETO_BUDGETS = tuple(i / 20 for i in range(21))


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
        return plan_tables.rows(self)

    def call_rows(self) -> list[dict]:
        """The plan call by call.

        Returns:
            One dict per call the recompute would run with new bytes, in the forward's order: its
            outcome and, where it may be offloaded, its predicted copies (a CopyCost) and, where
            not, why not.
        """
        return plan_tables.call_rows(self)

    def table(self) -> str:
        """The plan as text, for reading.

        Returns:
            Its summary (the plan's repr), a row per op and unit and, with an offload model, a
            row per call with its copies and whether they hide, one line each.
        """
        return plan_tables.table(self)

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
        return plan_evaluation.pareto(self, budgets)

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
        return plan_evaluation.evaluate(self, policy)

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
        check_policy(policy, "Plan.calls_kept_by")
        return held_by(policy, self.profile, decided=True)[0]

    def calls_offloaded_by(self, policy: Policy) -> frozenset[tuple[str, int]]:
        """The profiled calls `policy` offloads to host memory, as calls_kept_by counts them.

        Args:
            policy: The policy whose offloads to list.

        Returns:
            The offloaded calls, each as (op, index among the op's calls).

        Raises:
            TypeError: policy is not a sac_plugin.Policy.
        """
        check_policy(policy, "Plan.calls_offloaded_by")
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
        return plan_plot.plot(self, path, policies, title)

    def curve(self) -> str:
        """The Pareto curve as text, for terminals.

        Returns:
            A line per budget of `pareto()`; with an offload model, the two-way curve's overhead
            beside the three-way one's.
        """
        return plan_tables.curve(self)

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
        return plan_file.write_plan_file(plan_file.path_of(path, "Plan.save"), self.to_dict())

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
        path = plan_file.path_of(path, "Plan.load")
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
    **offload_arguments,
) -> Plan:
    """`plan`, its arguments checked the same way, for a budget that may be below full
    recompute's floor: that plan is full recompute. For the callers that profile a layer to plan
    it again (budget 1.0, then with_budget), whatever its floor. `offload_arguments` are `plan`'s
    offload, offload_bandwidth, host_memory_limit and offload_min_bytes."""
    from ..checkpointing import check_checkpointable

    budget = check_budget(budget)
    check_offload_arguments(**offload_arguments)
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
    model = offload_model(module, example_args, example_kwargs, **offload_arguments)
    return Plan.from_profile(profile, budget, offload=model)
