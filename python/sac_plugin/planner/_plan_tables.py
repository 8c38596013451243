"""A Plan as text: its rows by op and unit, its rows call by call, its table and its Pareto curve
(Plan.rows, Plan.call_rows, Plan.table and Plan.curve, whose docstrings say what each holds)."""

from __future__ import annotations

from ._cost import call_key

__all__ = ["call_rows", "curve", "rows", "table"]


def rows(plan) -> list[dict]:
    """What Plan.rows returns (see there)."""
    groups: dict[tuple[str, str], dict] = {}
    for c in plan.profile.calls:
        row = groups.setdefault(
            (c.op, c.unit),
            {
                "op": c.op,
                "unit": c.unit,
                "calls": 0,
                "kept": 0,
                "offloaded": 0,
                "bytes": 0,
                "kept_bytes": 0,
                "seconds": 0.0,
                "saved_seconds": 0.0,
                "not_keepable": c.why_not_keepable,
            },
        )
        kept = call_key(c) in plan.kept
        row["calls"] += 1
        row["bytes"] += c.bytes
        row["seconds"] += c.seconds
        row["kept"] += kept
        row["offloaded"] += call_key(c) in plan.offloaded
        row["kept_bytes"] += c.bytes if kept else 0
        row["saved_seconds"] += c.seconds if kept else 0.0
    return sorted(groups.values(), key=lambda r: (-r["seconds"], r["op"], r["unit"]))


def call_rows(plan) -> list[dict]:
    """What Plan.call_rows returns (see there)."""
    rows = []
    for c in plan.profile.calls:
        if not (c.keepable and c.bytes > 0):
            continue
        why = plan.offload.why_not_offloadable(c) if plan.offload is not None else "no offload model"
        rows.append(
            {
                "op": c.op,
                "index": c.index,
                "unit": c.unit,
                "bytes": c.bytes,
                "seconds": c.seconds,
                "outcome": plan.outcome(c),
                "copy": plan.copies.get(call_key(c)),
                "not_offloadable": why,
            }
        )
    return rows


def table(plan) -> str:
    """What Plan.table returns (see there)."""
    mib = 2**20
    rows, call_rows = plan.rows(), plan.call_rows() if plan.offload is not None else []
    # Columns as wide as their longest name, so that no name runs into the next column.
    op_width = max([48, *(len(r["op"]) + 2 for r in rows), *(len(f"{r['op']} #{r['index']}") + 2 for r in call_rows)])
    unit_width = max([14, *(len(r["unit"] or "-") + 2 for r in [*rows, *call_rows])])
    lines = [
        repr(plan),
        f"{'op':<{op_width}}{'unit':<{unit_width}}{'calls':>6}{'kept':>6}{'MiB':>9}{'kept MiB':>10}"
        f"{'ms':>9}{'saved ms':>10}  not keepable",
    ]
    for r in rows:
        lines.append(
            f"{r['op']:<{op_width}}{r['unit'] or '-':<{unit_width}}{r['calls']:>6}{r['kept']:>6}"
            f"{r['bytes'] / mib:>9.3f}{r['kept_bytes'] / mib:>10.3f}{r['seconds'] * 1e3:>9.3f}"
            f"{r['saved_seconds'] * 1e3:>10.3f}  {r['not_keepable']}"
        )
    if plan.offload is None:
        return "\n".join(lines)
    lines += [
        "",
        f"per call (copies: {plan.offload.d2h_bytes_per_s / 1e9:.3f} GB/s to the host, "
        f"{plan.offload.h2d_bytes_per_s / 1e9:.3f} GB/s back; each alone, hidden behind the forward's kernel time "
        "after it and the recompute's before it)",
        f"{'call':<{op_width}}{'unit':<{unit_width}}{'MiB':>9}{'ms':>9}  {'outcome':<10}{'d2h ms':>9}{'h2d ms':>9}"
        f"{'window ms':>11}{'back win ms':>12}{'exposed ms':>12}  hides",
    ]
    for r in call_rows:
        copy = r["copy"]
        if copy is None:
            copies = f"{'-':>9}{'-':>9}{'-':>11}{'-':>12}{'-':>12}  - ({r['not_offloadable']})"
        else:
            copies = (
                f"{copy.to_host * 1e3:>9.3f}{copy.to_device * 1e3:>9.3f}{copy.forward_window * 1e3:>11.3f}"
                f"{copy.backward_window * 1e3:>12.3f}"
                f"{copy.exposed * 1e3:>12.3f}  {'yes' if copy.hides else 'no'}"
            )
        lines.append(
            f"{r['op'] + ' #' + str(r['index']):<{op_width}}{r['unit'] or '-':<{unit_width}}{r['bytes'] / mib:>9.3f}"
            f"{r['seconds'] * 1e3:>9.3f}  {r['outcome']:<10}{copies}"
        )
    return "\n".join(lines)


def curve(plan) -> str:
    """What Plan.curve returns (see there)."""
    base = plan.profile.no_checkpoint_bytes or 1
    header = f"{'budget':>7}{'held MiB':>10}{'held/none':>10}{'kept calls':>11}{'recompute ms':>14}"
    if plan.offload is not None:
        header += f"{'offloaded':>10}{'host MiB':>10}{'copy ms':>9}{'total ms':>10}{'2-way ms':>10}"
    lines = [header]
    for p in plan.pareto():
        line = (
            f"{p['budget']:>7.2f}{p['held_bytes'] / 2**20:>10.3f}{p['held_bytes'] / base:>10.3f}"
            f"{p['kept_calls']:>11}{p['recompute_seconds'] * 1e3:>14.3f}"
        )
        if plan.offload is not None:
            line += (
                f"{p['offloaded_calls']:>10}{p['offloaded_bytes'] / 2**20:>10.3f}"
                f"{p['copy_seconds'] * 1e3:>9.3f}{p['overhead_seconds'] * 1e3:>10.3f}"
                f"{p['two_way_overhead_seconds'] * 1e3:>10.3f}"
            )
        lines.append(line)
    return "\n".join(lines)
