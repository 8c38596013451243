"""The program test_test_accelerator.py runs for test_bad_copy_model_parameters_are_refused_by_name,
which asserts what it reports."""

import sac_test_accelerator
from support.programs.report import report

messages = []
for call in (
    lambda: sac_test_accelerator.set_copy_bandwidth(to_host=-1, to_device=None),
    lambda: sac_test_accelerator.set_copy_bandwidth(to_host=None, to_device="fast"),
    lambda: sac_test_accelerator.set_compute_scale(0.5),
):
    try:
        call()
    except ValueError as error:
        messages.append(str(error))
report(messages=messages, model=sac_test_accelerator.simulation())
