"""One layer that makes a call of every kind the keep rule tells apart, and the grid of policies
every front door of the rule is asked about; and one layer whose calls depend on whether a Python
dispatch mode is on, with the policies that keep its mm.

layer_and_input() looks the layer's class up when it runs, so a test may monkeypatch
EveryKindOfCall here.
"""

import sac_plugin
import torch
import torch.nn.functional as F
from sac_plugin import Policy, recompute_unit
from torch import nn

ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


class EveryKindOfCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        a = torch.mm(x, self.weight)  # mm 0, outside units
        with recompute_unit("attn"):
            b = torch.mm(a, self.weight).tanh()  # mm 1 and tanh, in a kept unit
            flat = b.view(-1)  # a view in a kept unit
            c = b.clone()
            c.add_(1)  # an in-place write in a kept unit
            e = torch.empty_like(b)  # an uninitialised allocation
            e.copy_(b)
            q = b.view(1, 1, 8, 8)
            s = F.scaled_dot_product_attention(q, q, q).view(8, 8)
            d = F.dropout(b, 0.25, training=True)  # a random call
        with recompute_unit("gate"):
            g = torch.mm(b, self.weight)  # mm 2, in a recomputed unit
        w = self.weight.to(torch.float64).to(torch.float32)  # a parameter cast
        h = torch.mm(g + c + e + s + d, w)  # mm 3
        return (h.sin() + flat.sum()).sum()


POLICIES = {
    "kept ops": Policy(kept_ops=["aten::mm", "aten::tanh"]),
    "every other mm": Policy(every_nth_op={"aten::mm": 2}),
    "kept calls": Policy(kept_calls={"aten::mm.default": [1, 3]}),
    "kept unit": Policy(kept_units=["attn"]),
    "kept unit, recomputed unit, every nth": Policy(
        kept_units=["attn"], recomputed_units=["gate"], every_nth_op={"aten::mm": 2}
    ),
    "a cast and attention named": Policy(kept_ops=["aten::_to_copy", ATTENTION, "aten::clone"]),
    "the recomputed unit kept": Policy(kept_units=["gate"], kept_ops=["aten::add.Tensor"]),
    # On the CPU an offloaded call is held as a kept one (compile: MUST_SAVE), so it is "kept" here.
    "offloaded unit, kept and offloaded calls": Policy(
        offloaded_units=["attn"],
        kept_calls={"aten::mm.default": [0]},
        offloaded_calls={"aten::mm.default": [3]},
        offload_min_bytes=0,
    ),
}


class LinearOnATransposedInput(nn.Module):
    """F.linear on a non-contiguous 3-D input: without a Python dispatch mode torch adds the bias
    in place into the mm's output, under any mode (the dispatch-mode engine's, a trace's
    compiled-policy run) out of place. Either way the kept mm is served (NOTE: [Kept outputs
    written in the forward])."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x.transpose(0, 1))).sin().sum()


LINEAR_POLICIES = {
    "kept mm": Policy(kept_ops=["aten::mm"]),
    "kept mm call": Policy(kept_calls={"aten::mm.default": [0]}),
    "offloaded mm": Policy(offloaded_ops=["aten::mm"], offload_min_bytes=0),
}


def linear_layer_and_input():
    """A fresh LinearOnATransposedInput and its input, from the same seed every time."""
    torch.manual_seed(0)
    return LinearOnATransposedInput(), torch.randn(4, 3, 8, requires_grad=True)


def layer_and_input():
    """A fresh EveryKindOfCall and its input, from the same seed every time."""
    torch.manual_seed(0)
    return EveryKindOfCall(), torch.randn(8, 8, requires_grad=True)


def hits_per_policy(policies=None, make_layer=None) -> dict:
    """{policy name: {op: kept outputs served}} over one step of each policy (the grid on
    EveryKindOfCall unless told), as an audit sees it."""
    hits = {}
    for name, policy in (POLICIES if policies is None else policies).items():
        layer, x = (make_layer or layer_and_input)()
        sac_plugin.apply_selective_checkpointing(layer, policy)
        torch.manual_seed(1)
        with sac_plugin.audit() as audit:
            layer(x).backward()
        hits[name] = {row.op: row.hits for row in audit.rows() if row.hits}
    return hits
