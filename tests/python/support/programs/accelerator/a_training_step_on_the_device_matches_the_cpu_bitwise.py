"""The program test_test_accelerator.py runs for test_a_training_step_on_the_device_matches_the_cpu_bitwise,
which asserts what it reports."""

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report
from torch.nn.attention import SDPBackend, sdpa_kernel


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
        attention = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + attention.transpose(1, 2).reshape(x.shape)
        return x + self.mlp(x)


# torch picks the attention kernel per device type: the CPU's fused kernel on the CPU, the
# math decomposition on this device (ops the device runs through the CPU kernels). The
# reference pins the CPU to that same math, so both sides compute the same thing.
torch.manual_seed(0)
on_cpu = Block()
on_device = Block()
on_device.load_state_dict(on_cpu.state_dict())
on_device.to("sac_accel")
x = torch.randn(3, 5, 16)
target = torch.randn(3, 5, 16)


def train(model, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        with sdpa_kernel(SDPBackend.MATH):
            loss = torch.nn.functional.mse_loss(model(x.to(device)), target.to(device))
            loss.backward()
        optimizer.step()
    return loss.item()


losses = [train(on_cpu, "cpu"), train(on_device, "sac_accel")]
pairs = list(zip(on_cpu.named_parameters(), on_device.named_parameters()))
report(
    devices=sorted({str(p.device) for _, p in on_device.named_parameters()}),
    grad_devices=sorted({str(p.grad.device) for _, p in on_device.named_parameters()}),
    unequal_grads=[n for (n, a), (_, b) in pairs if not torch.equal(a.grad, b.grad.cpu())],
    unequal_params=[n for (n, a), (_, b) in pairs if not torch.equal(a, b.cpu())],
    losses_equal=losses[0] == losses[1],
)
