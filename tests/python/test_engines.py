"""Choosing the engine: native by default, the dispatch-mode engine when the C++ interception
cannot be installed (with one warning saying why and what it costs) or when asked for; the
dispatch-mode engine's policy function keeps the calls the policy names."""

import os
import sys
import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import Policy, _engine, _native
from torch.utils.checkpoint import checkpoint

from support import warm_interpreters


def run_python(code, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAC_")} | env
    return warm_interpreters.run_python([sys.executable, "-c", code], env=environment, timeout=120)


def test_the_native_engine_runs_by_default():
    done = run_python("import sac_plugin; print(sac_plugin.engine(), sac_plugin.interception_path())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["native", "native"]


def test_the_environment_variable_forces_the_dispatch_mode_engine():
    code = """
import torch, sac_plugin
from torch.utils.checkpoint import checkpoint
x = torch.randn(3, requires_grad=True)
with sac_plugin.audit() as audit:
    fn = sac_plugin.context_fn(sac_plugin.Policy(kept_ops=["aten::tanh"]))
    checkpoint(lambda v: torch.tanh(v).sin(), x, use_reentrant=False, context_fn=fn).sum().backward()
print(sac_plugin.engine(), audit.hits("aten::tanh"), audit.count("aten::tanh", phase="recompute"))
"""
    done = run_python(code, SAC_PLUGIN_ENGINE="dispatch_mode")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dispatch_mode", "1", "0"]
    assert "sac_plugin" not in done.stderr  # chosen on purpose: no warning


def test_an_unknown_engine_is_refused_by_name():
    done = run_python("import sac_plugin", SAC_PLUGIN_ENGINE="cuda")
    assert done.returncode != 0
    assert (
        "ImportError: sac_plugin: SAC_PLUGIN_ENGINE='cuda' is not an engine; expected one of native, "
        "dispatch_mode (or unset, to let the plugin choose)"
    ) in done.stderr


@pytest.fixture
def restores_the_engine(monkeypatch):
    # The engine is chosen once per process; these tests choose again and put it back.
    monkeypatch.setattr(_engine, "chosen", _engine.engine())


def test_a_failed_install_falls_back_with_one_warning(monkeypatch, restores_the_engine):
    def refuse():
        raise RuntimeError("the dispatch key Fake cannot be shared in this torch")

    monkeypatch.delenv("SAC_PLUGIN_ENGINE", raising=False)
    monkeypatch.setattr(_native.C, "install_fallback", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _engine.choose_engine(_native.load())
    messages = [str(w.message) for w in caught if "sac_plugin" in str(w.message)]
    assert messages == [
        "sac_plugin: the native engine cannot run in this torch (the dispatch key Fake cannot be shared in this "
        "torch); using the dispatch-mode engine, which makes the same decisions in the same C++ rule through a "
        "Python dispatch mode, at Python's per-op cost. Set SAC_PLUGIN_ENGINE=dispatch_mode to choose it explicitly."
    ]
    assert sac_plugin.engine() == "dispatch_mode"


def test_asking_for_the_native_engine_where_it_cannot_run_is_an_error(monkeypatch, restores_the_engine):
    def refuse():
        raise RuntimeError("no key")

    monkeypatch.setenv("SAC_PLUGIN_ENGINE", "native")
    monkeypatch.setattr(_native.C, "install_fallback", refuse)
    with pytest.raises(
        ImportError,
        match=r"^sac_plugin: SAC_PLUGIN_ENGINE=native, but the native engine cannot run "
        r"here: no key$",
    ):
        _engine.choose_engine(_native.load())


def _fake_key_entry(op: str) -> str:
    return next((line for line in torch._C._dispatch_dump_table(op).splitlines() if line.startswith("Fake:")), "")


def test_never_counted_ops_skip_the_key_only_on_the_native_path():
    # NOTE: [Calls that never count skip the key]: a fallthrough for detach and the metadata
    # queries on the native path; on the coexisting path the other owner still gets them.
    entry = _fake_key_entry("aten::detach")
    if sac_plugin.interception_path() == "native":
        assert entry.startswith("Fake: fallthrough sac_plugin: never counted, skips the key"), entry
    else:
        assert "never counted" not in entry, entry
    # Counted ops keep reaching the fallback (native) or the plugin's per-op kernel (coexisting).
    assert "fallthrough" not in _fake_key_entry("aten::mm")


@pytest.mark.parametrize("op", ["aten::mm", "aten::add.Tensor", "aten::mul.Tensor", "aten::tanh", "aten::silu"])
def test_hot_ops_reach_the_plugin_unboxed_only_on_the_native_path(op):
    # NOTE: [Hot ops skip boxing]: an unboxed kernel of the plugin's on the key; on the coexisting
    # path the plugin's per-op kernels are boxed, as the other owner's calls arrive boxed.
    entry = _fake_key_entry(op)
    if sac_plugin.interception_path() == "native":
        assert "hot_op_kernels.cpp" in entry and entry.endswith("[kernel]"), entry
    else:
        assert "hot_op_kernels.cpp" not in entry, entry


def test_a_hot_op_that_fails_in_a_region_leaves_its_arguments_to_their_owners():
    # NOTE: [Hot ops skip boxing]: the call pipeline borrows the arguments of a hot op; a kernel
    # that raises, in the forward and again in the recompute, must release them, not free them.
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    wrong = torch.randn(5, 6)
    wrong_before = wrong.clone()

    def layer(x, w):
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(3x4 and 5x6\)"):
            torch.mm(x, wrong)
        return torch.mm(x, w).tanh().mul(x).sum()

    expected = torch.autograd.grad(layer(x, w), (x, w))
    with sac_plugin.audit() as audit:
        loss = checkpoint(
            layer, x, w, use_reentrant=False, context_fn=sac_plugin.context_fn(Policy(kept_ops=["aten::mm"]))
        )
        grads = torch.autograd.grad(loss, (x, w))
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert audit.hits("aten::mm") == 1
    assert torch.equal(wrong, wrong_before)
