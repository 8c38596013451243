"""Warnings are sentences for the user: no "(Triggered internally at <build path>...)" tail."""

import warnings

import sac_plugin
import torch
from sac_plugin import Policy, recompute_unit
from torch.utils.checkpoint import checkpoint


def _writes_in_kept_unit(weight, x):
    h = (x @ weight) * 2  # made outside the unit: not kept, so the write below demotes nothing
    with recompute_unit("write"):
        h.add_(1)
        h = h.sin()
    return h.cos()


def test_the_mutating_op_warning_is_exactly_its_sentence():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    fn = sac_plugin.context_fn(Policy(kept_units=["write"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            checkpoint(_writes_in_kept_unit, weight, x, use_reentrant=False, context_fn=fn).sum().backward()
    ours = [w for w in caught if "sac" in str(w.message)]
    if sac_plugin.engine() == "native":
        # Attributed to the Python line that ran the op, never to a C++ source file of the build.
        # (The dispatch-mode engine warns from its policy function, inside torch's SAC mode.)
        assert [w.filename for w in ours] == [__file__]
    messages = [str(w.message) for w in ours]
    assert messages == [
        "sac: aten::add_.Tensor mutates an input inside kept unit 'write'; it is recomputed rather than kept "
        "(warned once per policy)"
    ]
    reference = weight.detach().clone().requires_grad_()
    _writes_in_kept_unit(reference, x).sum().backward()
    assert torch.equal(weight.grad, 2 * reference.grad)
