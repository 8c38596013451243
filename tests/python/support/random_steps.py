"""Random small models for property tests: a model is a list of steps (an op, and the units open
around it) over a few square weights; hypothesis draws the steps.

SAC_PROPERTY_EXAMPLES=N runs N examples per property instead of each property's default.
"""

import contextlib
import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, settings  # the `test` extra installs it
from hypothesis import strategies as st
from sac_plugin import recompute_unit

EXAMPLES = int(os.environ.get("SAC_PROPERTY_EXAMPLES", "0")) or None
DIM = 8


def examples(default: int, shrink: bool = True) -> settings:
    return settings(
        max_examples=EXAMPLES or default,
        phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else []),
        deadline=None,
        database=None,  # no .hypothesis directory in the checkout
        derandomize=EXAMPLES is None,  # the normal run is reproducible; SAC_PROPERTY_EXAMPLES explores
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# --- random models ---------------------------------------------------------------------------------

OPS = ["mm", "addmm", "tanh", "sin", "mul", "add", "sigmoid", "dropout", "softmax", "view", "inplace"]
UNITS = [(), ("attn",), ("mlp",), ("attn", "rope")]


def apply_op(op: str, h: torch.Tensor, weights, index: int, dropout: bool) -> torch.Tensor:
    w, b = weights[index % len(weights)], weights[(index + 1) % len(weights)]
    if op == "mm":
        return h @ w
    if op == "addmm":
        return torch.addmm(b[0], h, w)
    if op == "tanh":
        return torch.tanh(h)
    if op == "sin":
        return torch.sin(h)
    if op == "mul":
        return h * w[0]
    if op == "add":
        return h + w[1]
    if op == "sigmoid":
        return torch.sigmoid(h)
    if op == "dropout":
        return F.dropout(h, p=0.25, training=dropout)
    if op == "softmax":
        return torch.softmax(h, dim=-1)
    if op == "inplace":
        h = h * 1.0  # a fresh tensor nothing saved, so the in-place write is legal
        return h.mul_(0.5).add_(w[2])
    if op == "view":
        return h.view(-1, DIM // 2).t().contiguous().t().reshape(-1, DIM)
    raise AssertionError(op)


def run_steps(steps, h, weights, dropout):
    for i, (op, units) in enumerate(steps):
        with contextlib.ExitStack() as stack:
            for unit in units:
                stack.enter_context(recompute_unit(unit))
            h = apply_op(op, h, weights, i, dropout)
    return h


steps_strategy = st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(UNITS)), min_size=1, max_size=10)
