"""The program test_test_accelerator.py runs for test_the_backend_is_torch_accelerator,
which asserts what it reports."""

import sac_test_accelerator
import torch
from support.programs.report import report

t = torch.ones(2, device="sac_accel")
report(
    available=torch.accelerator.is_available(),
    accelerator=str(torch.accelerator.current_accelerator()),
    count=torch.accelerator.device_count(),
    device=str(t.device),
    second=str(torch.ones(1, device="sac_accel:1").device),
    generated_method=t.is_sac_accel,
    module=torch.get_device_module("sac_accel") is sac_test_accelerator,
)
