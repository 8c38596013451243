"""The program test_test_accelerator.py runs for test_the_copy_model_is_read_from_the_environment,
which asserts what it reports."""

import sac_test_accelerator
from support.programs.report import report

report(model=sac_test_accelerator.simulation())
