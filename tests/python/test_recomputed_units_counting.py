"""Issue 10: a call inside a recomputed unit takes no every-nth or kept-calls index.

A forced recompute must not use up a keep slot: with every_nth_op={"aten::mm": 2} and a
recomputed router gate, the matmuls around the gate alternate as if the gate's matmul were not
there. torchtitan's selective AC counts its every-second matmul that way (it returns before
counting a forced-recompute matmul), and so does torch_policy_fn; before this rule the native
engine counted the gate's call and the alternation flipped after it.
"""

import sac_plugin
import torch
from sac_plugin import Policy, recompute_unit
from torch.utils.checkpoint import checkpoint


def _four_matmuls_around_a_gate(weights, gate_weight, x):
    h = torch.tanh(x @ weights[0])               # mm index 0: kept
    with recompute_unit("gate"):
        g = torch.tanh(h @ gate_weight)          # forced recompute: takes no index
    for w in weights[1:]:                        # mm indices 1 (recomputed), 2 (kept), 3 (recomputed)
        h = torch.tanh(h @ w)
    # mul saves both operands, so the recompute runs to the end and reaches every matmul.
    return h * g


def _run(policy):
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(4)]
    gate_weight = torch.randn(8, 8, requires_grad=True)
    reference = [w.detach().clone().requires_grad_() for w in [*weights, gate_weight]]
    x = torch.randn(4, 8)
    with sac_plugin.audit() as audit:
        out = checkpoint(_four_matmuls_around_a_gate, weights, gate_weight, x, use_reentrant=False,
                         context_fn=sac_plugin.context_fn(policy))
        out.sum().backward()
    _four_matmuls_around_a_gate(reference[:4], reference[4], x).sum().backward()
    for param, ref in zip([*weights, gate_weight], reference):
        assert torch.equal(param.grad, ref.grad)
    return audit


def test_every_nth_skips_calls_in_a_recomputed_unit():
    audit = _run(Policy(every_nth_op={"aten::mm": 2}, recomputed_units=["gate"]))
    # Counting the gate's call too would keep indices 0, 2 and 4 of five: the 1st, 3rd and 4th
    # non-gate matmuls (3 hits, 2 recomputed).
    assert audit.hits("aten::mm") == 2
    assert audit.count("aten::mm", phase="recompute") == 3  # the gate's, the 2nd and 4th
    assert audit.count("aten::mm", phase="forward") == 5


def test_kept_calls_skip_calls_in_a_recomputed_unit():
    # Index 1 is the second matmul outside the gate; counting the gate's call would make it the gate.
    audit = _run(Policy(kept_calls={"aten::mm.default": [1]}, recomputed_units=["gate"]))
    assert audit.hits("aten::mm") == 1
    assert audit.count("aten::mm", phase="recompute") == 4


def test_without_a_recomputed_unit_every_call_counts():
    audit = _run(Policy(every_nth_op={"aten::mm": 2}))
    assert audit.hits("aten::mm") == 3  # indices 0, 2, 4 of five, the gate's the second
    assert audit.count("aten::mm", phase="recompute") == 2
