"""Kept calls are matched by data flow: a call that runs in one pass only (a no_grad cache filled
on the first step, a lazy init) never changes what another call is served. Each case compares
loss and gradients bitwise with the same model without checkpointing, over several steps, so
that the first step (cache filled in the forward only) and later steps (cache already there)
are both covered."""

import pytest
import sac_plugin
import torch
from sac_plugin import Policy
from support.data_flow import train_pair

pytestmark = pytest.mark.native_engine(
    "matching by data flow is the native engine's; the dispatch-mode engine matches kept calls per op in order, "
    "as torch's SAC does"
)


# The call the forward makes only once (the cache) is kept and never served: held for nothing in
# the first step, and named (NOTE: [Served, or named] in csrc/dispatch/kept_outputs.cpp).
_CACHE_HELD_FOR_NOTHING = "sac: LazyCacheLayer held the outputs of 1 call \\(128 bytes\\) from its forward"


def test_kept_op_with_a_same_shape_call_made_in_the_forward_only():
    with pytest.warns(sac_plugin.HeldNeverServedWarning, match=_CACHE_HELD_FOR_NOTHING):
        audits = train_pair(Policy(kept_ops=["aten::mm"]))
    # Step 1: the forward made three mm (cache, x@w1, h@w2), the recompute two, both served.
    assert audits[0].count("aten::mm", phase="forward") == 3
    assert audits[0].hits("aten::mm") == 2
    assert audits[0].count("aten::mm", phase="recompute") == 0
    assert [audit.never_served("aten::mm") for audit in audits] == [1, 0, 0]
    # Later steps: no cache call at all.
    assert audits[1].count("aten::mm", phase="forward") == 2
    assert audits[1].hits("aten::mm") == 2


@pytest.mark.parametrize("cache_shape", [(4, 8), "other"], ids=["same_shapes", "other_shapes"])
def test_every_nth_op_with_a_call_made_in_the_forward_only(cache_shape):
    with pytest.warns(sac_plugin.HeldNeverServedWarning, match="sac: LazyCacheLayer held the outputs of 1 call"):
        audits = train_pair(Policy(every_nth_op={"aten::mm": 2}), cache_shape=cache_shape)
    assert [audit.never_served("aten::mm") for audit in audits] == [1, 0, 0]
    # Step 1: the forward keeps calls 1 and 3 (the cache and h@w2); x@w1 is recomputed, and
    # h@w2 is served to its own twin.
    assert audits[0].hits("aten::mm") == 1
    assert audits[0].count("aten::mm", phase="recompute") == 1
    # Later steps: calls 1 (x@w1) is kept and served, call 2 recomputed.
    assert audits[1].hits("aten::mm") == 1
    assert audits[1].count("aten::mm", phase="recompute") == 1


def test_kept_unit_with_a_same_shape_call_made_in_the_forward_only():
    audits = train_pair(Policy(kept_units=["attn"]), unit="attn")
    assert audits[0].hits("aten::mm") == 2 and audits[0].hits("aten::tanh") == 1
    assert audits[1].hits("aten::mm") == 2 and audits[1].hits("aten::tanh") == 1


def test_repeated_identical_calls_are_served_in_order():
    """Two identical calls (same op, same inputs) are told apart by their order; both are served."""
    w = torch.randn(8, 8, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    x = torch.randn(4, 8)

    def body(weight, v):
        return torch.tanh(v @ weight) * torch.tanh(v @ weight).sin()

    fn = sac_plugin.context_fn(Policy(kept_ops=["aten::mm", "aten::tanh"]))
    with sac_plugin.audit() as audit:
        torch.utils.checkpoint.checkpoint(body, w, x, use_reentrant=False, context_fn=fn).sum().backward()
    body(w_ref, x).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)
    assert audit.hits("aten::mm") == 2 and audit.hits("aten::tanh") == 2


def test_a_value_read_before_and_after_an_in_place_write_is_not_confused():
    """tanh(h) before h.mul_(2) and tanh(h) after it have different inputs, though the same tensor."""
    w = torch.randn(8, 8, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    x = torch.randn(4, 8)

    def body(weight, v):
        h = v @ weight
        first = torch.tanh(h)
        h.mul_(2)  # mm saves its inputs, not its output: autograd allows this write
        return first * torch.tanh(h)

    fn = sac_plugin.context_fn(Policy(kept_ops=["aten::tanh"]))
    with sac_plugin.audit() as audit:
        torch.utils.checkpoint.checkpoint(body, w, x, use_reentrant=False, context_fn=fn).sum().backward()
    body(w_ref, x).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)
    assert audit.hits("aten::tanh") == 2


@pytest.mark.native_engine(
    "matching by data flow is the native engine's; the dispatch-mode engine matches kept "
    "calls per op in order, as torch's SAC does"
)
@pytest.mark.parametrize("cache_shape", [(4, 8), "other"], ids=["same_shapes", "other_shapes"])
def test_kept_calls_with_a_call_made_in_the_forward_only(cache_shape):
    """Step 1's forward makes an extra mm (a no_grad cache) first: it is call 0, so kept call 1 is
    x @ w1, served in the recompute by data flow, not the recompute's second mm."""
    audits = train_pair(Policy(kept_calls={"aten::mm": [1]}), cache_shape=cache_shape)
    assert audits[0].count("aten::mm", phase="forward") == 3
    assert audits[0].hits("aten::mm") == 1
    assert audits[0].count("aten::mm", phase="recompute") == 1
    # Later steps: no cache call, so call 1 is h @ w2.
    assert audits[1].hits("aten::mm") == 1
    assert audits[1].count("aten::mm", phase="recompute") == 1
