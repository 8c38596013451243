"""matplotlib for the plots the package draws (Plan.plot, StepPlan.plot, Report.plot): imported
when a plot is drawn, never with the package, and named with the extra that installs it where it
is missing; and the finish every planner chart shares."""

from __future__ import annotations

import importlib
from pathlib import Path

__all__ = ["finish_chart", "import_matplotlib"]


def import_matplotlib(module: str, missing: str, *, error: type[ImportError] = ImportError, agg: bool = False):
    """matplotlib's `module` ("matplotlib.pyplot", "matplotlib.figure"); with `agg`, pyplot draws
    on the Agg backend (files, no display). Where matplotlib is not installed, `error(missing)`."""
    try:
        # Through the package: hiding it (sys.modules["matplotlib"] = None) hides its modules too.
        import matplotlib

        if agg:
            matplotlib.use("Agg")
        return importlib.import_module(module)
    except ImportError:
        raise error(missing, name="matplotlib") from None


def finish_chart(plt, fig, ax, path: Path, title: str) -> Path:
    """Titles, grids and labels a planner chart, writes it to `path` as a PNG and closes it."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
