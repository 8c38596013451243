"""The callables sac_plugin installs on module instances, and how they are removed.

sac_plugin never replaces a module's class: it installs an instance attribute. A checkpointed
module gets a `forward` that runs the class's forward through torch.utils.checkpoint; a submodule
a target map runs inside a recompute unit gets a `forward` (or, for a method, a bound wrapper)
that opens the unit around the class's own. Parameter names and state_dict keys never change, and
`remove_installed` restores exactly what was there before.

NOTE: [An instance forward already there runs inside]
A module may already have an instance `forward` when sac_plugin comes: accelerate's
add_hook_to_module (device_map, CPU offload) installs one that moves inputs and weights and then
calls the class's forward; a user may have patched one in. Calling the class's forward instead
would drop it silently and change the output. So the forward found on the instance is kept in
`_sac_inner_forward` and called where the class's forward would be: inside the checkpoint (so
its work is recomputed with the rest) and inside the units; `remove_installed` puts it back.
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from . import _compat
from .units import recompute_unit

__all__ = [
    "CheckpointedForward",
    "checkpoint_call",
    "ForwardInUnits",
    "InstanceForward",
    "MethodInUnits",
    "remove_installed",
    "run_in_unit",
]

# Instance attributes the wrappers below keep on a module; remove_installed deletes them all. An
# integration that changes a module in its framework's own way leaves `_sac_undo` there: a callable
# that puts the module back, which remove_installed calls.
_STATE_ATTRIBUTES = (
    "_sac_undo",
    "_sac_policy",
    "_sac_context_fn",
    "_sac_preserve_rng_state",
    "_sac_early_stop",
    "_sac_forward_units",
    "_sac_inner_forward",
    "_sac_plan_request",
)


class InstanceForward:
    """Base of the callables the package installs as an instance's `forward`.

    An object rather than types.MethodType(function, module): a bound method pickles as
    getattr(module, function name), which the unpickled module does not have, so torch.save
    would work and torch.load fail. This one pickles (and deep-copies) as its class and its
    module; pickle memoizes the module before its attributes, so the reference back resolves to
    the copy. TorchScript cannot compile it, so the owning module also gets a
    __prepare_scriptable__ that says so (torch.jit.script calls it on every submodule before
    compiling anything).

    It refers to its module weakly: the module holds it in its __dict__, and a strong reference
    back would be a cycle that keeps the module, and its device memory, alive after the last
    reference to it goes, until the cyclic garbage collector runs.
    """

    __slots__ = ("_module",)
    # What the module became, for the TorchScript refusal.
    what = ""

    def __init__(self, module: torch.nn.Module):
        self._module = weakref.ref(module)

    @property
    def module(self) -> torch.nn.Module:
        return _alive(self._module, type(self).__name__)

    def __reduce__(self):
        return (type(self), (self.module,))

    @classmethod
    def install(cls, module: torch.nn.Module) -> None:
        found = module.__dict__.get("forward")
        if found is not None and not isinstance(found, InstanceForward):
            module._sac_inner_forward = found  # NOTE: [An instance forward already there runs inside]
        module.forward = cls(module)
        module.__prepare_scriptable__ = _RefuseScripting(module)


def inner_forward(module: torch.nn.Module, args: tuple) -> tuple:
    """(the forward sac_plugin's own runs, its positional arguments): the instance forward found
    when it was installed, else the class's with `module` first. Not a bound method made here:
    torch.compile (torch 2.11's) cannot trace binding a function to an instance."""
    found = module.__dict__.get("_sac_inner_forward")
    return (found, args) if found is not None else (type(module).forward, (module, *args))


def _alive(reference: weakref.ref, holder: str) -> torch.nn.Module:
    module = reference()
    if module is None:
        raise ReferenceError(
            f"sac_plugin: this {holder} belongs to a module that no longer exists; call the module itself, "
            "not a forward taken from it"
        )
    return module


class _RefuseScripting:
    """A module's __prepare_scriptable__: refuses torch.jit.script with what to do instead. It
    refers to its module weakly, as InstanceForward does, for the same reason."""

    __slots__ = ("_module",)

    def __init__(self, module: torch.nn.Module):
        self._module = weakref.ref(module)

    @property
    def module(self) -> torch.nn.Module:
        return _alive(self._module, "__prepare_scriptable__")

    def __reduce__(self):
        return (_RefuseScripting, (self.module,))

    def __call__(self):
        forward = self.module.__dict__.get("forward")
        what = forward.what if isinstance(forward, InstanceForward) else "changed by sac_plugin"
        raise TypeError(
            f"sac_plugin: torch.jit.script cannot compile {type(self.module).__name__}: its forward is {what}, "
            "which TorchScript does not support. Script the model before applying sac_plugin, or use "
            "torch.compile, which honours the same policy"
        )


def checkpoint_call(
    function,
    args: tuple,
    kwargs: dict,
    *,
    context_fn,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    offload_inputs: bool = False,
):
    """torch.utils.checkpoint.checkpoint(function, *args, **kwargs), non-reentrant, with every
    keyword reaching `function`.

    NOTE: [Every keyword reaches the module]
    checkpoint takes keyword arguments of its own (use_reentrant, context_fn, determinism_check,
    debug, early_stop, preserve_rng_state) and would swallow a caller's keyword of the same name,
    or pass it on only when it is not one of those. The keywords are therefore bound into the
    function that checkpoint calls (checkpoint re-runs that same function in the recompute), and
    checkpoint itself is given none of the caller's.

    offload_inputs: the region holds the offloadable positional inputs instead of torch's
    checkpoint (NOTE: [Offloading a layer's inputs] in csrc/dispatch/offload.cpp; context_fn must
    make a region, as a policy with offload_inputs does).
    """
    if kwargs:
        function = functools.partial(function, **kwargs)
    if offload_inputs and torch.is_grad_enabled():
        if _compat.is_compiling():
            raise RuntimeError(
                "sac_plugin: Policy(offload_inputs=True) does not work under torch.compile: the compiled graph "
                "holds the layers' inputs itself; use a policy without offload_inputs for compiled models, or "
                "torch._functorch.config.enable_activation_offloading for the compiler's own offload"
            )
        positions = [i for i, value in enumerate(args) if _offloadable_input(value)]
        if positions:
            function = _InputsHeldByRegion(function, args, positions, context_fn)
            args = tuple(_placeholder(value) if i in positions else value for i, value in enumerate(args))
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=context_fn,
        preserve_rng_state=preserve_rng_state,
        early_stop=early_stop,
    )


# Marks an input a region gave back for its recompute (_offloadable_input).
_HANDED_BACK = "_sac_held_input"


def _offloadable_input(value) -> bool:
    # The activation flowing through the stack, on an accelerator (NOTE: [Offloading a layer's inputs]).
    # An input a region gives back for its recompute is detached, so a leaf; it was an activation
    # in the forward, and a checkpointed layer inside (nested checkpoints) must hold it in the
    # recompute as it did in the forward, or torch's checkpoint finds different saved inputs.
    return (
        isinstance(value, torch.Tensor)
        and value.requires_grad
        and (value.grad_fn is not None or getattr(value, _HANDED_BACK, False))
        and not isinstance(value, torch.nn.Parameter)
        and value.device.type not in ("cpu", "meta")
    )


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """What torch's checkpoint holds in an offloaded input's place: no bytes, on the input's
    device, so that checkpoint still saves and restores that device's RNG state."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _function_name(function) -> str:
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__qualname__", type(function).__name__)


# The checkpoint sites (their context_fn) that have named an input they could not offload.
_told_inputs_stay: weakref.WeakSet = weakref.WeakSet()


def _dense(tensor: torch.Tensor) -> bool:
    # Non-overlapping and dense: some order of its dimensions is contiguous, whatever its offset.
    if tensor.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _why_not_offloaded(tensor: torch.Tensor) -> str | None:
    # The region decides which inputs it offloads (offloadable in csrc/dispatch/offload.cpp); this
    # only says why, for a refusal the region does not name itself. A dense input it did not offload
    # met the host_memory_limit, which the region names once per site.
    if not torch._C._has_storage(tensor):
        return (
            "it has no storage of its own (a tensor subclass), and the offload copies a tensor's storage; "
            "it stays on the device, as torch's checkpoint holds it"
        )
    if not _dense(tensor):
        return (
            "it is not dense (an expanded or overlapping view, or one with gaps between its elements), and the "
            "offload copies only dense tensors; it stays on the device, as torch's checkpoint holds it: pass "
            "x.contiguous() to offload it"
        )
    return None


class _InputsHeldByRegion:
    """The function torch's checkpoint runs when the region holds the inputs (NOTE: [Offloading a
    layer's inputs] in csrc/dispatch/offload.cpp). Its first call is the forward: it runs `function`
    on the real inputs, then hands them to the region, keeping no reference, and names an input the
    region could not offload (once per checkpoint site). Every later call is a recompute: it runs
    `function` on the copies the region gives back, detached, each requiring grad as its input did."""

    __slots__ = ("_function", "_inputs", "_positions", "_requires_grad", "_names", "_site")

    def __init__(self, function, args: tuple, positions: list[int], site=None):
        self._function = function
        self._inputs = [args[i] for i in positions]
        self._positions = positions
        self._requires_grad = [args[i].requires_grad for i in positions]
        # What says "once per checkpoint site": the context_fn, one per site.
        self._site = site
        name = _function_name(function)
        # A module's class forward is called with the module first (inner_forward): count from its input.
        first = 1 if args and isinstance(args[0], torch.nn.Module) else 0
        self._names = [f"positional argument {i - first} of {name}" for i in positions]

    @property
    def __wrapped__(self):
        return self._function

    def __call__(self, *args):
        args = list(args)
        inputs, self._inputs = self._inputs, None
        if inputs is not None:
            for position, tensor in zip(self._positions, inputs):
                args[position] = tensor
            out = self._function(*args)
            with torch._C._DisableTorchDispatch():  # the plugin's own calls: no mode sees them
                offloaded, notice = torch.ops.sac.region_hold_inputs(inputs, self._names)
            if notice:
                warnings.warn(notice, UserWarning, stacklevel=2)
            if not all(offloaded):
                self._name_inputs_that_stay(inputs, offloaded)
            return out
        with torch._C._DisableTorchDispatch():
            fetched = torch.ops.sac.region_take_inputs()
        for position, tensor, requires_grad in zip(self._positions, fetched, self._requires_grad):
            handed_back = tensor.detach().requires_grad_(requires_grad)
            setattr(handed_back, _HANDED_BACK, True)
            args[position] = handed_back
        return self._function(*args)

    def _name_inputs_that_stay(self, inputs, offloaded) -> None:
        site = self._site
        try:
            if site is None or site in _told_inputs_stay:
                return
        except TypeError:  # a context_fn that cannot be weakly referenced: said at each forward
            site = None
        stay = []
        for name, tensor, done in zip(self._names, inputs, offloaded):
            why = None if done else _why_not_offloaded(tensor)
            if why is not None:
                stay.append(f"{name}, of shape {tuple(tensor.shape)} and strides {tensor.stride()}: {why}")
        if not stay:
            return
        if site is not None:
            _told_inputs_stay.add(site)
        warnings.warn(
            "sac_plugin: Policy(offload_inputs=True) cannot offload "
            + "; nor ".join(stay)
            + " (said once per checkpoint site)",
            UserWarning,
            stacklevel=3,
        )


class CheckpointedForward(InstanceForward):
    """The forward of a module that apply_selective_checkpointing checkpointed."""

    __slots__ = ()
    what = "checkpointed (apply_selective_checkpointing runs it through torch.utils.checkpoint)"

    def __call__(self, *args, **kwargs):
        module = self.module
        function, args = inner_forward(module, args)
        return checkpoint_call(
            function,
            args,
            kwargs,
            context_fn=module._sac_context_fn,
            preserve_rng_state=module._sac_preserve_rng_state,
            early_stop=module.__dict__.get("_sac_early_stop", True),
            offload_inputs=module._sac_policy.offload_inputs,
        )


def call_in_units(units, function, *args, **kwargs):
    if not units:
        return function(*args, **kwargs)
    with recompute_unit(units[0]):
        return call_in_units(units[1:], function, *args, **kwargs)


class ForwardInUnits(InstanceForward):
    """The forward of a submodule that run_in_unit runs inside units (picklable, see InstanceForward)."""

    __slots__ = ()
    what = "run inside recompute units (a recompute config or run_in_unit installed them)"

    def __call__(self, *args, **kwargs):
        module = self.module
        function, args = inner_forward(module, args)
        return call_in_units(module._sac_forward_units, function, *args, **kwargs)


class MethodInUnits:
    """A method of one instance run inside units; rebinds to the copy on deepcopy and pickling.
    The instance holds it, so it refers to the instance weakly (as InstanceForward does)."""

    def __init__(self, owner, name: str, units: tuple[str, ...]):
        self._owner, self._name, self.units = weakref.ref(owner), name, units

    def __call__(self, *args, **kwargs):
        owner = _alive(self._owner, f"{self._name} run in units")
        return call_in_units(self.units, getattr(type(owner), self._name), owner, *args, **kwargs)

    def __reduce__(self):
        return (MethodInUnits, (_alive(self._owner, f"{self._name} run in units"), self._name, self.units))

    def __deepcopy__(self, memo):
        owner = _alive(self._owner, f"{self._name} run in units")
        return MethodInUnits(copy.deepcopy(owner, memo), self._name, self.units)


def run_in_unit(owner, name: str, unit: str) -> None:
    """Makes `owner.name` (a submodule, or a method of owner) run inside `unit`. Idempotent."""
    from . import _unit_checks

    target = getattr(owner, name)
    _unit_checks.declare(unit)
    if isinstance(target, torch.nn.Module):
        units = target.__dict__.get("_sac_forward_units", ())
        if unit not in units:
            target._sac_forward_units = (*units, unit)
            ForwardInUnits.install(target)
        return
    current = owner.__dict__.get(name)
    units = current.units if isinstance(current, MethodInUnits) else ()
    if unit not in units:
        setattr(owner, name, MethodInUnits(owner, name, (*units, unit)))


def installed_anything(module: torch.nn.Module) -> bool:
    """Whether sac_plugin installed anything on `module` or any of its submodules."""
    for sub in module.modules():
        state = sub.__dict__
        if isinstance(state.get("forward"), InstanceForward) or any(a in state for a in _STATE_ATTRIBUTES):
            return True
        if any(isinstance(value, MethodInUnits) for value in state.values()):
            return True
    return False


def remove_installed(module: torch.nn.Module) -> int:
    """Removes everything sac_plugin installed on `module` and its submodules (checkpointed
    forwards, forwards and methods run in units, plans); returns how many modules changed."""
    changed = 0
    for sub in module.modules():
        state = sub.__dict__
        removed = False
        undo = state.get("_sac_undo")
        if undo is not None:
            undo()
            removed = True
        if isinstance(state.get("forward"), InstanceForward):
            del state["forward"]
            removed = True
            if "_sac_inner_forward" in state:
                state["forward"] = state["_sac_inner_forward"]
        if isinstance(state.get("__prepare_scriptable__"), _RefuseScripting):
            del state["__prepare_scriptable__"]
            removed = True
        for attribute in _STATE_ATTRIBUTES:
            if attribute in state:
                del state[attribute]
                removed = True
        for name in [name for name, value in state.items() if isinstance(value, MethodInUnits)]:
            del state[name]
            removed = True
        changed += removed
    return changed
