"""The program test_test_accelerator.py runs for test_pinned_host_tensors_are_pinned,
which asserts what it reports."""

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

plain = torch.randn(4)
pinned = plain.pin_memory()
empty_pinned = torch.empty(4, pin_memory=True)
device = plain.to("sac_accel")
empty_pinned.copy_(device, non_blocking=True)  # queued on the current stream
torch.accelerator.current_stream().synchronize()
report(
    plain=plain.is_pinned(),
    pinned=pinned.is_pinned(),
    empty_pinned=empty_pinned.is_pinned(),
    pinned_device=str(pinned.device),
    copied=torch.equal(empty_pinned, plain),
    device_bytes=torch.accelerator.memory_allocated(),
)
