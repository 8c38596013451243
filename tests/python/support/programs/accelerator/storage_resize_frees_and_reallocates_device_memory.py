"""The program test_test_accelerator.py runs for test_storage_resize_frees_and_reallocates_device_memory,
which asserts what it reports."""

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

t = torch.arange(256, dtype=torch.float32, device="sac_accel")
full = torch.accelerator.memory_allocated()
t.untyped_storage().resize_(0)
emptied = torch.accelerator.memory_allocated()
t.untyped_storage().resize_(1024)
t.copy_(torch.arange(256, dtype=torch.float32))
report(
    full=full,
    emptied=emptied,
    refilled=torch.accelerator.memory_allocated(),
    values_back=torch.equal(t.cpu(), torch.arange(256, dtype=torch.float32)),
)
