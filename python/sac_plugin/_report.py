"""A per-layer report of what checkpointing kept and recomputed, and of what is saved for backward.

    with sac_plugin.report(model) as rep:
        loss = model(x).sum(); loss.backward()
    print(rep.table()); rep.to_json()

Broken down by checkpointed module (its qualified name in `model`) and, inside it, by recompute
unit: calls, ops run in the forward and in the recompute, kept outputs served (hits), calls kept
and bytes kept, and kept outputs held but never served (NOTE: [Served, or named] in
csrc/dispatch/kept_outputs.cpp). Plus every storage saved for backward, inside regions (the kept outputs) and
outside them (autograd's saved tensors, by the module that saved them), each once, naming the
tensors on it, their shapes and dtypes: torch_remat's print_saved_tensors_report, per layer.

How the data gets here, only while a report runs: the report runs an audit (so every op is
counted and every checkpointed call creates a region) and registers an observer
(sac_plugin._observers) that wraps each region's forward and recompute contexts and each unit
opening in a count of this thread's calls (_C.Counts: no scope of its own, so
nested reports close theirs in any order), keeps a stack of the modules being called (global
module hooks) to name regions, and a saved-tensors pack hook that notes (never holds) what
autograd saves outside regions. A traced report also installs a C++ call trace on the thread of
each region pass, which the fallback fills (NOTE: [The per-op trace is recorded below Python]).
Without a report none of this exists: no cost per op or per region.
The report's saved-tensors hook is the innermost while it runs, so saved_tensors_hooks entered
around it (track_activation_memory, CPU offload) do not see the saves made inside it: report a
step of its own. Kept bytes come from the native engine's region store; the dispatch-mode engine keeps in torch's
SAC cache, which is not inspectable, so there kept bytes read 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import weakref

import torch

from . import _native, _observers, memory
from . import _report_render
from ._audit import Audit, AuditRow
from ._report_values import Breakdown, SavedStorage
from ._trace import CallTrace, TraceEntry, check_trace_supported, trace_table
from ._validation import describe_value

__all__ = ["Report", "report", "trace"]

OUTSIDE = "(outside regions)"
# Tensor descriptions kept per saved-storage entry: enough to recognise it, bounded over steps.
_TENSORS_PER_STORAGE = 8
running_reports: list[Report] = []  # innermost last (the OOM observer prints it)
# Each thread's open reports, in the order they were entered (see _ClosedAtThreadEnd).
_open_here = threading.local()


class _ClosedAtThreadEnd:
    """Held only by the list of open reports of the thread that entered a report. A thread that
    ends with the report open frees that list on its way out, and this closes the report there:
    its observer, global module hooks and running_reports entry, which are process-wide and hold
    the report and its model, do not outlive the thread. A list frees its items last first, so
    nested reports close innermost first."""

    __slots__ = ("report",)

    def __init__(self, report: Report):
        self.report = report

    def __del__(self):
        report, self.report = self.report, None
        if report is not None and any(running is report for running in running_reports):
            report.__exit__(None, None, None)


class _PassScope:
    """A region's forward or recompute context, wrapped to count what runs in it."""

    __slots__ = ("_report", "_layer", "_phase", "_inner", "_kept_calls", "_region", "_audit", "_scope", "_started")

    def __init__(self, report, layer, phase, inner, kept_calls, region):
        self._report, self._layer, self._phase = report, layer, phase
        self._inner, self._kept_calls, self._region = inner, kept_calls, region

    def __enter__(self):
        # NOTE: [Allocation sites] A profiler scope named after the checkpointed module and the
        # pass, so torch.profiler (profile_memory=True) and the CUDA memory snapshot attribute each
        # allocation made in the forward or the recompute to the layer that made it.
        self._scope = torch.autograd.profiler.record_function(f"sac_plugin.{self._phase}: {self._layer}")
        self._scope.__enter__()
        # This thread's counts (inside the report's audit), with no scope to close in order: the
        # passes and units of nested reports open and close interleaved.
        self._audit = _native.C.Counts()
        report = self._report
        _stack(report).append(
            (self._layer, self._phase, self._kept_calls, self._region, self._audit, len(report._modules))
        )
        if report._call_trace is not None:
            report._call_trace.install()
            report._note_trace_context()
        try:
            self._inner.__enter__()
        except BaseException:
            self._unwind()
            raise
        self._started = _clock()
        return self

    def _unwind(self) -> None:
        report = self._report
        _stack(report).pop()
        if report._call_trace is not None:
            report._call_trace.uninstall()
            report._note_trace_context()
        self._scope.__exit__(None, None, None)

    def __exit__(self, *exc_info):
        report = self._report
        seconds = 0.0
        try:
            seconds = _clock() - self._started
        finally:
            # The inner context closes and the pass unwinds even where the clock's synchronize
            # raised (an accelerator's error surfaces there): the report's stack stays balanced.
            try:
                suppress = self._inner.__exit__(*exc_info)
            finally:
                self._unwind()
                report._pass_done(self, self._audit, seconds)
        return suppress


# NOTE: [Pass times]
# A layer's forward and recompute times are the wall time between entering and leaving each of
# its passes (time.perf_counter), summed over its calls; a unit's, between its opening and
# closing, so a unit's time is part of its layer's. With an accelerator, the clock first waits for
# the work queued on it (torch.accelerator.synchronize), so a pass is billed what it ran, not what
# it queued: the report then slows the steps it measures by those waits, its cost while it runs.
# A layer nested in another's pass counts in both.
def _clock() -> float:
    """Now, in seconds, once the accelerator's queued work is done (NOTE: [Pass times])."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    return time.perf_counter()


def _stack(report) -> list:
    """The report's passes open on this thread (each report its own: reports nest)."""
    local = report._local
    if not hasattr(local, "passes"):
        local.passes = []
    return local.passes


class _ReportObserver(_observers.Observer):
    """What a running Report registers in the observer seam."""

    __slots__ = ("report",)

    def __init__(self, report: Report):
        self.report = report

    def wrap_passes(self, region, policy, forward, recompute, kept_calls):
        return self.report._wrap(region, policy, forward, recompute, kept_calls)

    def unit_entered(self, name: str):
        return self.report.unit_entered(name)

    def unit_exited(self, name: str, token) -> None:
        if token is not None:
            self.report.unit_exited(name, token)


class Report:
    """What checkpointing kept and recomputed, per checkpointed module and unit, over the steps run
    inside it, and every storage saved for backward.

    Made by `sac_plugin.report` or `sac_plugin.trace` and entered as a context manager; the
    results are read after it exits (the trace is filled at exit).

    Args:
        model: The model whose module names label the checkpointed layers (None: each is named
            by its class).
        trace: Also record every call in the checkpointed regions, in order (native engine only).

    Attributes:
        layers: Breakdown by checkpointed module name: calls, ops per phase, hits, kept calls and
            bytes, offloaded calls and bytes.
        units: Breakdown by (checkpointed module name, unit name).
        steps: Steps run inside the report (outermost calls of `model`).
        totals: The audit's rows for every op run while the report ran.
        offload_copies: Copies to the host and back, their bytes and the exposed copy time, while
            the report ran.
        trace: The traced calls (TraceEntry), when asked for a trace.
    """

    def __init__(self, model: torch.nn.Module | None = None, *, trace: bool = False):
        self._model = model
        self._trace = trace
        self.trace: list[TraceEntry] = []
        self._names = (
            {id(m): name or type(m).__name__ for name, m in model.named_modules()} if model is not None else {}
        )
        self.layers: dict[str, Breakdown] = {}
        self.units: dict[tuple[str, str], Breakdown] = {}
        # Storages saved for backward, aggregated by (where, device, bytes): bounded by the model's
        # shape, not by the steps run. A storage is told apart from a later one at the same address
        # by a weak reference to it (NOTE: [Saved storages are counted per life, not per address]).
        self._saved: dict[tuple[str, str, int], SavedStorage] = {}
        self._live: dict[tuple[str, int], tuple] = {}
        # What each storage's weak reference calls back with: the report itself, weakly, so that
        # the report's own references make no cycle and it is freed with its last reference.
        self._weak_self = weakref.ref(self)
        self._local = threading.local()
        self._thread = None
        self.steps = 0
        self._parameters = set()
        self._modules: list = []  # the modules being called on this thread (names regions)
        self._audit = Audit()
        self._exit = contextlib.ExitStack()
        self._call_trace = CallTrace() if trace else None
        self.totals: list[AuditRow] = []
        # Offload copies while the report ran (NOTE: [Offloading kept outputs]): each direction's
        # copies and bytes and the exposed copy time, process-wide counters read at entry and exit.
        self.offload_copies: dict[str, int] = dict.fromkeys(_OFFLOAD_COUNTERS, 0)
        self._offload_at_entry: dict[str, int] = {}

    # --- running -------------------------------------------------------------------------------

    def __enter__(self):
        if self._trace:
            check_trace_supported()  # before anything is installed: a refusal leaves nothing behind
        self._thread = threading.get_ident()
        if self._model is not None:
            self._parameters = {p.untyped_storage().data_ptr() for p in self._model.parameters()}
        stack = self._exit
        stack.enter_context(self._audit)
        stack.enter_context(_observers.observe(_ReportObserver(self)))
        stack.enter_context(torch.nn.modules.module.register_module_forward_pre_hook(self._module_called))
        stack.enter_context(
            torch.nn.modules.module.register_module_forward_hook(self._module_returned, always_call=True)
        )
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved))
        running_reports.append(self)
        stack.callback(running_reports.remove, self)
        if not hasattr(_open_here, "reports"):
            _open_here.reports = []
        _open_here.reports.append(_ClosedAtThreadEnd(self))
        self._offload_at_entry = memory.offload_stats()
        return self

    def __exit__(self, *exc_info):
        for held in getattr(_open_here, "reports", ()):
            if held.report is self:
                held.report = None
        _open_here.reports = [held for held in getattr(_open_here, "reports", ()) if held.report is not None]
        self._exit.close()
        self.totals = self._audit.rows()
        if self._call_trace is not None:
            self.trace = self._call_trace.entries()
        now = memory.offload_stats()
        self.offload_copies = {name: now[name] - self._offload_at_entry[name] for name in _OFFLOAD_COUNTERS}
        return False

    def _note_trace_context(self) -> None:
        """Marks where the calls traced from now on belong: the innermost pass's layer, and the
        innermost module called since that pass began (with none, the layer's own body: the
        recompute reruns the checkpointed function, not the module's __call__)."""
        passes = _stack(self)
        if passes:
            layer, _, _, _, _, depth = passes[-1]
            module = self._innermost_module() if len(self._modules) > depth else layer
        else:
            layer = module = ""
        self._call_trace.mark(layer, module)

    def _name(self, module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _innermost_module(self) -> str:
        return self._name(self._modules[-1]) if self._modules else ""

    # The module stack and the layers are this report's thread's: a model trained on another
    # thread at the same time adds no layer and leaves no entry behind.
    def _module_called(self, module, args):
        if threading.get_ident() != self._thread:
            return
        if not self._modules and (self._model is None or module is self._model):
            self.steps += 1
        self._modules.append(module)
        if self._call_trace is not None and _stack(self):
            self._note_trace_context()

    def _module_returned(self, module, args, output):
        if threading.get_ident() == self._thread and self._modules and self._modules[-1] is module:
            self._modules.pop()
            if self._call_trace is not None and _stack(self):
                self._note_trace_context()

    def _current_layer(self) -> str:
        # The innermost module being called that is checkpointed (apply_selective_checkpointing
        # or a config marks it with its policy).
        for module in reversed(self._modules):
            if "_sac_policy" in vars(module):
                return self._name(module)
        return self._name(self._modules[-1]) if self._modules else "(a checkpointed function)"

    def _wrap(self, region, policy, forward, recompute, kept_calls):
        if threading.get_ident() != self._thread:
            return forward, recompute
        layer = self._current_layer()
        return (
            _PassScope(self, layer, "forward", forward, kept_calls, region),
            _PassScope(self, layer, "recompute", recompute, kept_calls, region),
        )

    def _pass_done(self, scope, audit, seconds: float) -> None:
        layer = self.layers.setdefault(scope._layer, Breakdown(scope._layer))
        layer.add_rows(AuditRow(*values) for values in zip(*audit.rows()))
        _add_seconds(layer, scope._phase, seconds)
        if scope._phase == "forward":
            layer.calls += 1
            layer.kept_calls += scope._kept_calls()
            region = scope._region
            kept = region.kept_tensors() if region.kept_calls else []
            # This region's own unique storages: exact per call whatever the allocator reuses.
            layer.kept_bytes += region.kept_bytes
            layer.offloaded_calls += region.offloaded_calls
            layer.offloaded_bytes += region.offloaded_bytes
            self._note_storages(scope._layer, kept)

    # --- units (called through _ReportObserver while a report runs) -----------------------------

    def unit_entered(self, unit: str):
        """Opens a count for `unit` inside the innermost pass.

        Args:
            unit: The recompute unit's name.

        Returns:
            The token `unit_exited` takes, or None outside a pass (nothing to count).
        """
        passes = _stack(self)
        if not passes:
            return None
        layer, phase, kept_calls, region, _, _ = passes[-1]
        scope = torch.autograd.profiler.record_function(f"sac_plugin.{phase}: {layer} unit {unit}")
        scope.__enter__()
        audit = _native.C.Counts()  # no scope: see _PassScope.__enter__
        return layer, phase, kept_calls, region, kept_calls(), region.kept_bytes, audit, scope, _clock()

    def unit_exited(self, unit: str, token) -> None:
        """Adds what ran in `unit` since `unit_entered` gave `token` to the unit's breakdown.

        Args:
            unit: The recompute unit's name, as given to `unit_entered`.
            token: What `unit_entered` returned for it (not None).
        """
        layer, phase, kept_calls, region, kept_before, bytes_before, audit, scope, started = token
        seconds = _clock() - started
        scope.__exit__(None, None, None)
        breakdown = self.units.setdefault((layer, unit), Breakdown(unit))
        breakdown.add_rows(AuditRow(*values) for values in zip(*audit.rows()))
        _add_seconds(breakdown, phase, seconds)
        if phase == "forward":
            breakdown.calls += 1
            breakdown.kept_calls += kept_calls() - kept_before
            # Unique storages the region holds, before and after: a storage shared with an
            # earlier kept output is billed to where it was first kept.
            breakdown.kept_bytes += region.kept_bytes - bytes_before

    # --- saved tensors -------------------------------------------------------------------------

    def _pack(self, tensor):
        # Only what autograd saves outside regions reaches this hook (checkpoint's own hooks take
        # the saves inside them). Noted, not held: the tensor's lifetime is unchanged.
        if threading.get_ident() != self._thread:
            return tensor
        where = f"{OUTSIDE} {self._name(self._modules[-1])}" if self._modules else OUTSIDE
        self._note_storages(where, [tensor])
        return tensor

    def _note_storages(self, where: str, tensors) -> int:
        """Notes each storage once per life; returns the bytes of those new to the report.

        NOTE: [Saved storages are counted per life, not per address]
        A storage freed after one step and allocated again at the same address in the next is a
        new storage: it counts again. One still alive (two tensors on it, or a kept output saved
        again) counts once. A weak reference to the storage object (torch keeps one Python object
        per live storage) says which: the entry goes when the storage dies, so the table of live
        storages is bounded by what is alive, and totals over n identical steps are n times one.
        """
        added = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in self._parameters or pointer == 0:
                continue
            device = str(tensor.device)
            live_key = (device, pointer)
            live = self._live.get(live_key)
            if live is not None and live[0]() is storage:
                entry = live[1]
                if len(entry.tensors) < _TENSORS_PER_STORAGE:
                    entry.tensors.append((tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))
                continue
            nbytes = storage.nbytes()
            key = (where, device, nbytes)
            entry = self._saved.get(key)
            if entry is None:
                entry = self._saved[key] = SavedStorage(where, device, nbytes, [], 0)
            entry.count += 1
            added += nbytes
            if len(entry.tensors) < _TENSORS_PER_STORAGE:
                entry.tensors.append((tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))
            forget = functools.partial(_forget, self._weak_self, live_key)
            self._live[live_key] = (weakref.ref(storage, forget), entry)
        return added

    # --- results -------------------------------------------------------------------------------

    def saved_tensors(self) -> list[SavedStorage]:
        """Storages saved for backward, each counted once per life, billed to where it was first saved.

        Returns:
            One SavedStorage per place, device and size (with how many such storages were saved
            while the report ran), largest total first.
        """
        return sorted(self._saved.values(), key=lambda s: (-s.nbytes * s.count, s.where))

    def saved_bytes_by_place(self) -> dict[str, int]:
        """Bytes saved for backward by place.

        Returns:
            The bytes by place (a checkpointed module, or outside regions by the module that saved
            them), largest first.
        """
        totals: dict[str, int] = {}
        for storage in self._saved.values():
            totals[storage.where] = totals.get(storage.where, 0) + storage.nbytes * storage.count
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def to_dict(self) -> dict:
        """The report as a JSON-ready dict.

        Returns:
            The layers with their units, the storages saved for backward, the steps, the offload
            copies, the op totals per phase and, when traced, the trace.
        """
        return _report_render.to_dict(self, traced=self._trace)

    def trace_table(self) -> str:
        """The per-op trace as text, one line per call in the order they ran.

        Forward calls are kept or recomputed; recompute calls are recomputed or served.

        Returns:
            The table.

        Raises:
            RuntimeError: The report was not asked for a trace (report(..., trace=True) or
                sac_plugin.trace()).
        """
        if not self._trace:
            raise RuntimeError(
                "sac_plugin: this report was not asked for a trace; use sac_plugin.report(model, "
                "trace=True) or sac_plugin.trace(model)"
            )
        return trace_table(self.trace)

    def to_json(self) -> str:
        """The report as JSON text.

        Returns:
            `to_dict()` as indented JSON, ending in a newline.
        """
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def table(self, storages: int = 10) -> str:
        """The report as text: a row per checkpointed module and unit (with its forward and
        recompute milliseconds), under each layer the ops whose kept outputs its recompute was
        served ("kept: addmm x2, tanh"), offload copies, bytes saved for backward by place, and the
        largest storages.

        Args:
            storages: How many of the largest saved storages to list.

        Returns:
            The table.
        """
        return _report_render.table(self, storages)

    def plot(self, path=None):
        """A chart of the layers: bytes held for backward per layer (kept on the device, with the
        offloaded bytes stacked on them), and recompute milliseconds per layer. Needs matplotlib
        (the `plot` extra).

        Args:
            path: Where to save the figure (str or os.PathLike; the format from its suffix), or
                None not to save it.

        Returns:
            The matplotlib Figure, two panels of one bar per layer.

        Raises:
            ModuleNotFoundError: matplotlib is not installed.
        """
        return _report_render.plot(self, path)


_OFFLOAD_COUNTERS = ("copies_to_host", "bytes_to_host", "copies_to_device", "bytes_to_device", "exposed_copy_us")


def _add_seconds(breakdown: Breakdown, phase: str, seconds: float) -> None:
    if phase == "forward":
        breakdown.forward_seconds += seconds
    else:
        breakdown.recompute_seconds += seconds


def _forget(report_reference: weakref.ref, live_key, storage_reference) -> None:
    """A storage a report noted died: its entry in the live table goes (NOTE: [Saved storages
    are counted per life, not per address])."""
    report = report_reference()
    live = report._live.get(live_key) if report is not None else None
    if live is not None and live[0] is storage_reference:
        del report._live[live_key]


def report(model: torch.nn.Module | None = None, *, trace: bool = False) -> Report:
    """A report of one or more steps run inside it; `model` names the checkpointed modules.

    Per checkpointed module and per unit inside it: calls, ops run in the forward and the
    recompute, kept outputs served, calls and bytes kept; and every storage saved for backward,
    counted once per life (`Report.steps` steps were run). Layers, units, saved storages and op
    counts are those of the thread that entered the report (NOTE: [Counts are their thread's]);
    reports nest, each counting the steps run inside it. trace=True also records every call in the
    checkpointed regions, in order (Report.trace, filled when the report exits;
    Report.trace_table(), "trace" in to_json()).

    Args:
        model: The model whose module names label the checkpointed layers (None: class names).
        trace: Also record the per-op trace.

    Returns:
        The report, to enter as a context manager.

    Raises:
        TypeError: model is not a module or None, or trace is not a bool.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"sac_plugin: report: model must be a torch.nn.Module or None, got {describe_value(model)}")
    if not isinstance(trace, bool):
        raise TypeError(f"sac_plugin: report: trace must be a bool, got {describe_value(trace)}")
    return Report(model, trace=trace)


def trace(model: torch.nn.Module | None = None) -> Report:
    """A report that also records the per-op trace.

    with sac_plugin.trace(model) as t: ...; print(t.trace_table()). Each entry: checkpointed
    layer, innermost module, unit, op, phase and kept / recomputed / served (torch_remat's
    collect_trace, per aten call).

    Args:
        model: The model whose module names label the checkpointed layers (None: class names).

    Returns:
        The report, to enter as a context manager.

    Raises:
        TypeError: model is not a module or None.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"sac_plugin: trace: model must be a torch.nn.Module or None, got {describe_value(model)}")
    return Report(model, trace=True)
