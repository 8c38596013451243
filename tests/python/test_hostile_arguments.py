"""No op in torch.ops.sac crashes the interpreter, whatever it is handed (NOTE: [An address that
comes back is checked] in csrc/dispatch/handed_out.h)."""

import pytest
import torch
from support.subprocesses import run_program

import sac_plugin  # noqa: F401 - loads the library and its ops


def test_every_op_called_with_hostile_values_raises_or_returns():
    result = run_program("hostile_arguments.py", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    last = result.stdout.strip().splitlines()[-1].split()
    assert last[0] == "calls" and int(last[1]) > 50 and last[2] == "ops" and int(last[3]) > 20, result.stdout


@pytest.mark.parametrize(
    ("call", "takes"),
    [
        (lambda: torch.ops.sac.mode_region_pass(64, 0), "the dispatch-mode engine takes the address of a mode region"),
        (
            lambda: torch.ops.sac.mode_call_end(64, [], []),
            "the dispatch-mode engine takes the address of a mode region",
        ),
        (lambda: torch.ops.sac.mode_region_new(64, 64), "mode_region_new takes the address of a checkpoint site"),
        (lambda: torch.ops.sac.mode_region_over(64, 64), "mode_region_over takes the address of a region"),
        (lambda: torch.ops.sac.region_at(64), "region_at takes the address of a region"),
    ],
    ids=["mode_region_pass", "mode_call_end", "mode_region_new", "mode_region_over", "region_at"],
)
def test_an_address_the_plugin_did_not_hand_out_is_named(call, takes):
    with pytest.raises(ValueError) as raised:
        call()
    assert str(raised.value).startswith(f"sac: {takes}")
    assert "got 64, which names none (freed, or never one)" in str(raised.value)
