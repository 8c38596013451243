"""The program test_test_accelerator.py runs for test_a_device_index_out_of_range_is_refused_by_name,
which asserts what it reports."""

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

try:
    torch.empty(1, device="sac_accel:2")
except RuntimeError as error:
    message = str(error).splitlines()[0]
report(message=message, bytes=torch.accelerator.memory_allocated())
