"""Op-count audits: how often each op ran in the forward, the recompute and the backward."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .policy import op_spelling

PHASES = ("forward", "recompute", "backward")


# Audits running in this process, on any thread. A region that keeps nothing creates no plugin
# state unless an audit wants its recompute counted as "recompute".
_active_audits = 0


def any_active() -> bool:
    return _active_audits > 0


class AuditRow(NamedTuple):
    op: str
    forward: int
    recompute: int
    backward: int
    hits: int


class Audit:
    """Counts every op executed while active, inside and outside checkpointed regions.

    with sac_plugin.audit() as a:
        loss = model(x).sum(); loss.backward()
    a.count("aten::tanh")                     # executions, all phases
    a.count("aten::tanh", phase="recompute")  # executions in recompute
    a.hits("aten::tanh")                      # kept outputs served instead of running
    print(a.table())
    """

    def __init__(self):
        self._handle = None

    def __enter__(self):
        if self._handle is not None:
            raise RuntimeError("sac_plugin: an audit object can be entered once; create a new audit()")
        global _active_audits
        self._handle = torch.classes.sac.Audit()
        self._handle.start()
        _active_audits += 1
        return self

    def __exit__(self, *exc_info):
        global _active_audits
        _active_audits -= 1
        self._handle.stop()
        return False

    def rows(self) -> list[AuditRow]:
        if self._handle is None:
            raise RuntimeError("sac_plugin: the audit has not started; use it as `with audit() as a:`")
        names, forward, recompute, backward, hits = self._handle.rows()
        return [AuditRow(*values) for values in zip(names, forward, recompute, backward, hits)]

    def _matching(self, op) -> list[AuditRow]:
        wanted = set(torch.ops.sac.overloads_of(op_spelling(op)))
        return [row for row in self.rows() if row.op in wanted]

    def count(self, op, phase: str | None = None) -> int:
        if phase is not None and phase not in PHASES:
            raise ValueError(f"sac_plugin: phase must be one of {PHASES} or None, got {phase!r}")
        phases = PHASES if phase is None else (phase,)
        return sum(getattr(row, p) for row in self._matching(op) for p in phases)

    def hits(self, op) -> int:
        return sum(row.hits for row in self._matching(op))

    def table(self) -> str:
        if self._handle is None:
            raise RuntimeError("sac_plugin: the audit has not started; use it as `with audit() as a:`")
        return self._handle.table()


def audit() -> Audit:
    return Audit()
