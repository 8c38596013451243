"""Audits: exact op counts per mode and phase through the audit API, queries that name their
argument, and an audit's scope on its thread (entered and exited on one thread, never counted
twice, restored when dropped)."""

import gc
import importlib

import pytest
import sac_plugin
from sac_plugin import _observers
import torch
from sac_plugin import Policy, audit
from support.thread_checks import on_another_thread, sac_key_included
from support.toy_models import assert_same_gradients, make_pair, run_step

# The module, not the package's audit() function of the same name.
audit_module = importlib.import_module("sac_plugin._audit")

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
    assert lines[0].split() == ["op", "forward", "recompute", "backward", "hits", "skipped", "never_served"]
    assert "aten::tanh 2 0 0 2 0 0" in [" ".join(line.split()) for line in lines]


def test_audit_counts_backward_on_autograd_threads():
    # The autograd engine's worker threads inherit the caller's thread-local key set.
    x = torch.randn(8, requires_grad=True)
    with sac_plugin.audit() as audit:
        torch.tanh(x).sum().backward()
    assert audit.count("aten::tanh_backward", phase="backward") == 1


# --- an audit's scope on its thread ---------------------------------------------------------------


def test_an_audit_exited_on_another_thread_is_refused_and_still_closes_on_its_own():
    a = audit()
    a.__enter__()
    try:
        error = on_another_thread(lambda: a.__exit__(None, None, None))
        assert isinstance(error, RuntimeError)
        assert str(error) == (
            "sac_plugin: exiting an audit on a thread that did not enter it; exit it on the thread that entered it "
            "(it is still running there, and nothing was changed)"
        )
        assert sac_key_included() and audit_module.any_active()
    finally:
        a.__exit__(None, None, None)
    assert not sac_key_included() and not audit_module.any_active()


def test_the_c_plus_plus_audit_refuses_a_stop_from_another_thread():
    handle = sac_plugin._C.Audit()
    handle.start()
    error = on_another_thread(handle.stop)
    assert isinstance(error, RuntimeError)
    assert str(error).startswith(
        "sac: exiting an audit on a thread that did not enter it; exit it on the thread that entered it (it is "
        "still open there, and nothing was changed)"
    )
    assert handle.running()
    handle.stop()
    assert not handle.running() and not sac_key_included()


def test_a_stray_audit_exit_is_refused_and_the_count_never_goes_negative():
    with pytest.raises(RuntimeError) as error:
        audit().__exit__(None, None, None)
    assert str(error.value) == (
        "sac_plugin: exiting an audit that is not running (never entered, or already exited); nothing was changed"
    )
    with audit() as a:
        with pytest.raises(RuntimeError):  # a second exit of a running one is still one exit
            b = audit()
            b.__exit__(None, None, None)
        model, _ = make_pair(policy=Policy())  # keeps nothing: regions exist only for audits
        run_step(model, torch.randn(4, 16))
    assert not audit_module.any_active() and not _observers.observing()
    # Full-recompute ops are reported as recompute, not as backward.
    assert a.count("aten::tanh", phase="recompute") == 2
    with pytest.raises(RuntimeError):
        a.__exit__(None, None, None)
    assert not audit_module.any_active() and not _observers.observing()


def test_an_audit_dropped_while_running_restores_the_key_set_and_the_count():
    a = audit()
    a.__enter__()
    assert sac_key_included()
    del a
    gc.collect()
    assert not sac_key_included()
    assert not audit_module.any_active() and not _observers.observing()


def test_audit_queries_name_the_op_argument():
    with audit() as a:
        pass
    with pytest.raises(TypeError) as error:
        a.count(3)
    assert str(error.value) == (
        "sac_plugin: audit: op: expected an op name such as 'aten::mm.default' or an op such as "
        "torch.ops.aten.mm.default, got 3 (int)"
    )
    with pytest.raises(ValueError) as error:
        a.hits("aten::mm\x00")
    assert str(error.value) == "sac_plugin: audit: op: an op name cannot contain a NUL character, got 'aten::mm\\x00'"
    with pytest.raises(ValueError) as error:
        a.count("aten::mm", phase=1)
    assert str(error.value) == (
        "sac_plugin: phase must be one of ('forward', 'recompute', 'backward') or None, got 1 (int)"
    )


def test_an_audit_around_the_backward_alone_counts_the_served_calls():
    model, _ = make_pair(policy=Policy(kept_units=["attn"]))
    out = model(torch.randn(4, 16))
    with sac_plugin.audit() as audit:
        out.pow(2).mean().backward()
    assert audit.hits("aten::tanh") == 2  # one kept tanh per layer, served in each recompute
    assert audit.count("aten::tanh", phase="forward") == 0
    assert audit.count("aten::addmm", phase="recompute") == 2  # the out projection, outside the unit


# --- nested audits, and each thread's own counts -------------------------------------------------


def test_nested_audits_count_what_ran_inside_each():
    x = torch.randn(8, requires_grad=True)
    with sac_plugin.audit() as outer:
        torch.tanh(x).sum().backward()
        with sac_plugin.audit() as inner:
            torch.tanh(x).sum().backward()
    assert (outer.count("aten::tanh", phase="forward"), outer.count("aten::tanh_backward", phase="backward")) == (2, 2)
    assert (inner.count("aten::tanh", phase="forward"), inner.count("aten::tanh_backward", phase="backward")) == (1, 1)


def test_audits_on_two_threads_at_once_count_their_own_thread_s_calls():
    import threading

    steps = 200
    start = threading.Barrier(2)
    counts, errors = {}, []

    def train(i):
        try:
            x = torch.randn(64, requires_grad=True)
            start.wait()
            with sac_plugin.audit() as a:
                for _ in range(steps * (i + 1)):
                    torch.tanh(x).sum().backward()
            counts[i] = (a.count("aten::tanh", phase="forward"), a.count("aten::tanh_backward", phase="backward"))
        except BaseException as error:  # noqa: BLE001 (handed to the main thread)
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert counts == {0: (steps, steps), 1: (2 * steps, 2 * steps)}
