"""Two checkpointed layers trained on the test accelerator, whose backward runs on autograd's
device thread: reports the engine, the thread the backward ran on, whether gradients equal the
unmodified model's, the audit's counts and the units left open."""

import copy
import threading

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

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
    same_gradients=all(
        torch.equal(p.grad.cpu(), q.grad.cpu()) for p, q in zip(model.parameters(), reference.parameters())
    ),
    tanh_hits=audit.hits("aten::tanh"),
    tanh_recomputed=audit.count("aten::tanh", phase="recompute"),
    addmm_recomputed=audit.count("aten::addmm", phase="recompute"),
    units_left=sac_plugin.open_units(),
)
