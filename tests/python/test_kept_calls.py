"""Issue 9: explicit kept calls, Policy(kept_calls={op: [indices]}): exactly the listed calls of an
op are kept, counted as every_nth_op counts them, in the native engine, the dispatch-mode engine
and torch's SAC (torch_policy_fn, and so torch.compile)."""

import pickle

import pytest
import sac_plugin
import torch
from sac_plugin import Policy
from sac_plugin.checkpointing import torch_policy_fn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from test_data_flow import train_pair


def _five_matmuls(weights, x):
    for w in weights:
        x = torch.tanh(x @ w)
    return x


def _run(policy):
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(5)]
    reference = [w.detach().clone().requires_grad_() for w in weights]
    x = torch.randn(4, 8)
    with sac_plugin.audit() as audit:
        checkpoint(_five_matmuls, weights, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy)).sum().backward()
    _five_matmuls(reference, x).sum().backward()
    for w, r in zip(weights, reference):
        assert torch.equal(w.grad, r.grad)
    return audit


@pytest.mark.parametrize("indices", [[0], [1, 3], [0, 2, 4], [4, 3, 3], [7]])
def test_kept_calls_keep_exactly_the_listed_calls(indices):
    audit = _run(Policy(kept_calls={"aten::mm.default": indices}))
    kept = len({i for i in indices if i < 5})
    assert audit.hits("aten::mm") == kept
    assert audit.count("aten::mm", phase="forward") == 5
    assert audit.count("aten::mm", phase="recompute") == 5 - kept
    assert audit.count("aten::tanh", phase="recompute") == 5


def test_kept_calls_are_read_back_sorted_and_merged():
    policy = Policy(kept_calls={torch.ops.aten.mm.default: [5, 0, 2, 2], "aten::tanh": []})
    assert policy.kept_calls == {"aten::mm": (0, 2, 5)}
    assert not policy.keeps_nothing
    assert Policy(kept_calls={"aten::tanh": []}).keeps_nothing
    assert policy == Policy(kept_calls={"aten::mm.default": (0, 2, 5)})
    assert policy != Policy(kept_calls={"aten::mm.default": (0, 2)})
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert repr(policy) == "Policy(kept_ops=[], kept_units=[], kept_calls={'aten::mm.default': [0, 2, 5]})"


@pytest.mark.parametrize("make, error, message", [
    (lambda: Policy(kept_calls=[("aten::mm", [0])]), TypeError,
     "sac_plugin: kept_calls must be a mapping from op to call indices such as {'aten::mm.default': [0, 2]}, got "
     "[('aten::mm', [...])] (list)"),
    (lambda: Policy(kept_calls={"aten::mm": 0}), TypeError,
     "sac_plugin: kept_calls['aten::mm'] must be a collection of 0-based call indices such as [0, 2], got 0 (int)"),
    (lambda: Policy(kept_calls={"aten::mm": [-1]}), ValueError,
     "sac_plugin: kept_calls['aten::mm']: a call index is an int from 0 to 2**63 - 1 (0 is the op's first call in "
     "the region), got -1 (int)"),
    (lambda: Policy(kept_calls={"aten::mm": [1.0]}), TypeError,
     "sac_plugin: kept_calls['aten::mm']: a call index is an int from 0 to 2**63 - 1 (0 is the op's first call in "
     "the region), got 1.0 (float)"),
    (lambda: Policy(kept_calls={"aten::not_an_op": [0]}), ValueError, "sac: kept_calls: "),
    (lambda: Policy(kept_calls={"aten::add_.Tensor": [0]}), ValueError,
     "sac: kept_calls: 'aten::add_.Tensor' names aten::add_.Tensor, which mutates an input"),
    (lambda: Policy(kept_calls={"aten::bernoulli.default": [0]}), ValueError,
     "sac: kept_calls: 'aten::bernoulli.default' names aten::bernoulli, which is a random op"),
    (lambda: Policy(kept_ops=["aten::mm"], kept_calls={"aten::mm.default": [0]}), ValueError,
     "sac: kept_calls: 'aten::mm.default' names aten::mm, which kept_ops already names; give each op one rule "
     "(kept_ops, every_nth_op or kept_calls)"),
    (lambda: Policy(every_nth_op={"aten::mm": 2}, kept_calls={"aten::mm.default": [0]}), ValueError,
     "sac: kept_calls: 'aten::mm.default' names aten::mm, which every_nth_op already names; give each op one rule "
     "(kept_ops, every_nth_op or kept_calls)"),
])
def test_bad_kept_calls_are_refused_by_name(make, error, message):
    with pytest.raises(error) as raised:
        make()
    assert str(raised.value).startswith(message), str(raised.value)


class _Ctx:
    def __init__(self, is_recompute):
        self.is_recompute = is_recompute


def test_torch_policy_fn_keeps_the_same_calls():
    """The compile path's policy function counts calls per op and pass as the fallback does."""
    decide = torch_policy_fn(Policy(kept_calls={"aten::mm.default": [1, 3]}))
    x = torch.randn(2, 2)
    for recompute in (False, True):
        decisions = [decide(_Ctx(recompute), torch.ops.aten.mm.default, x, x) for _ in range(5)]
        assert decisions == [CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE,
                             CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE,
                             CheckpointPolicy.PREFER_RECOMPUTE]
    assert decide(_Ctx(False), torch.ops.aten.tanh.default, x) == CheckpointPolicy.PREFER_RECOMPUTE


def test_dispatch_mode_policy_fn_keeps_the_same_calls():
    from sac_plugin.dispatch_mode import eager_policy_fn

    plan = {}
    decide = eager_policy_fn(Policy(kept_calls={"aten::mm.default": [0, 4]}), plan)
    x = torch.randn(2, 2)
    for _ in range(5):
        decide(_Ctx(False), torch.ops.aten.mm.default, x, x)
    assert plan[torch.ops.aten.mm.default] == [True, False, False, False, True]


@pytest.mark.native_engine("matching by data flow is the native engine's; the dispatch-mode engine matches kept "
                           "calls per op in order, as torch's SAC does")
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
