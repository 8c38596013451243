"""The dispatch-mode engine: the native engine's decisions and data-flow matching, driven from a
Python dispatch mode.

The native engine intercepts ops in C++ on a dispatch key (NOTE: [The dispatch key sac_plugin
intercepts on]). Where that is impossible (the interception could not be installed in this
torch), when SAC_PLUGIN_ENGINE=dispatch_mode asks for it, or for a step whose forward runs under
another dispatch mode (NOTE: [A value is served from the level it was kept at] in
checkpointing.py), checkpointed regions run under a TorchDispatchMode instead (one for the forward, one for the recompute, as torch.utils.checkpoint's
context_fn expects). The mode sees every call of the region and hands it to C++
(csrc/dispatch/mode_engine.cpp), where the native engine's own code names it by data flow,
decides it with the region's policy, keeps, demotes and serves its outputs (NOTE: [One call
pipeline] in csrc/dispatch/call_pipeline.cpp). So both engines keep and serve the same
calls and give the same gradients and audit counts; what differs is the cost: a Python handler and
two C++ calls per op, about 1.3 to 2 times the per-op overhead of torch's own selective-checkpoint
modes and tens of times the native engine's (benchmarks/bench_overhead.py).

Audits keep working: the region's marker (a keeps-nothing region) labels its forward and
recompute for the C++ counters, which count every call the mode runs; the calls it serves are
counted as hits by C++, where the kernel is skipped.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _current_dispatch_modes

from . import _scopes
from ._call_facts import OpTraits, draws_random, op_traits
from .policy import Policy

__all__ = ["dispatch_mode_contexts"]

# What mode_call_begin answers (csrc/dispatch/mode_engine.h, ModeAction).
_RUN_ONLY, _RUN_AND_RECORD, _RUN_AND_KEEP, _SERVED = 0, 1, 2, 3
# Passes (ModePass).
_BEGIN_FORWARD, _END_FORWARD, _BEGIN_RECOMPUTE, _END_RECOMPUTE = 0, 1, 2, 3
# How an argument or a return travels to C++ (Slot): tensors as they are, the rest stays here.
_OTHER, _TENSOR, _TENSOR_LIST, _OPTIONAL_TENSOR_LIST = 0, 1, 2, 3
# Tensor types without a __torch_dispatch__ of their own, by type. A call on a subclass that has
# one goes to that subclass first (the mode answers NotImplemented), and the plain-tensor ops its
# handler makes come back to the mode: what the native engine sees, where torch's `Python` key
# sits above the plugin's.
_plain_types: dict = {}


def _is_plain(type_) -> bool:
    plain = _plain_types.get(type_)
    if plain is None:
        plain = _plain_types[type_] = type_.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    return plain


def _slot(type_) -> int:
    if isinstance(type_, torch._C.OptionalType):
        type_ = type_.getElementType()
    if isinstance(type_, torch._C.TensorType):
        return _TENSOR
    if isinstance(type_, torch._C.ListType):
        element = type_.getElementType()
        if isinstance(element, torch._C.TensorType):
            return _TENSOR_LIST
        if isinstance(element, torch._C.OptionalType) and isinstance(element.getElementType(), torch._C.TensorType):
            return _OPTIONAL_TENSOR_LIST
    return _OTHER


class _Op:
    """What the mode needs of one op overload, read once per process."""

    __slots__ = ("address", "arguments", "names", "returns", "random", "dropout_p", "other_returns")

    def __init__(self, func):
        schema = func._schema
        traits = op_traits(func)
        self.random, self.dropout_p = traits.random, traits.dropout_argument
        self.address = torch.ops.sac.mode_op(schema.name, schema.overload_name)
        self.arguments = tuple(_slot(argument.type) for argument in schema.arguments)
        self.names = {argument.name: i for i, argument in enumerate(schema.arguments)}
        self.returns = tuple(_slot(value.type) for value in schema.returns)
        self.other_returns = _OTHER in self.returns


_ops: dict = {}  # op overload -> _Op, or None for ops that never count
_call_begin = torch.ops.sac.mode_call_begin.default
_call_begin_all = torch.ops.sac.mode_call_begin_all.default
_call_end = torch.ops.sac.mode_call_end.default
_no_python_dispatch = torch._C._DisableTorchDispatch


def _op(func):
    # NOTE: [The plugin's own calls]: reading an op's traits dispatches sac ops no mode may see.
    with _no_python_dispatch():
        op = None if op_traits(func).never_counted else _Op(func)
    _ops[func] = op
    return op


def _flatten_arguments(op: _Op, args, kwargs):
    """(tensors, their argument positions, the key of every other argument); None when a tensor
    is a subclass, False when a tensor sits where the schema takes none. The key folds the non-tensor arguments (with their positions) into
    one int for the call's data-flow identity; repr tells 1, 1.0 and True apart and has no
    hash collisions between small ints (hash(-1) == hash(-2))."""
    split = _split_arguments(op, args, kwargs)
    if not split:
        return split
    tensors, positions, others = split
    return tensors, positions, hash(repr(others)) if others else 0


def _split_arguments(op: _Op, args, kwargs):
    """(tensors, their argument positions, [position, value, ...] of every other argument given);
    None when a tensor is a subclass, False when a tensor sits where the schema takes none."""
    tensors: list = []
    positions: list = []
    others: list = []
    items = enumerate(args)
    if kwargs:
        names = op.names
        items = [*items, *sorted(((names[name], value) for name, value in kwargs.items()), key=lambda item: item[0])]
    slots = op.arguments
    for position, value in items:
        slot = slots[position]
        if slot == _TENSOR and isinstance(value, torch.Tensor):
            if not _is_plain(type(value)):
                return None
            tensors.append(value)
            positions.append(position)
        elif slot >= _TENSOR_LIST and value is not None:
            for element in value:
                if element is not None and not _is_plain(type(element)):
                    return None
                tensors.append(element)
                positions.append(position)
        elif isinstance(value, torch.Tensor):
            # A tensor where the schema takes no tensor (an `Any` argument): it has no data flow
            # to be named by, so the call is run, never kept or served.
            return False
        else:
            others.append(position)
            others.append(value)
    return tensors, positions, others


def _flatten_returns(op: _Op, out):
    values = (out,) if len(op.returns) == 1 else (out or ())
    tensors: list = []
    positions: list = []
    for position, (slot, value) in enumerate(zip(op.returns, values)):
        if slot == _TENSOR:
            tensors.append(value)
            positions.append(position)
        elif slot >= _TENSOR_LIST and value is not None:
            for element in value:
                tensors.append(element)
                positions.append(position)
    return tensors, positions


class _ModeRegion:
    """Owns one C++ mode region (NOTE: [The dispatch-mode engine's region]) and the non-tensor
    values its kept calls returned (served again with their tensors)."""

    __slots__ = ("address", "other_returns", "plan", "__weakref__")

    def __init__(self, site, marker, plan: dict):
        with _no_python_dispatch():
            self.address = torch.ops.sac.mode_region_new(site.address, marker.forward._region.address)
        self.other_returns: dict = {}
        self.plan = plan

    def forward_position(self) -> int:
        with _no_python_dispatch():
            return torch.ops.sac.mode_region_forward_position(self.address)

    def release_unreached(self, last_saved_position: int) -> int:
        with _no_python_dispatch():
            return torch.ops.sac.mode_region_release_unreached(self.address, last_saved_position)

    def __del__(self):
        release = getattr(getattr(torch.ops, "sac", None), "mode_region_release", None)
        if release is not None:
            with _no_python_dispatch():
                release(self.address)


# c10::MemoryFormat's values: the fallback's stack holds a memory format as this int, and an `Any`
# argument cannot take a torch.memory_format. dtypes and layouts travel as ints by themselves.
_MEMORY_FORMATS = {
    torch.contiguous_format: 0,
    torch.preserve_format: 1,
    torch.channels_last: 2,
    torch.channels_last_3d: 3,
}


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
        return _MEMORY_FORMATS.get(value, _UNNAMED)
    return _UNNAMED


class _RegionMode(TorchDispatchMode):
    """The forward or the recompute of one region: every call goes to C++ before and after its
    kernel, which runs with the mode off (NOTE: [Ops called from inside a kernel are not
    intercepted])."""

    def __init__(self, region: _ModeRegion, recompute: bool):
        super().__init__()
        self._region = region
        self._address = region.address
        self._recompute = recompute

    def __enter__(self):
        with _no_python_dispatch():
            torch.ops.sac.mode_region_pass(self._address, _BEGIN_RECOMPUTE if self._recompute else _BEGIN_FORWARD)
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            with _no_python_dispatch():
                torch.ops.sac.mode_region_pass(self._address, _END_RECOMPUTE if self._recompute else _END_FORWARD)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _ops[func] if func in _ops else _op(func)
        if op is None:
            return func(*args, **kwargs)
        flat = _flatten_arguments(op, args, kwargs)
        if not flat:
            return NotImplemented if flat is None else func(*args, **kwargs)
        tensors, positions, key = flat
        draws = op.random and _draws_random(op.dropout_p, args, kwargs)
        # Python dispatch off around the bridge: a mode below this one (a user's, entered outside
        # the region) sees the region's ops, never the engine's own calls.
        with _no_python_dispatch():
            action, call, served, counts = _call_begin(self._address, op.address, key, tensors, positions, draws)
        if action == _SERVED:
            return self._served(op, call, served, counts)
        out = func(*args, **kwargs)
        if action != _RUN_ONLY:
            out_tensors, out_positions = _flatten_returns(op, out)
            with _no_python_dispatch():
                _call_end(self._address, out_tensors, out_positions)
            keep = action == _RUN_AND_KEEP
            self._region.plan.setdefault(func, []).append(keep)
            if keep and op.other_returns:
                # Only the non-tensor values: the tensors are the region's, and freed with it.
                values = (out,) if len(op.returns) == 1 else out
                self._region.other_returns[call] = tuple(
                    value if slot == _OTHER else None for slot, value in zip(op.returns, values)
                )
        return out

    def _served(self, op: _Op, call: int, served, counts):
        return _assemble(op, served, counts, lambda position: self._region.other_returns[call][position])


def _assemble(op: _Op, served, counts, other_value):
    """A served call's return value from its tensors (flat, `counts` per return) and
    `other_value(position)` for each return that is not a tensor."""
    values = []
    next_tensor = 0
    for position, (slot, count) in enumerate(zip(op.returns, counts)):
        if slot == _TENSOR:
            values.append(served[next_tensor])
            next_tensor += 1
        elif slot >= _TENSOR_LIST:
            values.append(list(served[next_tensor : next_tensor + count]))
            next_tensor += count
        else:
            values.append(other_value(position))
    if len(values) == 1:
        return values[0]
    return tuple(values) if values else None


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
class _RecomputeAboveModes(TorchDispatchMode):
    """The recompute of a region the native fallback ran, under our mode on top of the others."""

    def __init__(self, address: int, marker):
        super().__init__()
        self._address = address
        self._marker = marker  # a RegionReference: entered through the C ABI, never a RegionScope
        self._marker_depth = 0

    def __enter__(self):
        # The marker's forward, entered and left at once, notes the units the region's recompute
        # re-opened; its recompute re-opens them again.
        _scopes.enter_marker(self._marker.address, 0)
        self._marker_depth = _scopes.enter_marker(self._marker.address, 1)
        try:
            return super().__enter__()
        except BaseException:
            _scopes.exit_marker(self._marker.address, 1, self._marker_depth)
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            _scopes.exit_marker(self._marker.address, 1, self._marker_depth)
            with _no_python_dispatch():
                torch.ops.sac.mode_region_release(self._address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _ops[func] if func in _ops else _op(func)
        if op is None:
            return func(*args, **kwargs)
        split = _split_arguments(op, args, kwargs)
        if not split:
            return NotImplemented if split is None else func(*args, **kwargs)
        tensors, positions, others = split
        values = [_as_ivalue(value) for value in others[1::2]]
        with _no_python_dispatch():
            action, _, served, counts, other_returns = _call_begin_all(
                self._address, op.address, tensors, positions, values, others[0::2], False
            )
        if action == _SERVED:
            return _assemble(op, served, counts, other_returns.__getitem__)
        out = func(*args, **kwargs)
        if action != _RUN_ONLY:
            out_tensors, out_positions = _flatten_returns(op, out)
            with _no_python_dispatch():
                _call_end(self._address, out_tensors, out_positions)
        return out


_marker_policy = _marker_site = None
_OWN_MODULES = f"{__package__}."


# torch's tracing modes (torch.compile's and export's fake, functional and proxy modes): under them
# values are fake and the compiler decides what is saved, so they are no reason to keep above modes.
_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, key) for key in ("FAKE", "FUNCTIONAL", "PROXY"))


def foreign_modes_on() -> bool:
    """Whether a TorchDispatchMode other than the plugin's own (the per-op trace) is on, outside
    torch's tracing."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    if any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES):
        return False
    return not all(type(mode).__module__.startswith(_OWN_MODULES) for mode in _current_dispatch_modes())


def _marker_reference() -> _scopes.RegionReference:
    """A new marker region: a keeps-nothing region that labels passes and re-opens units."""
    global _marker_policy, _marker_site
    if _marker_site is None:
        _marker_policy = Policy()  # alive as long as the site made from its address
        _marker_site = _scopes.SiteReference(_marker_policy._policy_address)
    return _scopes.RegionReference(_marker_site.address)


def recompute_above_modes(region_address: int):
    """NOTE: [Modes above the key see only what ran]: the context that runs the recompute of the
    native region at `region_address`, already entered, above the dispatch modes that are on;
    None when only the plugin's own modes are on (the per-op trace, which watches the fallback
    serve) or for a region that intercepts nothing (it serves nothing either)."""
    if not foreign_modes_on():
        return None
    marker = _marker_reference()
    with _no_python_dispatch():  # the engine's own calls are no business of the modes that are on
        address = torch.ops.sac.mode_region_over(region_address, marker.address)
    return _RecomputeAboveModes(address, marker) if address else None


def _draws_random(dropout_p: int, args, kwargs) -> bool:
    return draws_random(OpTraits(False, False, True, False, False, dropout_p), args, kwargs)


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
    region = _ModeRegion(site, marker, {} if plan is None else plan)
    return (
        _Entered(marker.forward, _RegionMode(region, recompute=False)),
        _Entered(marker.recompute, _RegionMode(region, recompute=True)),
        region,
    )
