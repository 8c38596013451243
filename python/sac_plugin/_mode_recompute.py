"""The native engine's recompute under other dispatch modes (NOTE: [Modes above the key see only
what ran]). Importing it sets the hook through which a native region's recompute scope, opening
while modes are on, runs there."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _scopes
from ._mode_calls import (
    ModeAction,
    assemble,
    call_begin_all,
    run_begun,
    foreign_modes_on,
    known_ops,
    mode_op,
    no_python_dispatch,
    split_arguments,
)
from ._native import MEMORY_FORMATS
from .policy import Policy

__all__ = ["recompute_above_modes"]

_dispatch_modes_on = torch._C._len_torch_dispatch_stack
_SERVED = ModeAction.SERVED

# What an `Any` argument takes as the fallback's stack holds it (dtypes and layouts become ints).
_PLAIN_VALUES = (type(None), bool, int, float, complex, str, torch.dtype, torch.layout, torch.device, torch.Generator)
# Any other value names a call the forward (whose stack held it as an object) never made: it runs.
_UNNAMED = "sac_plugin: a value the dispatch-mode bridge does not pass"


def _as_ivalue(value):
    """A non-tensor argument as the fallback's stack holds it: lists as lists (`()` for an empty
    one, whose type C++ takes from the schema), memory formats as ints."""
    if isinstance(value, _PLAIN_VALUES):
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            return ()
        elements = [_as_ivalue(element) for element in value]
        # A list travels with one element type (an `Any` list is typed by its elements), a plain one.
        types = {type(element) for element in elements}
        return elements if len(types) == 1 and types <= {int, float, bool, complex, str, list} else _UNNAMED
    if isinstance(value, torch.memory_format):
        return MEMORY_FORMATS.get(value, _UNNAMED)
    return _UNNAMED


# NOTE: [Modes above the key see only what ran]
# A TorchDispatchMode (torch's FlopCounterMode, and with it torchtitan's MFU; a debug or logging
# mode) sits above the plugin's key (NOTE: [The dispatch key sac_plugin intercepts on]): on the
# native key it would see every call of a recompute, including those the fallback then serves
# from a kept output without running the kernel, and count work that never ran. The rule: a
# mode sees the calls that ran, and no served call. So when a region's recompute begins while
# any dispatch mode is on, the region's recompute runs through a mode of ours pushed on top of
# them (torch calls the most recently pushed mode first), which drives the region the native
# fallback filled in the forward: a served call returns from our mode and never reaches the
# modes below; any other call goes on to them through func(*args, **kwargs) and runs. As torch's
# own selective checkpoint does, where its recompute mode is pushed last.
#   - Naming: the fallback named the forward's calls from all their arguments, so our mode hands
#     C++ all of them (mode_call_begin_all: tensors, every other value, the schema's defaults for
#     those torch left out), and the same DataFlow::identify names the recompute's calls; a value
#     that cannot travel the same way names a call the forward never made, which runs.
#   - No double interception: a marker region (keeps nothing, the units around the forward
#     re-opened) is the innermost region while our mode is on, so the fallback below only counts
#     the calls that ran, for audits; served calls are counted as hits by the mode.
#   - The forward stays on the native key (its calls all run, so every mode sees them all), and
#     with no dispatch mode on the recompute does too: nothing changes on the hot path. Nor with
#     only the plugin's own modes on: the per-op trace watches the fallback serve (NOTE: [The
#     per-op trace costs nothing without a trace]); beside another mode it sees what that one sees.
# Served calls are made invisible rather than the count corrected afterwards: a correction would
# serve one counter (FlopCounterMode's formulas), while any mode (a logger, a tracker of which
# weights a matmul reads, a debug mode) must agree with what ran, and torch's own selective
# checkpoint shows modes below its recompute mode exactly that.
class RecomputeAboveModes(TorchDispatchMode):
    """The recompute of a region the native fallback ran, under our mode on top of the others."""

    def __init__(self, handle: int, marker):
        super().__init__()
        self._handle = handle
        self._marker = marker  # a _C.Region: entered through its enter and exit, never a RegionScope
        self._marker_depth = 0

    def __enter__(self):
        # The marker's forward, entered and left at once, notes the units the region's recompute
        # re-opened; its recompute re-opens them again.
        _scopes.enter_marker(self._marker, False)
        self._marker_depth = _scopes.enter_marker(self._marker, True)
        try:
            return super().__enter__()
        except BaseException:
            self._marker.exit(True, self._marker_depth)
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._marker.exit(True, self._marker_depth)
            with no_python_dispatch():
                torch.ops.sac.mode_region_release(self._handle)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = known_ops[func] if func in known_ops else mode_op(func)
        if op is None:
            return func(*args, **kwargs)
        split = split_arguments(op, args, kwargs)
        if not split:
            return NotImplemented if split is None else func(*args, **kwargs)
        tensors, positions, others = split
        values = [_as_ivalue(value) for value in others[1::2]]
        with no_python_dispatch():
            action, _, served, counts, other_returns = call_begin_all(
                self._handle, op.handle, tensors, positions, values, others[0::2], False
            )
        if action == _SERVED:
            return assemble(op, served, counts, other_returns.__getitem__)
        out, _ = run_begun(self._handle, op, func, args, kwargs, action, served)
        return out


_marker_policy = _marker_site = None


def _marker_region() -> _scopes.Region:
    """A new marker region: a keeps-nothing region that labels passes and re-opens units."""
    global _marker_policy, _marker_site
    if _marker_site is None:
        _marker_policy = Policy()
        _marker_site = _scopes.new_site(_marker_policy, marks_passes=True)
    return _marker_site.new_region()


def recompute_above_modes(region: _scopes.Region):
    """NOTE: [Modes above the key see only what ran]: the context that runs the recompute of the
    native `region`, already entered, above the dispatch modes that are on;
    None when only the plugin's own modes are on (the per-op trace, which watches the fallback
    serve) or for a region that intercepts nothing (it serves nothing either)."""
    if not foreign_modes_on():
        return None
    marker = _marker_region()
    with no_python_dispatch():  # the engine's own calls are no business of the modes that are on
        handle = region.mode_region_over(marker)
    return RecomputeAboveModes(handle, marker) if handle else None


# A native region's recompute scope, opening while dispatch modes are on, runs the recompute
# above them through recompute_above_modes (the scopes are C: NOTE: [Scopes as a C type]).
_scopes.set_recompute_above_modes(recompute_above_modes)
