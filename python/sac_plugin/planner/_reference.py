"""The hand-written policies a plan is compared with."""

from __future__ import annotations

__all__ = ["reference_policies"]


def reference_policies() -> dict:
    """The hand-written policies a plan is compared with (`Plan.plot`, the budget benchmark).

    Returns:
        Policies by name: the attention kept; the attention and every other matmul; the attention
        and every matmul.
    """
    from ..policy import Policy
    from ..targets import ATTENTION_OPS

    attention = ATTENTION_OPS.resolve()
    matmuls = ["aten::mm", "aten::addmm"]
    return {
        "attention kept": Policy(kept_ops=attention),
        "attention + every other mm": Policy(kept_ops=attention, every_nth_op={op: 2 for op in matmuls}),
        "attention + all mm": Policy(kept_ops=attention | set(matmuls)),
    }
