"""What a Report counts, as values: each op's counts in a pass (OpCounts), each checkpointed module's
or unit's totals (Breakdown) and each storage saved for backward (SavedStorage), each with the
JSON form Report.to_dict gives it."""

from __future__ import annotations

import dataclasses

from ._audit import AuditRow

__all__ = ["Breakdown", "OpCounts", "SavedStorage"]


@dataclasses.dataclass
class OpCounts:
    forward: int = 0
    recompute: int = 0
    backward: int = 0
    hits: int = 0
    skipped: int = (
        0  # recompute calls nothing the backward needs reads (NOTE: [The recompute runs only what backward needs])
    )
    never_served: int = 0  # kept outputs held and never served (NOTE: [Served, or named])
    never_served_bytes: int = 0

    def add(self, row: AuditRow) -> None:
        self.forward += row.forward
        self.recompute += row.recompute
        self.backward += row.backward
        self.hits += row.hits
        self.skipped += row.skipped
        self.never_served += row.never_served
        self.never_served_bytes += row.never_served_bytes


@dataclasses.dataclass
class Breakdown:
    """One checkpointed module, or one unit inside it."""

    name: str
    calls: int = 0  # forwards (for a unit: openings in the forward)
    kept_calls: int = 0  # calls whose outputs were held, kept or offloaded
    kept_bytes: int = 0  # held on the device
    offloaded_calls: int = 0
    offloaded_bytes: int = 0  # held in pinned host memory
    forward_seconds: float = 0.0  # wall time in the forward passes (NOTE: [Pass times])
    recompute_seconds: float = 0.0  # wall time in the recompute passes
    ops: dict[str, OpCounts] = dataclasses.field(default_factory=dict)

    def add_rows(self, rows) -> None:
        for row in rows:
            self.ops.setdefault(row.op, OpCounts()).add(row)

    def total(self, field: str) -> int:
        return sum(getattr(counts, field) for counts in self.ops.values())

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "calls": self.calls,
            "forward_ops": self.total("forward"),
            "recomputed_ops": self.total("recompute"),
            "hits": self.total("hits"),
            "skipped": self.total("skipped"),
            "never_served": self.total("never_served"),
            "never_served_bytes": self.total("never_served_bytes"),
            "kept_calls": self.kept_calls,
            "kept_bytes": self.kept_bytes,
            "offloaded_calls": self.offloaded_calls,
            "offloaded_bytes": self.offloaded_bytes,
            "forward_seconds": self.forward_seconds,
            "recompute_seconds": self.recompute_seconds,
            "ops": {op: dataclasses.asdict(c) for op, c in sorted(self.ops.items())},
        }


@dataclasses.dataclass
class SavedStorage:
    """One storage held for backward: where it was saved, its bytes, the tensors that view it."""

    where: str  # a checkpointed module (kept outputs) or "(outside regions) <module>"
    device: str
    nbytes: int  # bytes of one such storage
    tensors: list[tuple[tuple[int, ...], str]]  # (shape, dtype) of the tensors saved on it (the first few)
    count: int = 1  # storages like it (same place, device and size) saved while the report ran

    def to_dict(self) -> dict:
        return {
            "where": self.where,
            "device": self.device,
            "bytes": self.nbytes,
            "count": self.count,
            "tensors": [{"shape": list(shape), "dtype": dtype} for shape, dtype in self.tensors],
        }
