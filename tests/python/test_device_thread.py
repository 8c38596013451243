"""The engines on an accelerator whose backward runs on autograd's device thread (the test
accelerator, tests/support/test_accelerator): the recompute, the unit stack re-opened around it and
the audit all happen on that thread, and gradients are the unmodified model's, bitwise."""

import pytest
from support.accelerator import SKIP_REASON, run_accelerator_program

pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
def test_backward_on_the_device_thread_recomputes_serves_and_audits_exactly(engine):
    values = run_accelerator_program("backward_on_the_device_thread.py", env={"SAC_PLUGIN_ENGINE": engine})
    assert values == {
        "engine": engine,
        "backward_on_another_thread": True,
        "same_gradients": True,
        "tanh_hits": 2,
        "tanh_recomputed": 0,
        "addmm_recomputed": 2,
        "units_left": [],
    }
