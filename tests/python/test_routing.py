"""Routing is served from the forward (docs/semantics.md, NOTE: [Routing is served from the
forward] in csrc/policy/policy.cpp): a router that routes differently in the recompute sends the
tokens where the forward sent them under any selective policy, on both engines."""

import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

import sac_plugin
from sac_plugin import Policy, recompute_unit
from sac_plugin import _rule

EXPERTS, K, DIM, TOKENS = 4, 2, 8, 16


class ToyMoE(torch.nn.Module):
    """Attention-like unit, a top-k router and experts fed by nonzero over the routing indices.
    `jitter` is added to the router's logits; a test changes it in place between the forward and
    the backward, so the recompute's router ranks the experts otherwise, as a GPU router whose
    reductions are not repeatable may."""

    def __init__(self, through_a_constant=False):
        super().__init__()
        self.through_a_constant = through_a_constant
        self.q = torch.nn.Linear(DIM, DIM)
        self.router = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.w = torch.nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM)
        self.register_buffer("jitter", torch.zeros(EXPERTS))

    def forward(self, x):
        with recompute_unit("attn"):
            h = torch.tanh(self.q(x))
        logits = self.router(h) + self.jitter
        if self.through_a_constant:  # a tensor built from Python values in every forward
            logits = logits * torch.tensor([1.0, 0.5, 2.0, 1.0])
        values, indices = torch.topk(logits, K, dim=-1)
        weights = torch.softmax(values, dim=-1)
        out = torch.zeros_like(h)
        for expert in range(EXPERTS):
            tokens, slot = torch.nonzero(indices == expert, as_tuple=True)
            y = (h[tokens] @ self.w[expert]) * weights[tokens, slot].unsqueeze(-1)
            out = out.index_add(0, tokens, y)
        return out


def _inputs():
    torch.manual_seed(0)
    model = ToyMoE()
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    return model, x


def _grads(model, x):
    return [x.grad] + [p.grad for p in model.parameters()]


def _run_checkpointed(model, x, policy, perturb):
    out = checkpoint(model, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy))
    loss = out.square().sum()
    if perturb:
        with torch.no_grad():
            # The recompute's router now prefers the experts the forward ranked last.
            model.jitter.copy_(torch.tensor([0.0, 0.0, 50.0, 50.0]))
    loss.backward()
    with torch.no_grad():
        model.jitter.zero_()


def _reference():
    model, x = _inputs()
    model(x).square().sum().backward()
    return _grads(model, x)


@pytest.mark.parametrize("perturb", [False, True], ids=["same_router", "router_differs_in_recompute"])
def test_routing_is_served_from_the_forward_bitwise(perturb):
    expected = _reference()
    model, x = _inputs()
    _run_checkpointed(model, x, Policy(kept_units=["attn"]), perturb)
    for got, want in zip(_grads(model, x), expected):
        assert torch.equal(got, want)


def test_routing_through_a_constant_is_pinned():
    """The constant is made outside the dispatcher in each pass, and named by its value (NOTE: [A
    small constant is named by its value] in csrc/dispatch/data_flow.cpp), so the routing computed
    through it is served from the forward even when the recompute's router ranks otherwise."""
    torch.manual_seed(0)
    reference = ToyMoE(through_a_constant=True)
    model = copy.deepcopy(reference)
    x = torch.randn(TOKENS, DIM)
    reference(x).square().sum().backward()
    with sac_plugin.audit() as audit:
        _run_checkpointed(model, x, Policy(kept_units=["attn"]), perturb=True)
    assert (audit.hits("aten::topk"), audit.hits("aten::nonzero"), audit.never_served()) == (1, EXPERTS, 0)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)


def test_routing_calls_are_served_and_counted():
    model, x = _inputs()
    with sac_plugin.audit() as audit:
        _run_checkpointed(model, x, Policy(kept_units=["attn"]), perturb=True)
    assert audit.hits("aten::topk") == 1
    assert audit.hits("aten::nonzero") == EXPERTS
    # The router's matmul is not routing: it runs again.
    assert audit.hits("aten::mm") == 0
    with sac_plugin.audit() as audit:
        _run_checkpointed(model, x, Policy(kept_units=["attn"], pin_routing=False), perturb=False)
    assert audit.hits("aten::topk") == 0 and audit.hits("aten::nonzero") == 0


def _opt_out_message(where):
    # On the CPU every output is on the host: the recompute's top-k indices differ from the
    # forward's. (On an accelerator the sizes of nonzero's token lists are what the check sees.)
    return (
        f"sac_plugin: the recompute of {where} routes tokens differently from its forward: the 1st routing "
        "call of aten::topk returned other values than in the forward. The policy recomputes the routing "
        "(pin_routing=False); leave pin_routing at True so that the routing is served from the forward, or make "
        "the router repeat itself in the recompute"
    )


def test_the_opt_out_stops_a_recompute_that_routes_otherwise_naming_the_region_the_op_and_the_fix():
    model, x = _inputs()
    expected = _opt_out_message("a checkpointed region")
    with pytest.raises(RuntimeError) as raised:
        _run_checkpointed(model, x, Policy(kept_units=["attn"], pin_routing=False), perturb=True)
    assert not isinstance(raised.value, CheckpointError)  # not torch's message about tensor positions
    assert str(raised.value).splitlines()[0] == expected


def test_the_opt_out_names_the_checkpointed_layer():
    model, x = _inputs()
    expected = _opt_out_message("ToyMoE")
    sac_plugin.apply_selective_checkpointing(model, Policy(kept_units=["attn"], pin_routing=False))
    loss = model(x).square().sum()
    with torch.no_grad():
        model.jitter.copy_(torch.tensor([0.0, 0.0, 50.0, 50.0]))
    with pytest.raises(RuntimeError) as raised:
        loss.backward()
    assert str(raised.value).splitlines()[0] == expected


def test_the_opt_out_recomputes_a_routing_that_repeats_itself_bitwise():
    expected = _reference()
    model, x = _inputs()
    with sac_plugin.audit() as audit:
        _run_checkpointed(model, x, Policy(kept_units=["attn"], pin_routing=False), perturb=False)
    assert audit.hits("aten::topk") == 0 and audit.hits("aten::nonzero") == 0
    for got, want in zip(_grads(model, x), expected):
        assert torch.equal(got, want)


@pytest.mark.native_engine(
    "the dispatch-mode engine hands the call pipeline a call's tensors, not the scalars "
    "`.item()` returns, so it checks the sizes of what routes but not the values read back"
)
def test_the_opt_out_checks_values_read_on_the_host():
    class HostSplit(torch.nn.Module):
        """Splits by counts read back on the host (`.item()`): sizes the recompute must repeat."""

        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(DIM, DIM)
            self.register_buffer("halves", torch.tensor([TOKENS // 2, TOKENS // 2]))
            self.register_buffer("shift", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            with recompute_unit("attn"):
                h = torch.tanh(self.q(x))
            # Counts computed from the module's buffers, which the recompute names as the forward did.
            counts = [int(c) for c in self.halves + torch.stack([self.shift, -self.shift])]
            first, second = torch.split(h, counts)
            return torch.cat([first.sigmoid(), second.exp()])  # both save their outputs: the recompute gets here

    torch.manual_seed(0)
    model, x = HostSplit(), torch.randn(TOKENS, DIM, requires_grad=True)
    out = checkpoint(
        model,
        x,
        use_reentrant=False,
        context_fn=sac_plugin.context_fn(Policy(kept_units=["attn"], pin_routing=False), name="HostSplit"),
    )
    model.shift.fill_(1)
    with pytest.raises(
        RuntimeError,
        match=r"^sac_plugin: the recompute of HostSplit routes tokens differently from "
        r"its forward: the 1st routing call of aten::_local_scalar_dense returned other values than "
        r"in the forward\. ",
    ):
        out.square().sum().backward()


def test_a_context_name_must_be_a_string():
    with pytest.raises(TypeError, match=r"^sac_plugin: context_fn: name must be a str, got 3 \(int\)$"):
        sac_plugin.context_fn(Policy(kept_units=["attn"]), name=3)


def test_pin_routing_is_part_of_the_policy():
    policy = Policy(kept_units=["attn"], pin_routing=False)
    assert not policy.pin_routing and Policy(kept_units=["attn"]).pin_routing
    assert repr(policy) == "Policy(kept_ops=[], kept_units=['attn'], pin_routing=False)"
    assert policy != Policy(kept_units=["attn"])
    assert copy.deepcopy(policy) is policy
    import pickle

    assert pickle.loads(pickle.dumps(policy)).pin_routing is False
    with pytest.raises(TypeError, match=r"sac_plugin: pin_routing must be True or False, got 1 \(int\)"):
        Policy(pin_routing=1)


def test_the_rule_decides_routing_for_the_python_front_doors():
    policy = Policy(kept_units=["attn"])
    decider = _rule.CallDecider(policy)
    topk = decider.decide(torch.ops.aten.topk.default, False, ("router",))
    assert (topk.outcome, topk.reason) == (_rule.Outcome.KEEP, _rule.Reason.ROUTES_TOKENS)
    assert topk.reason.text == "routes tokens"
    assert decider.decide(torch.ops.aten.nonzero.default, False, ()).reason == _rule.Reason.ROUTES_TOKENS
    # A copy to the host is one by its arguments: a caller that reads them says so.
    assert decider.decide(torch.ops.aten._to_copy.default, False, ()).reason == _rule.Reason.NOT_SELECTED
    assert decider.decide(torch.ops.aten._to_copy.default, False, (), routes_tokens=True).keep
    assert not decider.decide(torch.ops.aten.topk.default, False, (), routes_tokens=False).keep
    item = _rule.decide_call(policy, "aten::_local_scalar_dense", (), 0)
    assert item.reason == _rule.Reason.ROUTES_TOKENS
    unpinned = _rule.CallDecider(Policy(kept_units=["attn"], pin_routing=False))
    assert unpinned.decide(torch.ops.aten.topk.default, False, ()).reason == _rule.Reason.NOT_SELECTED
