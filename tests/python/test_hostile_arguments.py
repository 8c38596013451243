"""No op in torch.ops.sac and no function of sac_plugin._C crashes the interpreter, whatever it is
handed (NOTE: [A handle that comes back is checked] in csrc/dispatch/handed_out.h; NOTE: [One
extension module] in csrc/bindings/python_module.cpp)."""

import re
from pathlib import Path

import pytest
import torch
from support.subprocesses import run_program

import sac_plugin
from sac_plugin import Policy, _native
from sac_plugin.checkpointing import Region

_C = _native.C


def test_every_op_and_function_called_with_hostile_values_raises_or_returns():
    result = run_program("hostile_arguments.py", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    last = result.stdout.strip().splitlines()[-1].split()
    assert last[0] == "calls" and int(last[1]) > 1000, result.stdout
    assert last[2] == "ops" and int(last[3]) > 10, result.stdout
    assert last[4] == "functions" and int(last[5]) > 60, result.stdout


@pytest.mark.parametrize(
    ("call", "takes"),
    [
        (lambda: torch.ops.sac.mode_region_pass(64, 0), "the dispatch-mode engine takes the handle of a mode region"),
        (
            lambda: torch.ops.sac.mode_call_end(64, [], []),
            "the dispatch-mode engine takes the handle of a mode region",
        ),
        (lambda: torch.ops.sac.mode_call_begin(64, 64, 0, [], [], False), "the dispatch-mode engine takes the handle"),
        (lambda: torch.ops.sac.region_kept_tensors(64), "region_kept_tensors takes the handle of a region"),
    ],
    ids=["mode_region_pass", "mode_call_end", "mode_call_begin", "region_kept_tensors"],
)
def test_a_handle_the_plugin_did_not_hand_out_is_named(call, takes):
    with pytest.raises(ValueError) as raised:
        call()
    assert str(raised.value).startswith(f"sac: {takes}")
    assert "got 64, which names none (freed, or never one)" in str(raised.value)


def test_a_handle_is_a_serial_number_not_an_address():
    region = Region(Policy(kept_ops=["aten::mm"]))
    handle = region.forward.region.handle
    assert 0 < handle < 2**32
    assert Region(Policy()).forward.region.handle > handle
    assert torch.ops.sac.region_kept_tensors(handle) == []


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: _C.Site(object()), TypeError, "sac: Site needs a _C.Policy (sac_plugin.Policy holds one)"),
        (lambda: _C.CallDecider(64), TypeError, "sac: CallDecider needs a _C.Policy (sac_plugin.Policy holds one)"),
        (
            lambda: _C.policy_decide(64, 64, (), 0, 0),
            TypeError,
            "sac: policy_decide needs a _C.Policy (sac_plugin.Policy holds one)",
        ),
        (
            lambda: _C.policy_decide(Policy()._handle, 64, (), 0, 0),
            TypeError,
            "sac: a decision needs an OpEntry (op_entry(name))",
        ),
        (lambda: _C.unit_push(2**40), ValueError, f"sac: no recompute unit has id {2**40 - 1}"),
        (lambda: _C.unit_pop(_C.unit_id("attn"), 0), ValueError, "sac: unit depth must be positive, got 0"),
        (lambda: _C.op_entry(64), TypeError, "sac: an op name must be a str, got int"),
        (
            lambda: Region(Policy()).forward.region.mode_region_over(64),
            TypeError,
            "sac: mode_region_over needs a _C.Region",
        ),
        (lambda: _C.offload_placement(1, 2, 3), TypeError, "sac: offload_placement takes 4 ints, got 3 arguments"),
    ],
    ids=["site", "decider", "policy_decide", "op_entry", "unit_push", "unit_pop", "op_name", "mode_over", "placement"],
)
def test_the_extension_module_names_what_it_was_given(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value) == message


def test_no_module_of_the_package_imports_ctypes():
    package = Path(sac_plugin.__file__).parent
    importing = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if re.search(r"^\s*(import ctypes|from ctypes\b)", path.read_text(), re.MULTILINE)
    ]
    assert importing == []
