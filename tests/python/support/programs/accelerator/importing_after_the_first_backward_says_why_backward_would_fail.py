"""The program test_test_accelerator.py runs for test_importing_after_the_first_backward_says_why_backward_would_fail,
which asserts what it reports."""

import os
import sys

import torch
from support.programs.report import report

torch.ones(1, requires_grad=True).sum().backward()
try:
    import sac_test_accelerator  # noqa: F401 - after the backward above, on purpose
except ImportError as error:
    report(message=str(error))
    sys.stdout.flush()
    os._exit(0)

report(unreachable=True)
