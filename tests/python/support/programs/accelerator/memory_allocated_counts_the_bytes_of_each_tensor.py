"""The program test_test_accelerator.py runs for test_memory_allocated_counts_the_bytes_of_each_tensor,
which asserts what it reports."""

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

base = torch.accelerator.memory_allocated(0)
t = torch.empty(1000, dtype=torch.float32, device="sac_accel")
with_t = torch.accelerator.memory_allocated(0)
u = torch.empty(10, dtype=torch.float64, device="sac_accel:1")
device_1 = torch.accelerator.memory_allocated(1)
unchanged_0 = torch.accelerator.memory_allocated(0)
del t
after_free = torch.accelerator.memory_allocated(0)
peak = torch.accelerator.max_memory_allocated(0)
torch.accelerator.reset_peak_memory_stats(0)
peak_after_reset = torch.accelerator.max_memory_allocated(0)
stats = torch.accelerator.memory_stats(0)
report(
    grew=with_t - base,
    device_1=device_1,
    unchanged_0=unchanged_0 - base,
    dropped=with_t - after_free,
    peak=peak - base,
    peak_after_reset=peak_after_reset - base,
    live_allocations=stats["allocation.all.current"],
    base=base,
)
