"""The features in combination (support/combinations.py): every selection, with and without
offloaded inputs, under autocast or not, nested, with dropout and with a second backward. Each case
must give gradients bitwise those of the unmodified block, serve every call the rule keeps or
offloads (the audit's hits are what the policy keeps in this block, and nothing is held and never
served), hold exactly those calls' outputs, and hold nothing once its backward is done.

The default run is a fixed set of cases; `--combinations=wide` (or SAC_TEST_COMBINATIONS=wide)
runs every combination and a hypothesis search over drawn policies too. Cases that fail for a
defect outside the tests are listed in support/combinations.py's KNOWN_DEFECTS."""

import dataclasses

import pytest
import sac_plugin
from support.accelerator import SKIP_REASON, run_on_accelerator
from support.combinations import (
    accelerator_cases,
    all_cases,
    default_cases,
    drawn_cases,
    failures,
    known_defect,
    observe,
    planned_calls,
)

from hypothesis import assume, given
from support.random_steps import examples

ENGINE = sac_plugin.engine()
WIDE = pytest.mark.skipif("not config.getoption('combinations') == 'wide'", reason="--combinations=wide only")


def _params(cases, device="cpu"):
    params = []
    for case in cases:
        defect = known_defect(case, ENGINE, device)
        marks = [pytest.mark.xfail(strict=True, reason=defect.reason)] if defect is not None else []
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        wide = metafunc.config.getoption("combinations") == "wide"
        metafunc.parametrize("case", _params(all_cases() if wide else default_cases()))
    if "accelerator_case" in metafunc.fixturenames:
        metafunc.parametrize("accelerator_case", _params(accelerator_cases(), "sac_accel"))


def test_a_combination_is_served_and_bitwise(case):
    assert failures(observe(case)) == []


@WIDE
@examples(200, shrink=False)
@given(case=drawn_cases())
def test_a_drawn_combination_is_served_and_bitwise(case):
    assume(known_defect(case, ENGINE) is None)  # the listed defects are the fixed cases' to show
    assert failures(observe(case)) == []


@pytest.fixture(scope="module")
def on_the_accelerator():
    """Every accelerator case, observed in one fresh interpreter that loaded the test accelerator
    before its first backward (support/accelerator.py)."""
    cases = [dataclasses.astuple(case) for case in accelerator_cases()]
    return run_on_accelerator(
        f"""
from support.combinations import observe_many
report(**observe_many({cases!r}, "sac_accel", {planned_calls()!r}))
"""
    )


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_a_combination_on_the_accelerator_is_served_and_bitwise(on_the_accelerator, accelerator_case):
    # Offloaded outputs and inputs leave the device here (on the CPU, offloading is keeping).
    assert failures(on_the_accelerator[accelerator_case.id]) == []
