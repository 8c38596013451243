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
    AUTOCAST,
    Case,
    accelerator_cases,
    all_cases,
    default_cases,
    failures,
    known_defect,
    observe,
    planned_calls,
)

from hypothesis import assume, given
from hypothesis import strategies as st
from support.random_steps import examples

ENGINE = sac_plugin.engine()
WIDE = pytest.mark.skipif("not config.getoption('combinations') == 'wide'", reason="--combinations=wide only")


KEEPABLE = ["aten::addmm", "aten::tanh", "aten::relu", "aten::sin"]
UNIT_NAMES = ["attn", "mlp", "*", "m*"]


@st.composite
def drawn_case(draw):
    """A case with a drawn policy (the wide run)."""
    kept_ops = draw(st.lists(st.sampled_from(KEEPABLE), unique=True, max_size=2))
    offloaded_ops = draw(
        st.lists(st.sampled_from([op for op in KEEPABLE if op not in kept_ops]), unique=True, max_size=1)
    )
    arguments = {"regions": draw(st.sampled_from(["units", "torch_remat"])), "kept_ops": kept_ops}
    if offloaded_ops:
        arguments["offloaded_ops"] = offloaded_ops
    if "aten::addmm" not in kept_ops + offloaded_ops and draw(st.booleans()):
        if draw(st.booleans()):
            arguments["every_nth_op"] = {"aten::addmm": draw(st.integers(1, 3))}
        else:
            arguments["kept_calls"] = {
                "aten::addmm.default": draw(st.lists(st.integers(0, 3), unique=True, max_size=3))
            }
    kept_units = draw(st.lists(st.sampled_from(UNIT_NAMES), unique=True, max_size=2))
    arguments["kept_units"] = kept_units
    arguments["recomputed_units"] = draw(st.lists(st.sampled_from(UNIT_NAMES), unique=True, max_size=1))
    if not kept_units:  # one unit list selects a unit: which of two wins is not this test's question
        arguments["offloaded_units"] = draw(st.lists(st.sampled_from(UNIT_NAMES), unique=True, max_size=1))
    if offloaded_ops or arguments.get("offloaded_units"):
        arguments["offload_min_bytes"] = 0
    drawn = tuple(sorted((k, _frozen(v)) for k, v in arguments.items()))
    return Case(
        "drawn",
        draw(st.booleans()),
        draw(st.sampled_from(AUTOCAST)),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        drawn,
    )


def _frozen(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value


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
@given(case=drawn_case())
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
