"""The program test_test_accelerator.py runs for test_the_copy_delay_must_be_a_number_of_seconds,
which asserts what it reports."""

import sac_test_accelerator
from support.programs.report import report

try:
    sac_test_accelerator.set_copy_delay(-1)
except ValueError as error:
    report(message=str(error))
