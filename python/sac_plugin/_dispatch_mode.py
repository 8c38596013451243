"""The dispatch-mode engine: the native engine's decisions and data-flow matching, driven from a
Python dispatch mode.

The native engine intercepts ops in C++ on a dispatch key (NOTE: [The dispatch key sac_plugin
intercepts on]). Where that is impossible (the interception could not be installed in this
torch), when SAC_PLUGIN_ENGINE=dispatch_mode asks for it, or for a step whose forward runs under
another dispatch mode (NOTE: [A value is served from the level it was kept at] in
checkpointing.py), checkpointed regions run under a TorchDispatchMode instead (one for the forward, one for the recompute, as torch.utils.checkpoint's
context_fn expects). The mode sees every call of the region and hands it to C++
(csrc/dispatch/mode_engine.cpp), where the native engine's own code names it by data flow,
decides it with the region's policy, keeps, preserves and serves its outputs (NOTE: [One call
pipeline] in csrc/dispatch/call_pipeline.cpp). So both engines keep and serve the same
calls and give the same gradients and audit counts; what differs is the cost: a Python handler and
two C++ calls per op, about 1.3 to 2 times the per-op overhead of torch's own selective-checkpoint
modes and tens of times the native engine's (benchmarks/bench_overhead.py).

Audits keep working: the region's marker (a keeps-nothing region) labels its forward and
recompute for the C++ counters, which count every call the mode runs; the calls it serves are
counted as hits by C++, where the kernel is skipped.

How a call travels to C++ and back is _mode_calls.py's, shared with the native engine's recompute
under other modes (_mode_recompute.py).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._call_facts import draws_random
from ._warnings import HeldNeverServedWarning
from ._mode_calls import (
    ModeAction,
    ModePass,
    Op,
    Slot,
    assemble,
    call_begin,
    run_begun,
    flatten_arguments,
    known_ops,
    mode_op,
    no_python_dispatch,
)

__all__ = ["dispatch_mode_contexts"]

_RUN_ONLY, _RUN_AND_KEEP, _SERVED = ModeAction.RUN_ONLY, ModeAction.RUN_AND_KEEP, ModeAction.SERVED
_OTHER = Slot.OTHER


class _ModeRegionReference:
    """Owns a C++ mode region, by its handle (NOTE: [A handle that comes back is checked] in
    csrc/dispatch/handed_out.h), (NOTE: [The dispatch-mode engine's region]) and the non-tensor
    values its kept calls returned (served again with their tensors)."""

    __slots__ = ("handle", "other_returns", "plan", "__weakref__")

    def __init__(self, site, marker, plan: dict):
        with no_python_dispatch():
            self.handle = site.native.new_mode_region(marker.forward.region)
        self.other_returns: dict = {}
        self.plan = plan

    def forward_position(self) -> int:
        with no_python_dispatch():
            return torch.ops.sac.mode_region_forward_position(self.handle)

    def release_unreached(self, last_saved_position: int) -> int:
        with no_python_dispatch():
            return torch.ops.sac.mode_region_release_unreached(self.handle, last_saved_position)

    def __del__(self):
        release = getattr(getattr(torch.ops, "sac", None), "mode_region_release", None)
        if release is not None:
            with no_python_dispatch():
                release(self.handle)


class _PassMode(TorchDispatchMode):
    """One pass (the forward or the recompute) of one region, as a dispatch mode: every call goes to C++ before and after its
    kernel, which runs with the mode off (NOTE: [Ops called from inside a kernel are not
    intercepted])."""

    def __init__(self, region: _ModeRegionReference, recompute: bool):
        super().__init__()
        self._region = region
        self._handle = region.handle
        self._recompute = recompute

    def __enter__(self):
        with no_python_dispatch():
            torch.ops.sac.mode_region_pass(
                self._handle, ModePass.BEGIN_RECOMPUTE if self._recompute else ModePass.BEGIN_FORWARD
            )
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            with no_python_dispatch():
                notice = torch.ops.sac.mode_region_pass(
                    self._handle, ModePass.END_RECOMPUTE if self._recompute else ModePass.END_FORWARD
                )
            # NOTE: [Served, or named] (csrc/dispatch/kept_outputs.cpp); a recompute that raised (other
            # than torch's early stop) has not served what it would have, and its error says enough.
            if notice and (exc_info[0] is None or exc_info[0].__name__ == "_StopRecomputationError"):
                warnings.warn(notice, HeldNeverServedWarning, stacklevel=2)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = known_ops[func] if func in known_ops else mode_op(func)
        if op is None:
            return func(*args, **kwargs)
        flat = flatten_arguments(op, args, kwargs)
        if not flat:
            return NotImplemented if flat is None else func(*args, **kwargs)
        tensors, positions, key = flat
        draws = op.random and draws_random(op.traits, args, kwargs)
        # Python dispatch off around the bridge: a mode below this one (a user's, entered outside
        # the region) sees the region's ops, never the engine's own calls.
        with no_python_dispatch():
            action, call, served, counts = call_begin(self._handle, op.handle, key, tensors, positions, draws)
        if action == _SERVED:
            return self._served(op, call, served, counts)
        out, action = run_begun(self._handle, op, func, args, kwargs, action, served)
        if action != _RUN_ONLY:
            keep = action == _RUN_AND_KEEP
            self._region.plan.setdefault(func, []).append(keep)
            if keep and op.other_returns:
                # Only the non-tensor values: the tensors are the region's, and freed with it.
                values = (out,) if len(op.returns) == 1 else out
                self._region.other_returns[call] = tuple(
                    value if slot == _OTHER else None for slot, value in zip(op.returns, values)
                )
        return out

    def _served(self, op: Op, call: int, served, counts):
        return assemble(op, served, counts, lambda position: self._region.other_returns[call][position])


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


def dispatch_mode_contexts(site, marker, plan: dict | None = None):
    """The (forward, recompute) contexts of one region in the dispatch-mode engine, and the mode
    region itself. `marker` is a Region whose policy keeps nothing: it labels the passes for
    audits and re-opens the units around the forward in the recompute; the mode region made here
    is a region of `site` (a _site.Site) and holds the kept outputs. `plan` (op -> kept flag of
    each forward call the policy decided) is filled as the forward runs, for a caller that counts
    kept calls."""
    region = _ModeRegionReference(site, marker, {} if plan is None else plan)
    return (
        _Entered(marker.forward, _PassMode(region, recompute=False)),
        _Entered(marker.recompute, _PassMode(region, recompute=True)),
        region,
    )
