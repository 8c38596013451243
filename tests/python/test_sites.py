"""Checkpoint sites (NOTE: [What a site learns] in csrc/dispatch/site.h): one Policy applied to two
layer types decides each by its own forward, and a Policy stays a value however it is used."""

import copy
import pickle

import torch

import sac_plugin
from sac_plugin import Policy


class LastMatmulUnreached(torch.nn.Module):
    """Its second mm runs after its last tensor saved for backward: the recompute never reaches it."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(16, 16) / 4), torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.mm(torch.mm(x, self.w1).tanh(), self.w2)


class LastMatmulReached(LastMatmulUnreached):
    """The same two mms, then a sin that saves the second's output: the recompute reaches both."""

    def forward(self, x):
        return super().forward(x).sin()


def _run_steps(policies, steps=3):
    """Per step, the mm outputs served and recomputed; per layer, the calls kept and their bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(LastMatmulUnreached(), LastMatmulReached())
    for layer, policy in zip(model, policies):
        sac_plugin.apply_selective_checkpointing(layer, policy)
    x = torch.randn(8, 16, requires_grad=True)
    hits = []
    with sac_plugin.report(model) as layer_report:
        for _ in range(steps):
            with sac_plugin.audit() as audit:
                model(x).sum().backward()
            hits.append((audit.hits("aten::mm"), audit.count("aten::mm", phase="recompute")))
    kept = [(layer["name"], layer["kept_calls"], layer["kept_bytes"]) for layer in layer_report.to_dict()["layers"]]
    return hits, kept


def test_one_policy_on_two_layer_types_behaves_as_two_equal_policies():
    shared = Policy(kept_ops=["aten::mm"])
    hits, kept = _run_steps([shared, shared])
    assert (hits, kept) == _run_steps([Policy(kept_ops=["aten::mm"]), Policy(kept_ops=["aten::mm"])])
    # The first layer serves its first mm; the second serves both, every step: what the first
    # layer's site learnt (its second mm is never reached) is not applied to the second layer.
    assert hits == [(3, 0)] * 3
    if sac_plugin.engine() == "native":  # reports read kept bytes from native regions (docs/engines.md)
        # Per step, one 8x16 mm output in the first layer, two in the second.
        one_output = 8 * 16 * 4
        assert kept == [("0", 3, 3 * one_output), ("1", 6, 6 * one_output)]


def test_a_policy_is_a_value_however_it_is_used():
    policy = Policy(kept_ops=["aten::mm"], kept_units=["attn"])
    fields = {name: getattr(policy, name) for name in Policy.__slots__ if name != "__weakref__"}
    before = (hash(policy), repr(policy), pickle.dumps(policy))
    _run_steps([policy, policy])
    assert {name: getattr(policy, name) for name in Policy.__slots__ if name != "__weakref__"} == fields
    assert (hash(policy), repr(policy), pickle.dumps(policy)) == before
    assert copy.copy(policy) is policy and copy.deepcopy(policy) is policy  # immutable: copies are itself
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert hash(pickle.loads(pickle.dumps(policy))) == hash(policy)
