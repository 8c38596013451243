"""A report's JSON form, text table and chart (sac_plugin.Report.to_dict, Report.table,
Report.plot): rendering only, apart from the collection in sac_plugin._report. Reads a report's
layers, units, saved storages, steps, totals and offload copies; imports nothing of the report's
(so the collection is free to change how it counts)."""

from __future__ import annotations

import dataclasses
import os

from ._audit import PHASES
from ._plot import import_matplotlib

__all__ = ["kept_summary", "plot", "table", "to_dict"]

# The widest the "kept:" line under a layer row lists ops before it ends in "...".
_KEPT_SUMMARY_CHARS = 40


def to_dict(report, *, traced: bool) -> dict:
    """The dict of `Report.to_dict` (see there); the trace's entries where the report was `traced`."""
    return {
        "layers": [
            dict(
                layer.to_dict(),
                units=[unit.to_dict() for (name, _), unit in sorted(report.units.items()) if name == layer.name],
            )
            for layer in report.layers.values()
        ],
        "saved_for_backward": {
            "bytes_by_place": report.saved_bytes_by_place(),
            "storages": [s.to_dict() for s in report.saved_tensors()],
        },
        "steps": report.steps,
        "offload_copies": dict(report.offload_copies),
        "totals": {phase: sum(getattr(row, phase) for row in report.totals) for phase in (*PHASES, "hits")},
        **({"trace": [dataclasses.asdict(entry) for entry in report.trace]} if traced else {}),
    }


def table(report, storages: int) -> str:
    """The text of `Report.table` (see there)."""
    layers = list(report.layers.values())
    header = (
        f"{'checkpointed module / unit':<40}{'calls':>7}{'fwd ops':>9}{'recomputed':>12}{'hits':>7}"
        f"{'kept calls':>12}{'kept bytes':>14}{'fwd ms':>10}{'recompute ms':>14}{'never served':>14}"
    )
    lines = [header, "-" * len(header)]
    for layer in layers:
        lines.append(_line(layer.name, layer))
        kept = kept_summary(layer)
        if kept:
            lines.append(f"    kept: {kept}")
        for (name, _), unit in sorted(report.units.items()):
            if name == layer.name:
                lines.append(_line(f"  unit {unit.name}", unit))
    lines.append(
        f"{'all layers':<40}{sum(layer.calls for layer in layers):>7}"
        f"{sum(layer.total('forward') for layer in layers):>9}"
        f"{sum(layer.total('recompute') for layer in layers):>12}"
        f"{sum(layer.total('hits') for layer in layers):>7}"
        f"{sum(layer.kept_calls for layer in layers):>12}"
        f"{_bytes(sum(layer.kept_bytes for layer in layers)):>14}"
        f"{sum(layer.forward_seconds for layer in layers) * 1e3:>10.2f}"
        f"{sum(layer.recompute_seconds for layer in layers) * 1e3:>14.2f}"
        f"{sum(layer.total('never_served') for layer in layers):>14}"
    )
    steps = f" over {report.steps} steps" if report.steps > 1 else ""
    offloaded = sum(layer.offloaded_calls for layer in layers)
    if offloaded or report.offload_copies["copies_to_host"]:
        copies = report.offload_copies
        lines += [
            "",
            f"offloaded{steps}: {offloaded} calls holding "
            f"{_bytes(sum(layer.offloaded_bytes for layer in layers))} of pinned host memory "
            f"(not in kept bytes); {copies['copies_to_host']} copies to the host "
            f"({_bytes(copies['bytes_to_host'])}), {copies['copies_to_device']} back "
            f"({_bytes(copies['bytes_to_device'])}); compute waited {copies['exposed_copy_us'] / 1e3:.1f} ms "
            "for copies back",
        ]
    saved = report.saved_tensors()
    lines += ["", f"saved for backward{steps}, by place (each storage once per life):"]
    for place, nbytes in report.saved_bytes_by_place().items():
        lines.append(f"  {place:<58}{_bytes(nbytes):>14}")
    lines.append(f"  {'total':<58}{_bytes(sum(s.nbytes * s.count for s in saved)):>14}")
    biggest = saved[:storages]
    if biggest:
        lines += ["", f"largest storages saved for backward (of {sum(s.count for s in saved)}):"]
        for storage in biggest:
            views = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in storage.tensors[:3])
            more = f" +{len(storage.tensors) - 3}" if len(storage.tensors) > 3 else ""
            count = f" x{storage.count}" if storage.count > 1 else ""
            lines.append(
                f"  {_bytes(storage.nbytes):>12}{count:<6} {storage.device:<6} {storage.where:<40} {views}{more}"
            )
    return "\n".join(lines)


def kept_summary(breakdown) -> str:
    """The ops whose kept outputs the recompute was served, most served first, e.g. "addmm x2,
    tanh" ("aten::" and the overload dropped; a count only past one); ops that no longer fit in
    ~40 characters end it in "...". Empty when nothing was served."""
    served: dict[str, int] = {}
    for op, counts in breakdown.ops.items():
        if counts.hits:
            name = op.removeprefix("aten::").split(".")[0]
            served[name] = served.get(name, 0) + counts.hits
    items = [
        f"{name} x{hits}" if hits > 1 else name for name, hits in sorted(served.items(), key=lambda i: (-i[1], i[0]))
    ]
    text = ""
    for index, item in enumerate(items):
        joined = f"{text}, {item}" if text else item
        last = index == len(items) - 1
        if len(joined) > _KEPT_SUMMARY_CHARS or (not last and len(joined) + len(", ...") > _KEPT_SUMMARY_CHARS):
            return f"{text}, ..." if text else "..."
        text = joined
    return text


def plot(report, path):
    """The figure of `Report.plot` (see there)."""
    figures = import_matplotlib(
        "matplotlib.figure",
        "sac_plugin: Report.plot draws with matplotlib, which is not installed: pip install sac_plugin[plot]",
        error=ModuleNotFoundError,
    )
    layers = list(report.layers.values())
    names = [layer.name for layer in layers]
    kept = [layer.kept_bytes / 2**20 for layer in layers]
    offloaded = [layer.offloaded_bytes / 2**20 for layer in layers]
    figure = figures.Figure(figsize=(max(6.4, 0.5 * len(layers) + 2), 6.4), layout="constrained")
    held_axes, time_axes = figure.subplots(2, 1, sharex=True)
    held_axes.bar(names, kept, label="kept (device)")
    held_axes.bar(names, offloaded, bottom=kept, label="offloaded (pinned host)")
    held_axes.set_ylabel("held for backward (MiB)")
    held_axes.legend()
    time_axes.bar(names, [layer.recompute_seconds * 1e3 for layer in layers], color="C2")
    time_axes.set_ylabel("recompute (ms)")
    time_axes.set_xlabel("checkpointed module")
    time_axes.tick_params(axis="x", labelrotation=90)
    if path is not None:
        figure.savefig(os.fspath(path))
    return figure


def _line(label: str, row) -> str:
    return (
        f"{label[:40]:<40}{row.calls:>7}{row.total('forward'):>9}{row.total('recompute'):>12}"
        f"{row.total('hits'):>7}{row.kept_calls:>12}{_bytes(row.kept_bytes):>14}"
        f"{row.forward_seconds * 1e3:>10.2f}{row.recompute_seconds * 1e3:>14.2f}{row.total('never_served'):>14}"
    )


def _bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"
