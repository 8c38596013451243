"""Profiling a layer: every call of its forward as the plugin's fallback sees it, with bytes,
kernel time and whether it may be kept (csrc/dispatch/call_profile.h), plus the activation
bytes the layer holds without checkpointing and with full recompute, counted as
sac_plugin.memory (and benchmarks/bench_memory.py) counts them, with full recompute's the RNG
state the checkpoint saves beside them; and the copy bandwidth each way between the layer's
accelerator and pinned host memory, which prices offloading."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics

import torch
from torch.utils._pytree import tree_leaves

from .. import _native, _observers, _rule, _scopes, units as _units
from .._forwards import checkpoint_call
from ..checkpointing import context_fn
from ..memory import track_activation_memory
from .._validation import bounded_repr
from ..policy import Policy


AFTER_THE_RECOMPUTE_STOPS = "after the recompute stops"
# The profile's label (C++ kWrittenInTheForward) for a call whose output the forward writes later.
WRITTEN_IN_THE_FORWARD = "written later in the forward"


@dataclasses.dataclass(frozen=True)
class ProfiledCall:
    """One call of a profiled layer's forward, as a plan prices it.

    Attributes:
        op: The op, "aten::mm" (default overload) or "aten::add.Tensor".
        index: 0-based among the forward's calls of this op, as `kept_calls` counts.
        unit: The innermost open recompute unit, "" for none.
        bytes: Bytes of the new storages the call creates (aliases count 0).
        seconds: Median kernel time over the profile's runs.
        why_not_keepable: Why no policy may keep the call, "" when one may.
        recomputed: Whether a checkpoint's recompute reaches the call: it stops once autograd has
            saved its last tensor again, so calls after that point never run twice (keeping them
            saves nothing).
        units: The units open around the call, outermost first, as the rule takes them: a name,
            or a `RegionOpening` (name and recompute= flag) for a unit a torch_remat region
            opened. Empty for a call in no unit; `(unit,)` where only the innermost is known.
    """

    op: str
    index: int
    unit: str
    bytes: int
    seconds: float
    why_not_keepable: str
    recomputed: bool = True
    units: tuple = None

    def __post_init__(self):
        if self.units is None:
            object.__setattr__(self, "units", (self.unit,) if self.unit else ())

    @property
    def keepable(self) -> bool:
        """Worth offering to a plan: a policy may keep it and the recompute would run it."""
        return not self.why_not_keepable


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """What a plan knows of a layer (`Plan.profile`): its forward's calls and the bytes it holds.

    Attributes:
        calls: The forward's calls, in order.
        no_checkpoint_bytes: Bytes held between forward and backward without checkpointing.
        full_recompute_bytes: Bytes held with checkpointing that keeps nothing (the floor): the
            saved inputs and `rng_state_bytes`.
        runs: How many forwards the call times are the median of.
        rng_state_bytes: The RNG states torch's checkpoint saves with the layer's inputs (part of
            the floor).
    """

    calls: tuple[ProfiledCall, ...]
    no_checkpoint_bytes: int
    full_recompute_bytes: int
    runs: int
    rng_state_bytes: int = 0


def _leaves(value):
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _storage_key(tensor) -> int:
    """A tensor's storage identity, as the profile names storages (0: none it can name)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _backward(output) -> None:
    tensors = [t for t in _leaves(output) if t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _fresh(value):
    """A detached copy of each tensor argument that keeps requires_grad, so that profiling adds
    nothing to the caller's graph and no gradient to its tensors."""
    if isinstance(value, torch.Tensor):
        # An inference-mode tensor cannot be saved for backward: profile a normal copy of it.
        fresh = value.clone() if value.is_inference() else value.detach()
        return fresh.requires_grad_(value.requires_grad)
    return value


@contextlib.contextmanager
def leaves_no_trace(module: torch.nn.Module, devices, buffers_on_host: bool = False):
    """Restores what profiling runs change: the RNG streams of `devices`, parameter gradients and
    buffers. `buffers_on_host` keeps the buffers' copies in host memory, adding no device bytes to
    what the runs measure."""
    grads = [(p, p.grad) for p in module.parameters()]
    if buffers_on_host:
        buffers = [(b, b.detach().to("cpu", copy=True)) for b in module.buffers()]
    else:
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for p, grad in grads:
                p.grad = grad
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def checkpoint_rng_state_bytes(args: tuple, device: torch.device) -> int:
    """The bytes on `device` (where the layer's activations live) of the RNG states
    torch.utils.checkpoint saves for a call with these positional arguments (preserve_rng_state,
    the default): the CPU generator's state always, and each device's generator state where the
    device's runtime is initialised. Measured by taking the states exactly as the checkpoint takes
    them, with its own helpers. An accelerator's states are host tensors, so on an accelerator
    they hold no device bytes."""
    from torch.utils import checkpoint as torch_checkpoint

    states = [torch.get_rng_state()]
    device_module = torch_checkpoint._get_device_module(torch_checkpoint._infer_device_type(*args))
    if getattr(device_module, "_initialized", False):
        states += torch_checkpoint.get_device_states(*args)[1]
    return sum(state.untyped_storage().nbytes() for state in states if state.device.type == device.type)


class _UnitsOfCalls(_observers.Observer):
    """The units open around each call of one profiling run, with torch_remat regions' flags.

    NOTE: [A profile records each call's open units]
    The rule decides a call by every unit open around it, and a torch_remat region's opening
    carries its recompute= flag (NOTE: [Region openings carry their flag] in
    csrc/policy/unit_stack.h), but the C++ profile records only the innermost unit's name. So a
    profile watches each unit opening as reports do (an Observer) and notes, at each opening and
    closing, how many calls the run has recorded: the calls from there to the next event ran with
    that stack open. An opening is a region's when it pushed a flag on the region wrapper's stack
    (sac_plugin.units), the flag it pushed. Units open before the run are known by name only.
    """

    def __init__(self, handle):
        self._handle = handle
        self._base = tuple(_native.C.open_units())
        self._flags = _units._region_flags()
        self._open: list[tuple[object, int]] = []  # (unit as the rule takes it, flags open at its entry)
        self._flags_at_start = len(self._flags)
        self.events: list[tuple[int, tuple]] = [(0, self._base)]

    def _note(self) -> None:
        self.events.append((self._handle.recorded_in_run(), self._base + tuple(unit for unit, _ in self._open)))

    def unit_entered(self, name: str):
        outer_flags = self._open[-1][1] if self._open else self._flags_at_start
        unit = name
        if len(self._flags) > outer_flags:
            unit = _rule.RegionOpening(name, bool(self._flags[-1]))
        self._open.append((unit, len(self._flags)))
        self._note()
        return None

    def unit_exited(self, name: str, token) -> None:
        if self._open:
            self._open.pop()
        self._note()

    def of_calls(self, innermost: list[str]) -> list[tuple]:
        """Each call's open units; a call whose innermost unit is not the one the C++ profile
        recorded (a unit opened where no observer sees it) keeps the recorded name alone."""
        stacks, event = [], 0
        for i, recorded in enumerate(innermost):
            while event + 1 < len(self.events) and self.events[event + 1][0] <= i:
                event += 1
            stack = self.events[event][1]
            name = stack[-1].name if stack and type(stack[-1]) is _rule.RegionOpening else (stack[-1] if stack else "")
            stacks.append(stack if name == recorded else ((recorded,) if recorded else ()))
        return stacks


def held_bytes(module, args, kwargs, policy: Policy | None) -> int:
    """Bytes held between forward and backward for one forward (sac_plugin.memory's count)."""
    args = tuple(_fresh(a) for a in args)
    kwargs = {k: _fresh(v) for k, v in kwargs.items()}
    with track_activation_memory(module.parameters()) as memory:
        if policy is None:
            out = module(*args, **kwargs)
        else:
            out = checkpoint_call(module, args, kwargs, context_fn=context_fn(policy))
        held = memory.bytes()
    _backward(out)
    return held


def profile_layer(
    module: torch.nn.Module, args: tuple, kwargs: dict, *, runs: int = 5, warmup: int = 1
) -> LayerProfile:
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        raise ValueError(
            f"sac_plugin: plan: runs must be an int >= 1 (timed forwards per call), got {bounded_repr(runs)}"
        )
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"sac_plugin: plan: warmup must be an int >= 0, got {bounded_repr(warmup)}")
    if _native.C.interception_path() == "not installed":
        raise RuntimeError(
            "sac_plugin: plan: profiling needs the plugin's C++ interception, which could not be "
            "installed in this torch (see the warning at import); write a Policy by hand instead"
        )
    devices = sorted({t.device.index or 0 for t in _leaves((args, kwargs)) if t.is_cuda})
    handle = _native.C.CallProfile()
    with leaves_no_trace(module, devices):
        for _ in range(warmup):
            _backward(module(*(_fresh(a) for a in args), **{k: _fresh(v) for k, v in kwargs.items()}))
        no_checkpoint = held_bytes(module, args, kwargs, None)
        floor = held_bytes(module, args, kwargs, Policy())
        for _ in range(runs):
            call_args = tuple(_fresh(a) for a in args)
            call_kwargs = {k: _fresh(v) for k, v in kwargs.items()}
            forward = _scopes.profiling_region_forward(handle)
            packed_at = []

            def pack(tensor):
                packed_at.append(handle.recorded_in_run())
                return tensor

            first_run = handle.runs() == 0
            watch = _observers.observe(_UnitsOfCalls(handle)) if first_run else contextlib.nullcontext()
            handle.begin_run()
            try:
                with watch as watched, forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    out = module(*call_args, **call_kwargs)
            finally:
                handle.end_run()
            if first_run:
                units_of_calls = watched
            if handle.runs() == 1:
                # What the layer returns stays alive after its region whatever a policy keeps.
                handle.note_layer_outputs([_storage_key(t) for t in _leaves(out)])
            # NOTE: [Where the recompute stops] torch.utils.checkpoint (non-reentrant) stops the
            # recompute as soon as every tensor the forward saved has been saved again; autograd
            # saves a call's inputs before it runs and its outputs after, so the calls recorded
            # before the last save are the ones a recompute runs.
            recomputed_prefix = max(packed_at, default=0)
            _backward(out)
    ops, indices, units, sizes, why, seconds = handle.rows()
    count = handle.runs()
    stacks = units_of_calls.of_calls(list(units))
    calls = tuple(
        ProfiledCall(
            op,
            index,
            unit,
            size,
            statistics.median(seconds[i * count : (i + 1) * count]),
            reason if reason or i < recomputed_prefix else AFTER_THE_RECOMPUTE_STOPS,
            i < recomputed_prefix,
            stacks[i],
        )
        for i, (op, index, unit, size, reason) in enumerate(zip(ops, indices, units, sizes, why))
    )
    # The checkpoint passes the module's forward the module itself and the positional arguments
    # (keywords are bound into the function: NOTE: [Every keyword reaches the module]).
    device = accelerator_device(module, args, kwargs) or torch.device("cpu")
    rng_state = checkpoint_rng_state_bytes((module, *args), device)
    return LayerProfile(calls, no_checkpoint, floor + rng_state, count, rng_state)


BANDWIDTH_PROBE_BYTES = 8 << 20  # large enough that a copy's fixed launch cost is a small part of it
BANDWIDTH_PROBE_COPIES = 5


def accelerator_device(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device | None:
    """The accelerator device the layer's parameters or inputs are on, or None when there is no
    accelerator or the layer runs elsewhere (on CPU): then nothing can be offloaded from it."""
    if not torch.accelerator.is_available():
        return None
    kind = torch.accelerator.current_accelerator().type
    for tensor in itertools.chain(module.parameters(), _leaves((args, kwargs))):
        if tensor.device.type == kind:
            return tensor.device
    return None


def measure_offload_bandwidth(
    device: torch.device, *, nbytes: int = BANDWIDTH_PROBE_BYTES, copies: int = BANDWIDTH_PROBE_COPIES
) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes per second between `device` and pinned host memory:
    the median of `copies` non_blocking copies of `nbytes` each way, timed by events on the current
    stream after one untimed copy each way. The two directions are timed apart: they differ."""
    with torch.accelerator.device_index(device.index):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def bytes_per_second(copy) -> float:
            copy()
            torch.accelerator.synchronize(device)
            seconds = []
            for _ in range(copies):
                start = torch.Event(device=device, enable_timing=True)
                end = torch.Event(device=device, enable_timing=True)
                start.record()
                copy()
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            return nbytes / max(statistics.median(seconds), 1e-9)

        device_to_host = bytes_per_second(lambda: host.copy_(on_device, non_blocking=True))
        host_to_device = bytes_per_second(lambda: on_device.copy_(host, non_blocking=True))
    return device_to_host, host_to_device
