"""Residual MLP blocks on the test accelerator, planned for a peak below full recompute's: only
offloading layer inputs reaches it. Reports the peaks, the plan's choices and the gradients."""

import warnings

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

warnings.simplefilter("ignore")
import sac_plugin  # noqa: E402 - its warnings are ignored too
from sac_plugin import PlanError  # noqa: E402


# Residual MLP blocks on many tokens: each block's input (1 MiB) outweighs its parameters, so the
# inputs the layers hold for the recompute decide the peak of the backward.
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))

    def recompute_wrap_sites(self):
        return list(self.blocks)

    def loss(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build():
    torch.manual_seed(0)
    return Stack().to("sac_accel")


torch.manual_seed(1)
x = torch.randn(4096, 64, device="sac_accel")
model, reference = build(), build()


def step():
    model.loss(x).backward()


for block in model.blocks:
    sac_plugin.apply_selective_checkpointing(block)
torch.accelerator.synchronize()
torch.accelerator.reset_peak_memory_stats()
step()
torch.accelerator.synchronize()
full_recompute = torch.accelerator.max_memory_allocated()
model.zero_grad(set_to_none=True)
for block in model.blocks:
    sac_plugin.remove_checkpointing(block)
budget = full_recompute - (1 << 19)
try:
    sac_plugin.plan_step(model, step, peak_bytes=budget, runs=1)
except PlanError as error:
    without_offload = str(error)
plan = sac_plugin.plan_step(model, step, peak_bytes=budget, runs=1, offload=True)
step()
reference.loss(x).backward()
pairs = list(zip(model.named_parameters(), reference.named_parameters()))
report(
    engine=sac_plugin.engine(),
    full_recompute=full_recompute,
    budget=budget,
    without_offload=without_offload,
    predicted=plan.predicted_peak,
    measured=plan.measured_peak,
    inputs=[c.offload_inputs for c in plan.layers],
    policies=[block._sac_policy.offload_inputs for block in model.blocks],
    unequal_grads=[n for (n, a), (_, b) in pairs if not torch.equal(a.grad.cpu(), b.grad.cpu())],
)
