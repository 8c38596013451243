"""Two layers on the test accelerator whose first projection makes 1 MiB (offloaded) and second
512 KiB (under the floor), and the steps the offload tests run them with. Bodies run after
`from support.programs.accelerator.offloaded_outputs import *`."""

import sac_plugin
import sac_plugin.memory
import torch
from sac_plugin import Policy

__all__ = ["Layer", "Policy", "checkpointed", "gradients", "model_and_input", "sac_plugin", "stats", "step"]


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(512, 1024)
        self.down = torch.nn.Linear(1024, 512)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x))).sin()


def model_and_input(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Layer(), Layer()).to("sac_accel")
    x = torch.randn(256, 512, device="sac_accel", requires_grad=True)
    return model, x


def checkpointed(policy):
    model, x = model_and_input()
    for layer in model:
        sac_plugin.apply_selective_checkpointing(layer, policy)
    return model, x


def gradients(model, x):
    return [p.grad.cpu() for p in model.parameters()] + [x.grad.cpu()]


def step(model, x, audit=None):
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    loss = model(x).square().mean()
    torch.accelerator.synchronize()
    held = torch.accelerator.memory_allocated() - before
    loss.backward()
    torch.accelerator.synchronize()
    return held


def stats():
    return sac_plugin.memory.offload_stats()
