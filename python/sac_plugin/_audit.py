"""Op-count audits: how often each op ran in the forward, the recompute and the backward."""

from __future__ import annotations

import threading
from typing import NamedTuple


from . import _native, _observers
from ._validation import describe_value, op_spelling

__all__ = ["Audit", "AuditRow", "PHASES", "audit"]

PHASES = ("forward", "recompute", "backward")


class _RunningAudit(_observers.Observer):
    """A running audit, registered in the observer seam: a region that keeps nothing creates no
    plugin state unless something, such as an audit that wants its recompute counted as
    "recompute", is observing. Each audit registers once when it starts and unregisters once when
    it stops (or is dropped running), whatever exits are attempted."""


def any_active() -> bool:
    return any(isinstance(o, _RunningAudit) for o in _observers.observers())


class AuditRow(NamedTuple):
    """One op's counts in an audit.

    Attributes:
        op: The op overload, as the dispatcher names it ("aten::mm.default").
        forward: Its executions in the forward (checkpointed or not).
        recompute: Its executions in recomputes.
        backward: Its executions in the backward, recomputes left out.
        hits: Its kept outputs served to a recompute instead of running.
        never_served: Its kept (or offloaded) outputs held from the forward to the backward that
            the recompute never asked for, and freed unused: each is also named once per
            checkpoint site by a `HeldNeverServedWarning`.
        never_served_bytes: The bytes those outputs held.
        skipped: Its recompute calls given stand-in outputs instead of running, because nothing
            the backward needs reads them (docs/semantics.md, "The recompute runs only what
            backward needs").
    """

    op: str
    forward: int
    recompute: int
    backward: int
    hits: int
    never_served: int = 0
    never_served_bytes: int = 0
    skipped: int = 0


class Audit:
    """Counts every op executed while active, inside and outside checkpointed regions.

    ```python
    with sac_plugin.audit() as a:
        loss = model(x).sum(); loss.backward()
    a.count("aten::tanh")                     # executions, all phases
    a.count("aten::tanh", phase="recompute")  # executions in recompute
    a.hits("aten::tanh")                      # kept outputs served instead of running
    print(a.table())
    ```

    `sac_plugin.audit()` makes one; an audit is entered once.
    """

    def __init__(self):
        self._handle = None
        self._thread = None
        self._presence = None

    def __enter__(self):
        if self._handle is not None:
            raise RuntimeError("sac_plugin: an audit object can be entered once; create a new audit()")
        handle = _native.C.Audit()
        handle.start()
        self._handle, self._thread = handle, threading.get_ident()
        self._presence = _RunningAudit()
        _observers.register(self._presence)
        return self

    def __exit__(self, *exc_info):
        # Checked before anything changes (see NOTE: [Scopes are checked before they change
        # anything] in csrc/dispatch/region_scopes.h): a refused exit leaves the audit running and exitable.
        if self._handle is None or not self._handle.running():
            raise RuntimeError(
                "sac_plugin: exiting an audit that is not running (never entered, or already exited); nothing was changed"
            )
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "sac_plugin: exiting an audit on a thread that did not enter it; exit it on the thread that entered it "
                "(it is still running there, and nothing was changed)"
            )
        try:
            self._handle.stop()
        finally:
            self._uncount()
        return False

    def _uncount(self) -> None:
        if self._presence is not None and not self._handle.running():
            _observers.unregister(self._presence)
            self._presence = None

    def __del__(self):
        # Dropped while running: the C++ handle closes its scope when it is freed on the thread
        # that opened it; the registration must not stay either way.
        presence = getattr(self, "_presence", None)
        if presence is not None:
            self._presence = None
            _observers.unregister(presence)

    def rows(self) -> list[AuditRow]:
        """Every op the audit counted.

        Returns:
            One row per op overload.

        Raises:
            RuntimeError: The audit has not started.
        """
        if self._handle is None:
            raise RuntimeError("sac_plugin: the audit has not started; use it as `with audit() as a:`")
        return [AuditRow(*values) for values in zip(*self._handle.rows())]

    def _matching(self, op) -> list[AuditRow]:
        wanted = set(_native.C.overloads_of(op_spelling(op, "audit: op")))
        return [row for row in self.rows() if row.op in wanted]

    def count(self, op, phase: str | None = None) -> int:
        """How many times an op ran.

        Args:
            op: The op: a name ("aten::mm", every overload) or an overload ("aten::mm.default").
            phase: "forward", "recompute" or "backward"; None: all three.

        Returns:
            The executions counted.

        Raises:
            ValueError: `phase` is not one of the phases, or `op` names no registered op.
            RuntimeError: The audit has not started.
        """
        if phase is not None and (not isinstance(phase, str) or phase not in PHASES):
            raise ValueError(f"sac_plugin: phase must be one of {PHASES} or None, got {describe_value(phase)}")
        phases = PHASES if phase is None else (phase,)
        return sum(getattr(row, p) for row in self._matching(op) for p in phases)

    def hits(self, op) -> int:
        """How many kept outputs of an op were served to recomputes instead of it running.

        Args:
            op: The op: a name (every overload) or an overload.

        Returns:
            The hits counted.

        Raises:
            RuntimeError: The audit has not started.
        """
        return sum(row.hits for row in self._matching(op))

    def skipped(self, op=None) -> int:
        """How many recompute calls of an op were given stand-in outputs instead of running,
        because nothing the backward needs reads them (NOTE: [The recompute runs only what
        backward needs] in csrc/dispatch/dead_calls.cpp). A skipped call is not a recompute
        execution.

        Args:
            op: As for `never_served`.

        Returns:
            How many were skipped; the table's `skipped` column.

        Raises:
            RuntimeError: The audit has not started.
        """
        return self._total("skipped", op)

    def never_served(self, op=None) -> int:
        """How many kept (or offloaded) outputs were held for a recompute that never asked for
        them (NOTE: [Served, or named] in csrc/dispatch/kept_outputs.cpp).

        Args:
            op: The op: a name (every overload) or an overload; None: every op.

        Returns:
            The calls counted.

        Raises:
            RuntimeError: The audit has not started.
        """
        return self._total("never_served", op)

    def _total(self, column: str, op) -> int:
        rows = self.rows() if op is None else self._matching(op)
        return sum(getattr(row, column) for row in rows)

    def table(self) -> str:
        """The counts of every op, one line each.

        Returns:
            The table, as text.

        Raises:
            RuntimeError: The audit has not started.
        """
        if self._handle is None:
            raise RuntimeError("sac_plugin: the audit has not started; use it as `with audit() as a:`")
        return self._handle.table()


def audit() -> Audit:
    """A context manager that counts every op run while it is active on this thread, by phase
    (forward, recompute, backward), and the kept outputs served instead of running (hits). Another
    thread's calls are not counted, except those autograd runs on its device threads, which belong
    to whichever thread called backward() (NOTE: [Counts are their thread's]). Audits nest.

    ```python
    with sac_plugin.audit() as a:
        model(x).sum().backward()
    a.count("aten::mm", phase="recompute"); a.hits("aten::mm"); print(a.table())
    ```

    Returns:
        The audit, not yet started: use it in a `with` statement.
    """
    return Audit()
