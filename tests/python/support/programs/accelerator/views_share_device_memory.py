"""The program test_test_accelerator.py runs for test_views_share_device_memory,
which asserts what it reports."""

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

base = torch.zeros(6, device="sac_accel")
windows = base.unfold(0, 2, 2)  # a view the CPU backend implements, through the fallback
windows.add_(1)
column = base.view(3, 2)[:, 1]
column.mul_(5)
report(
    base=base.cpu().tolist(), shares=windows.data_ptr() == base.data_ptr(), bytes=torch.accelerator.memory_allocated()
)
