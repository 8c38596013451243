"""The per-op trace a report records on request: every call in the checkpointed regions, in the
order it ran, with the layer and module it belongs to, its unit, its pass and what became of it.

The fallback records each call's op, phase, unit and outcome in a C++ call trace installed on the
thread of each region pass (NOTE: [The per-op trace is recorded below Python]); the report marks
each position of the trace where its pass or innermost module changes, and the entries are joined
from the two when the report exits.
"""

from __future__ import annotations

import dataclasses


from . import _engine, _native


@dataclasses.dataclass(frozen=True)
class TraceEntry:
    """One intercepted call inside a checkpointed region, in the order the calls ran.

    Attributes:
        layer: The checkpointed module (its qualified name in the report's model).
        module: The innermost module being called (qualified name; "" outside any module).
        unit: The innermost open recompute unit ("" for none).
        op: The overload, as "aten::mm.default".
        phase: "forward" or "recompute".
        status: In the forward, "kept" (kept or offloaded) or "recomputed"; in the recompute,
            "recomputed", "served" or "skipped" (NOTE: [The recompute runs only what backward
            needs] in csrc/dispatch/dead_calls.cpp).
    """

    layer: str
    module: str
    unit: str
    op: str
    phase: str
    status: str


def check_trace_supported() -> None:
    if _engine.engine() != "native":
        raise RuntimeError(
            "sac_plugin: the per-op trace reads the native engine's regions; this process runs the "
            "dispatch-mode engine (SAC_PLUGIN_ENGINE=dispatch_mode), whose kept outputs are served by "
            "torch's SAC mode before the trace could see the call. Unset SAC_PLUGIN_ENGINE to trace"
        )


# The fallback's outcomes as TraceEntry statuses: an offloaded call is held like a kept one.
_STATUS = {"kept": "kept", "offloaded": "kept", "recomputed": "recomputed", "served": "served", "skipped": "skipped"}


class CallTrace:
    """One report's C++ call trace and the marks that say which layer and module its calls from
    each position on belong to."""

    __slots__ = ("_native", "_marks")

    def __init__(self):
        self._native = _native.C.CallTrace()
        self._marks: list[tuple[int, str, str]] = []

    def install(self) -> None:
        """Records this thread's calls from now on (a region pass begins)."""
        self._native.install()

    def uninstall(self) -> None:
        self._native.uninstall()

    def mark(self, layer: str, module: str) -> None:
        """The calls traced from now on belong to `layer` and `module` ("" for none)."""
        self._marks.append((self._native.size(), layer, module))

    def entries(self) -> list[TraceEntry]:
        """Every traced call, each with the layer and module of the last mark at or before it."""
        ops, phases, outcomes, units = self._native.rows()
        marks, entries, m = self._marks, [], -1
        for i, (op, phase, outcome, unit) in enumerate(zip(ops, phases, outcomes, units)):
            while m + 1 < len(marks) and marks[m + 1][0] <= i:
                m += 1
            _, layer, module = marks[m] if m >= 0 else (0, "", "")
            entries.append(
                TraceEntry(layer, module, unit, op if "." in op else f"{op}.default", phase, _STATUS[outcome])
            )
        return entries


def trace_table(entries: list[TraceEntry]) -> str:
    """The entries one line per call, in the order they ran, under a header."""
    width = max([len("module")] + [len(e.module) for e in entries])
    unit_width = max([len("unit")] + [len(e.unit) for e in entries])
    layer_width = max([5] + [len(e.layer) for e in entries])
    header = (
        f"{'#':>5}  {'layer':<{layer_width}}  {'module':<{width}}  {'unit':<{unit_width}}  "
        f"{'phase':<9}  {'status':<10}  op"
    )
    lines = [header, "-" * len(header)]
    for i, e in enumerate(entries):
        lines.append(
            f"{i:>5}  {e.layer:<{layer_width}}  {e.module or '-':<{width}}  {e.unit or '-':<{unit_width}}  "
            f"{e.phase:<9}  {e.status:<10}  {e.op}"
        )
    return "\n".join(lines)
