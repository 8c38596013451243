"""The observability table: exact op counts per mode, through the audit API."""

import pytest
import sac_plugin
import torch
from toy_models import assert_same_gradients, make_pair, run_step

MODES = {
    # mode: (policy or None for no checkpointing, tanh executions, tanh hits)
    "no_checkpointing": ("none", 2, 0),
    "full_recompute": (sac_plugin.Policy(), 4, 0),
    "attn_unit_kept": (sac_plugin.Policy(kept_units=["attn"]), 2, 2),
    "tanh_op_kept": (sac_plugin.Policy(kept_ops=["aten::tanh"]), 2, 2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_tanh_executions_per_mode(mode):
    policy, executions, hits = MODES[mode]
    model, reference = make_pair(policy=None if policy == "none" else policy, checkpoint=policy != "none")
    x = torch.randn(4, 16)
    with sac_plugin.audit() as audit:
        loss = run_step(model, x)
    assert torch.equal(loss, run_step(reference, x))
    assert audit.count("aten::tanh") == executions
    assert audit.count("aten::tanh", phase="forward") == 2
    assert audit.count("aten::tanh", phase="recompute") == executions - 2
    assert audit.count("aten::tanh", phase="backward") == 0
    assert audit.hits("aten::tanh") == hits
    assert audit.count("aten::tanh_backward", phase="backward") == 2
    assert_same_gradients(model, reference)


def test_kept_unit_serves_every_op_of_the_unit():
    model, _ = make_pair(policy=sac_plugin.Policy(kept_units=["attn"]))
    with sac_plugin.audit() as audit:
        run_step(model, torch.randn(4, 16))
    # Linear's addmm and the tanh are inside the unit; out-projection and sin are not.
    assert audit.hits("aten::addmm") == 2
    assert audit.count("aten::addmm", phase="recompute") == 2
    assert audit.count("aten::sin", phase="forward") == 2


def test_audit_accepts_op_objects_and_overload_spellings():
    with sac_plugin.audit() as audit:
        torch.tanh(torch.ones(2))
        torch.add(torch.ones(2), 1)
    assert audit.count(torch.ops.aten.tanh.default) == 1
    assert audit.count("aten::tanh.default") == 1
    assert audit.count("aten::add") == 1
    assert audit.count("aten::add.Tensor") == 1
    assert audit.count("aten::mm") == 0


def test_audit_rejects_unknown_ops_and_phases():
    with sac_plugin.audit() as audit:
        torch.tanh(torch.ones(2))
    with pytest.raises(ValueError, match=r"unknown op 'aten::tanhh'; closest registered names: aten::tanh"):
        audit.count("aten::tanhh")
    with pytest.raises(ValueError, match=r"phase must be one of \('forward', 'recompute', 'backward'\) or None"):
        audit.count("aten::tanh", phase="fwd")


def test_audit_table_lists_phases_and_hits():
    model, _ = make_pair(policy=sac_plugin.Policy(kept_ops=["aten::tanh"]))
    with sac_plugin.audit() as audit:
        run_step(model, torch.randn(4, 16))
    lines = audit.table().splitlines()
    assert lines[0].split() == ["op", "forward", "recompute", "backward", "hits"]
    assert "aten::tanh 2 0 0 2" in [" ".join(line.split()) for line in lines]


def test_audit_counts_backward_on_autograd_threads():
    # The autograd engine's worker threads inherit the caller's thread-local key set.
    x = torch.randn(8, requires_grad=True)
    with sac_plugin.audit() as audit:
        torch.tanh(x).sum().backward()
    assert audit.count("aten::tanh_backward", phase="backward") == 1
