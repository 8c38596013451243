"""The engines on an accelerator whose backward runs on autograd's device thread (the test
accelerator, tests/support/test_accelerator): the recompute, the unit stack re-opened around it and
the audit all happen on that thread, and gradients are the unmodified model's, bitwise."""

import os

import pytest
from test_test_accelerator import _SKIP_REASON, run_on_accelerator

pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

BODY = """
import copy
import sac_plugin
from sac_plugin import Policy, recompute_unit

class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        with recompute_unit("attn"):
            h = torch.tanh(self.q(x))
        return x + self.out(h).sin()

torch.manual_seed(0)
model = torch.nn.Sequential(Layer(), Layer()).to("sac_accel")
reference = copy.deepcopy(model)
for layer in model:
    sac_plugin.apply_selective_checkpointing(layer, Policy(kept_units=["attn"]))
x = torch.randn(4, 16, device="sac_accel")
threads = []
model[0].q.weight.register_hook(lambda grad: threads.append(threading.get_ident()) or grad)
with sac_plugin.audit() as audit:
    model(x).square().mean().backward()
reference(x).square().mean().backward()
report(
    engine=sac_plugin.engine(),
    backward_on_another_thread=bool(threads) and threads[0] != threading.get_ident(),
    same_gradients=all(torch.equal(p.grad.cpu(), q.grad.cpu())
                       for p, q in zip(model.parameters(), reference.parameters())),
    tanh_hits=audit.hits("aten::tanh"),
    tanh_recomputed=audit.count("aten::tanh", phase="recompute"),
    addmm_recomputed=audit.count("aten::addmm", phase="recompute"),
    units_left=sac_plugin.open_units(),
)
"""


@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
def test_backward_on_the_device_thread_recomputes_serves_and_audits_exactly(engine):
    os.environ["SAC_PLUGIN_ENGINE"] = engine
    try:
        values = run_on_accelerator(BODY)
    finally:
        del os.environ["SAC_PLUGIN_ENGINE"]
    assert values == {
        "engine": engine,
        "backward_on_another_thread": True,
        "same_gradients": True,
        "tanh_hits": 2,
        "tanh_recomputed": 0,
        "addmm_recomputed": 2,
        "units_left": [],
    }
