"""Both engines match kept calls by data flow and demote kept outputs the forward writes: a call
made in one pass only, or a `.data` write into a kept output, never changes what is served. Each
case runs in a fresh process per engine (the engine is chosen at import), compares loss and
gradients bitwise with the unmodified model there, and reports its audit counts, which must be
the same exact counts in both engines."""

import json
import os
import subprocess
import sys

import pytest
import sac_plugin
import torch
from sac_plugin import Policy
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("native", "dispatch_mode")
OPS = ("aten::mm", "aten::mul_.Tensor", "aten::copy_", "aten::tanh")


def _counts(audit) -> dict:
    return {op: [audit.count(op, phase="forward"), audit.count(op, phase="recompute"), audit.hits(op)] for op in OPS}


def _lazy_cache_steps(policy: Policy) -> list:
    from test_data_flow import train_pair

    return [_counts(audit) for audit in train_pair(policy, steps=2)]


class DataWrite(nn.Module):
    """Writes its kept matmul's output through `.data` in the forward."""

    def __init__(self, write: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.write = write

    def forward(self, x):
        y = x @ self.w
        if self.write == "mul_":
            y.data.mul_(2)
        else:
            y.data.copy_(torch.full_like(y, 0.5))
        return torch.tanh(y)


def _data_write_steps(write: str) -> list:
    torch.manual_seed(0)
    model = DataWrite(write)
    reference = DataWrite(write)
    reference.load_state_dict(model.state_dict())
    sac_plugin.apply_selective_checkpointing(model, Policy(kept_ops=["aten::mm"]))
    x = torch.randn(4, 8)
    with sac_plugin.audit() as audit:
        loss = model(x).pow(2).sum()
        loss.backward()
    expected = reference(x).pow(2).sum()
    expected.backward()
    assert torch.equal(loss, expected), "loss differs"
    difference = (model.w.grad - reference.w.grad).abs().max().item()
    assert torch.equal(model.w.grad, reference.w.grad), f"gradient of w differs by {difference}"
    return [_counts(audit)]


CASES = {
    "kept_calls": lambda: _lazy_cache_steps(Policy(kept_calls={"aten::mm.default": [1]})),
    "every_nth_op": lambda: _lazy_cache_steps(Policy(every_nth_op={"aten::mm": 2})),
    "data_mul_": lambda: _data_write_steps("mul_"),
    "data_copy_": lambda: _data_write_steps("copy_"),
}

# [forward, recompute, hits] per op, per step. The lazy cache adds an mm to step 1's forward
# only; the kept call is served to its own twin in the recompute, the other mm recomputed. A
# `.data` write demotes the kept mm: it runs again in the recompute, and so does the write.
EXPECTED = {
    "kept_calls": [
        {"aten::mm": [3, 1, 1], "aten::mul_.Tensor": [0, 0, 0], "aten::copy_": [0, 0, 0], "aten::tanh": [1, 1, 0]},
        {"aten::mm": [2, 1, 1], "aten::mul_.Tensor": [0, 0, 0], "aten::copy_": [0, 0, 0], "aten::tanh": [1, 1, 0]},
    ],
    "every_nth_op": [
        {"aten::mm": [3, 1, 1], "aten::mul_.Tensor": [0, 0, 0], "aten::copy_": [0, 0, 0], "aten::tanh": [1, 1, 0]},
        {"aten::mm": [2, 1, 1], "aten::mul_.Tensor": [0, 0, 0], "aten::copy_": [0, 0, 0], "aten::tanh": [1, 1, 0]},
    ],
    "data_mul_": [
        {"aten::mm": [1, 1, 0], "aten::mul_.Tensor": [1, 1, 0], "aten::copy_": [0, 0, 0], "aten::tanh": [1, 1, 0]},
    ],
    "data_copy_": [
        {"aten::mm": [1, 1, 0], "aten::mul_.Tensor": [0, 0, 0], "aten::copy_": [1, 1, 0], "aten::tanh": [1, 1, 0]},
    ],
}


def _run_case(case: str, engine: str) -> list:
    """The case's counts in `engine`: in this process when it runs that engine, else in a fresh one."""
    if sac_plugin.engine() == engine:
        return CASES[case]()
    code = (
        "import json, sys, test_dispatch_mode_data_flow as t, sac_plugin; "
        f"assert sac_plugin.engine() == {engine!r}, sac_plugin.engine(); "
        f"print(json.dumps(t.CASES[{case!r}]()))"
    )
    environment = {k: v for k, v in os.environ.items() if k != "SAC_PLUGIN_ENGINE"}
    environment["SAC_PLUGIN_ENGINE"] = engine
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment, cwd=HERE
    )
    assert done.returncode == 0, f"{case} in the {engine} engine failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", list(CASES))
def test_served_calls_and_gradients_match_the_unmodified_model(case, engine):
    assert _run_case(case, engine) == EXPECTED[case]


def test_a_kept_output_mutated_after_the_forward_is_refused_in_the_dispatch_mode_engine():
    code = """
import torch, sac_plugin
from sac_plugin import Policy
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
w = torch.randn(8, 8, requires_grad=True)
x = torch.randn(4, 8)
kept = []
def body(weight, v):
    y = v @ weight
    kept.append(y)
    return torch.tanh(y)
out = checkpoint(body, w, x, use_reentrant=False, context_fn=sac_plugin.context_fn(Policy(kept_ops=["aten::mm"])))
with torch.no_grad():
    kept[0].add_(1)
try:
    out.sum().backward()
except RuntimeError as error:
    print(str(error).splitlines()[0])
"""
    environment = {k: v for k, v in os.environ.items() if k != "SAC_PLUGIN_ENGINE"}
    environment["SAC_PLUGIN_ENGINE"] = "dispatch_mode"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == (
        "sac: a tensor kept for backward was mutated after it was saved: the output of aten::mm (kept by the op "
        "list), call 1 of this region, changed version from 0 to 1. The recompute would read the mutated value; "
        "clone it before mutating in place, or do not keep aten::mm"
    )
