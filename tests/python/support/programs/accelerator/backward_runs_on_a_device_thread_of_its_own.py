"""The program test_test_accelerator.py runs for test_backward_runs_on_a_device_thread_of_its_own,
which asserts what it reports."""

import threading

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report


def backward_thread(device):
    threads = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(device)
    out = model(torch.randn(2, 4, device=device))
    out.register_hook(lambda grad: threads.append(threading.get_ident()))
    out.sum().backward()
    return threads[0]


caller = threading.get_ident()
cpu, device_0, device_1 = backward_thread("cpu"), backward_thread("sac_accel:0"), backward_thread("sac_accel:1")
report(
    cpu_on_caller=cpu == caller,
    device_0_elsewhere=device_0 != caller,
    device_1_elsewhere=device_1 != caller,
    one_thread_per_device=device_0 != device_1,
)
