"""A Plan's chart (Plan.plot): its Pareto curve, two-way and with an offload model three-way,
the hand-written policies and the plan itself marked on it."""

from __future__ import annotations

from collections.abc import Mapping

from .._plot import finish_chart, import_matplotlib
from ..policy import Policy
from ._plan_file import path_of
from ._reference import reference_policies

__all__ = ["plot"]


def plot(plan, path, policies: Mapping[str, Policy] | None, title: str | None):
    """Plan.plot's chart (see there), written to `path`."""
    plt = import_matplotlib(
        "matplotlib.pyplot",
        "sac_plugin: Plan.plot needs matplotlib, which is not installed; install the extra: "
        "pip install 'sac_plugin[plot]' (or pip install matplotlib)",
        agg=True,
    )
    path = path_of(path, "Plan.plot")
    policies = reference_policies() if policies is None else policies
    base = plan.profile.no_checkpoint_bytes or 1
    points = plan.pareto()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if plan.offload is None:
        curves = [("held_bytes", "recompute_seconds", {}, "plan (Pareto curve)")]
    else:
        curves = [
            ("two_way_held_bytes", "two_way_overhead_seconds", {}, "keep or recompute"),
            ("held_bytes", "overhead_seconds", {"color": "C9"}, "keep, offload or recompute"),
        ]
    for held, seconds, style, label in curves:
        ax.step(
            [p[held] / base for p in points],
            [p[seconds] * 1e3 for p in points],
            where="post",
            marker=".",
            label=label,
            **style,
        )
    # Policies can land on one point (the units policy of a layer that opens no units keeps
    # what "attention kept" keeps): each gets its own hollow marker, the first ones largest and
    # drawn on top, so a marker under another still shows as a ring around it.
    markers = ["o", "s", "D", "^", "v", "P", "X", "*"]
    count = len(policies)
    for i, (name, policy) in enumerate(policies.items()):
        e = plan.evaluate(policy)
        seconds = e.get("overhead_seconds", e["recompute_seconds"])
        ax.scatter(
            [e["held_bytes"] / base],
            [seconds * 1e3],
            marker=markers[i % len(markers)],
            s=40 + 45 * (count - i),
            facecolors="none",
            edgecolors=f"C{i + 1}",
            linewidths=1.6,
            zorder=3 + count - i,
            label=name,
        )
    ax.scatter(
        [plan.held_bytes / base],
        [plan.overhead_seconds * 1e3],
        marker="x",
        s=70,
        color="black",
        zorder=4 + count,
        label=f"this plan (budget {plan.budget})",
    )
    ax.set_xlabel("activation bytes held / no checkpointing")
    ax.set_ylabel("recompute kernel time (ms)" if plan.offload is None else "recompute + exposed copy time (ms)")
    return finish_chart(plt, fig, ax, path, title or "sac_plugin memory-budget plan")
