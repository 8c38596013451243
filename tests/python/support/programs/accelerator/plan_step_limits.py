"""A two-layer Llama on the test accelerator at plan_step's limits: the lowest reachable peak a
PlanError names, asked for exactly; the largest peak_bytes there is; and a step that calls an
optimizer's step or changes a parameter in place, each refused, with what it left behind."""

import warnings

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

warnings.simplefilter("ignore")
import sac_plugin  # noqa: E402 - its warnings are ignored too
from sac_plugin import PlanError  # noqa: E402
from sac_plugin.models import Llama  # noqa: E402

DEVICE = "sac_accel"
torch.manual_seed(0)
model = Llama(vocab=128, dim=64, heads=4, layers=2, seq=64).to(DEVICE)
tokens = torch.randint(0, 128, (4, 64), device=DEVICE)


def step():
    model.loss(tokens, tokens).backward()


def checkpointed():
    return [name for name, m in model.named_modules() if "_sac_policy" in m.__dict__ or "forward" in m.__dict__]


def plan_and_remove(peak_bytes):
    plan = sac_plugin.plan_step(model, step, peak_bytes=peak_bytes, runs=1)
    for layer in model.layers:
        sac_plugin.remove_checkpointing(layer)
    return plan


values = {}
try:
    sac_plugin.plan_step(model, step, peak_bytes=1, runs=1)
except PlanError as error:
    values["lowest"] = error.lowest_bytes
    values["below"] = str(error)
values["at_lowest"] = plan_and_remove(values["lowest"]).measured_peak
values["largest"] = plan_and_remove(2**63 - 1).measured_peak

state = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
optimizer = torch.optim.Adam(model.parameters())


def step_and_optimize():
    step()
    optimizer.step()


try:
    sac_plugin.plan_step(model, step_and_optimize, peak_bytes=2**40, runs=1)
except ValueError as error:
    values["optimizer"] = str(error)
values["optimizer_state"] = len(optimizer.state)


def step_and_scale():
    step()
    with torch.no_grad():
        model.embed.weight.mul_(1.0)


try:
    sac_plugin.plan_step(model, step_and_scale, peak_bytes=2**40, runs=1)
except ValueError as error:
    values["in_place"] = str(error)
values["changed"] = [n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), state[n])]
values["grads"] = [n for n, p in model.named_parameters() if p.grad is not None]
values["checkpointed"] = checkpointed()
values["parameters"] = len(state)
report(**values)
