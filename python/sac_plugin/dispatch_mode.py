"""The dispatch-mode engine: the plugin's decisions carried out by torch's own SAC.

The native engine intercepts ops in C++ on a dispatch key (NOTE: [The dispatch key sac_plugin
intercepts on]). Where that is impossible (the interception could not be installed in this
torch), or when SAC_PLUGIN_ENGINE=dispatch_mode asks for it, checkpointed regions run under
torch's selective-checkpoint dispatch modes instead, with a policy function that makes the same
decisions: kept ops, every-nth rules, kept and recomputed units (read from the C++ unit stack,
which `recompute_unit` maintains in both engines) and the invariants. What it costs: torch's
Python dispatch mode runs for every op of a region, about 25x the native engine's per-op cost
(benchmarks/bench_overhead.py), and kept calls are matched the way torch matches them, by order per
op and argument shapes, not by data flow.

Audits keep working: the region still marks its forward and recompute for the C++ counters, and,
for regions whose forward ran inside an audit, the calls torch serves from its cache are reported
as hits when the recompute ends.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from . import _compat
from .policy import op_spelling

ENGINE_VARIABLE = "SAC_PLUGIN_ENGINE"
ENGINES = ("native", "dispatch_mode")

_aten = torch.ops.aten
# Allocations whose contents are garbage until written: keeping one is useless, and torch's cache
# cannot demote an entry the forward writes later (the native engine can), so they are recomputed.
_UNINITIALIZED = frozenset({
    _aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
    _aten.empty_strided.default, _aten.new_empty_strided.default,
})

_chosen: str | None = None


def choose_engine(install_error: str | None) -> str:
    """The engine for this process: SAC_PLUGIN_ENGINE if set, else native unless the C++
    interception could not be installed (then dispatch_mode, with one warning saying why)."""
    global _chosen
    requested = os.environ.get(ENGINE_VARIABLE, "").strip()
    if requested and requested not in ENGINES:
        raise ImportError(
            f"sac_plugin: {ENGINE_VARIABLE}={requested!r} is not an engine; expected one of {', '.join(ENGINES)} "
            "(or unset, to let the plugin choose)")
    if requested == "native" and install_error is not None:
        raise ImportError(f"sac_plugin: {ENGINE_VARIABLE}=native, but the native engine cannot run here: {install_error}")
    if requested:
        _chosen = requested
    elif install_error is not None:
        warnings.warn(
            f"sac_plugin: the native engine cannot run in this torch ({install_error}); using the dispatch-mode "
            "engine, which makes the same decisions through torch's own selective checkpointing at about 25x "
            f"the per-op cost. Set {ENGINE_VARIABLE}=dispatch_mode to choose it explicitly.",
            RuntimeWarning, stacklevel=3)
        _chosen = "dispatch_mode"
    else:
        _chosen = "native"
    return _chosen


def engine() -> str:
    """"native" or "dispatch_mode": which engine runs checkpointed regions in this process."""
    return _chosen or "native"


# Warned (policy, op) pairs: once per policy, as the native engine does.
_warned: dict[int, tuple[object, set]] = {}


def _warn_once(policy, op, message: str) -> None:
    _, ops = _warned.setdefault(id(policy), (policy, set()))
    if op not in ops:
        ops.add(op)
        warnings.warn(message, UserWarning, stacklevel=4)


def _casts_a_parameter(op, args) -> bool:
    return op is _aten._to_copy.default and bool(args) and isinstance(args[0], torch.Tensor) \
        and args[0].requires_grad and args[0].is_leaf


def _display_name(op) -> str:
    """"aten::tanh" for a default overload, "aten::add.Tensor" otherwise, as the native engine says."""
    name = op._schema.name
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def eager_policy_fn(policy, plan: dict):
    """torch's policy function for one region, deciding as the native engine does. It records in
    `plan[op]`, call by call, which forward calls it kept (torch serves them in the recompute)."""
    from ._call_facts import draws_random, op_traits as _op_traits
    from .policy import overload_of

    def _draws_random(random, dropout_p, args, kwargs):
        return draws_random(_op_traits.__wrapped__ and type("T", (), {"random": random, "dropout_argument": dropout_p})(),
                            args, kwargs)

    kept = frozenset(policy.kept_overloads())
    every_nth = {overload_of(name): n for name, n in policy.every_nth_op.items()}
    kept_calls = {overload_of(name): frozenset(indices) for name, indices in policy.kept_calls.items()}
    kept_units = frozenset(policy.kept_units)
    recomputed_units = frozenset(policy.recomputed_units)
    calls: dict = {}

    def random_call_warning(op):
        _warn_once(policy, op, f"sac: {_display_name(op)} is called with dropout_p > 0 and draws random numbers; it "
                               "is recomputed rather than kept, so that the recompute draws the same numbers (warned "
                               "once per policy)")

    def decide_op(recompute, op, args, kwargs):
        collective, never, random, mutates, view, dropout_p = _op_traits(op)
        if collective or never or _casts_a_parameter(op, args):
            return False
        units = torch.ops.sac.open_units() if (kept_units or recomputed_units) else ()
        if recomputed_units and not recomputed_units.isdisjoint(units):
            return False
        draws = _draws_random(random, dropout_p, args, kwargs)
        selected = op in kept
        if not selected and op in every_nth:
            # Counted per pass: torch before 2.13 asks the policy again in the recompute.
            index = calls.get((recompute, op), 0)
            calls[(recompute, op)] = index + 1
            selected = index % every_nth[op] == 0
        elif not selected and op in kept_calls:
            index = calls.get((recompute, op), 0)
            calls[(recompute, op)] = index + 1
            selected = index in kept_calls[op]
        if selected:
            if draws:
                random_call_warning(op)
            return not draws
        unit = next((u for u in reversed(units) if u in kept_units), None)
        if unit is None:
            return False
        if mutates:
            _warn_once(policy, op, f"sac: {_display_name(op)} mutates an input inside kept unit '{unit}'; it is "
                                   "recomputed rather than kept (warned once per policy)")
            return False
        if draws:
            if dropout_p >= 0:
                random_call_warning(op)
            return False
        return not view and op not in _UNINITIALIZED

    def decide(ctx, op, *args, **kwargs):
        keep = not _op_traits(op)[0] and decide_op(ctx.is_recompute, op, args, kwargs)
        if not ctx.is_recompute:
            plan.setdefault(op, []).append(keep)
        if _op_traits(op)[0]:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


class _ServedCounter(TorchDispatchMode):
    """Above torch's recompute mode: counts as hits the calls torch serves from its cache, which
    are the calls the forward kept, matched per op in order, as torch matches them."""

    def __init__(self, plan: dict):
        super().__init__()
        self._plan = plan
        self._index: dict = {}
        self.hits: list[str] = []  # reported once every mode is off (a report is an op call too)

    def __enter__(self):
        self._index.clear()  # a second recompute (retain_graph=True) starts over
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAC_IGNORED_OPS:
            index = self._index.get(func, 0)
            self._index[func] = index + 1
            kept = self._plan.get(func, ())
            if index < len(kept) and kept[index]:
                self.hits.append(op_spelling(func))
        return func(*args, **(kwargs or {}))


class _Entered:
    """Enters contexts in order and exits them in reverse, whatever raises, then runs `after`;
    reusable, since a recompute context is entered again by a second backward."""

    __slots__ = ("_contexts", "_after", "_stack")

    def __init__(self, *contexts, after=None):
        self._contexts = contexts
        self._after = after
        self._stack = None

    def __enter__(self):
        with contextlib.ExitStack() as stack:  # unwinds what was entered if a later enter raises
            if self._after is not None:
                stack.callback(self._after)  # registered first: runs last
            for context in self._contexts:
                stack.enter_context(context)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc_info)


def dispatch_mode_contexts(policy, marker, plan: dict | None = None):
    """The (forward, recompute) contexts of one region in the dispatch-mode engine. `marker` is
    a Region whose policy keeps nothing: it only labels the passes for audits and re-opens the
    units around the forward in the recompute. `plan` (op -> kept flag of each forward call) is
    filled as the forward runs, for a caller that counts kept calls."""
    from ._audit import any_active as any_audit_active

    plan = {} if plan is None else plan
    forward_mode, recompute_mode = create_selective_checkpoint_contexts(eager_policy_fn(policy, plan))
    if not any_audit_active():
        # Hits are only ever read by an audit; without one, no extra mode in the recompute.
        return _Entered(marker.forward, forward_mode), _Entered(marker.recompute, recompute_mode)
    counter = _ServedCounter(plan)

    def report_hits():
        # Also after an early stop of the recompute: the calls counted were served.
        if counter.hits:
            hits, counter.hits = counter.hits, []
            # Where the key sits above Python (torch 2.11), a running audit saw each served call on
            # its way to torch's cache and counted it as a recompute execution.
            counted = _compat.python_handlers_run_below_the_plugin() and any_audit_active()
            torch.ops.sac.record_hits(hits, counted)

    return (_Entered(marker.forward, forward_mode),
            _Entered(marker.recompute, recompute_mode, counter, after=report_hits))
