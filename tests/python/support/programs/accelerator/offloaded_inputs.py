"""Four layers on the test accelerator; each layer's input is 256 x 512 float32 (512 KiB), the
activation the stack carries; and the steps the offloaded-input tests run them with. Bodies run
after `from support.programs.accelerator.offloaded_inputs import *`."""

import sac_plugin
import sac_plugin.memory
import torch
from sac_plugin import Policy

__all__ = [
    "INPUT_BYTES",
    "Layer",
    "Policy",
    "checkpointed",
    "forward",
    "gradients",
    "model_and_input",
    "sac_plugin",
    "same",
    "stats",
    "step",
]

INPUT_BYTES = 256 * 512 * 4


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(512, 1024)
        self.down = torch.nn.Linear(1024, 512)

    def forward(self, x, scale=None):
        y = x + self.down(torch.nn.functional.dropout(torch.tanh(self.up(x)), 0.1)).sin()
        return y if scale is None else y * scale


def model_and_input(layers=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Layer() for _ in range(layers)]).to("sac_accel")
    x = torch.randn(256, 512, device="sac_accel", requires_grad=True)
    return model, x


def checkpointed(policy, layers=4):
    model, x = model_and_input(layers)
    for layer in model:
        sac_plugin.apply_selective_checkpointing(layer, policy)
    return model, x


def gradients(model, x):
    return [p.grad.cpu() for p in model.parameters()] + [x.grad.cpu()]


def forward(model, x):
    torch.manual_seed(1)
    # x * 2: the first layer's input is an activation too (x itself is a leaf, which stays put).
    return model(x * 2).square().mean()


def step(model, x):
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    loss = forward(model, x)
    torch.accelerator.synchronize()
    held = torch.accelerator.memory_allocated() - before
    loss.backward()
    torch.accelerator.synchronize()
    return held


def stats():
    return sac_plugin.memory.offload_stats()


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))
