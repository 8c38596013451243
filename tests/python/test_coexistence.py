"""Another owner of the plugin's dispatch key, loaded before sac_plugin (the future C++
FakeTensor, played by tests/support/foreign_fake_owner.cpp): the plugin still works, on its
coexisting path, and the other owner acts on exactly the calls it acts on without the plugin.

Each case runs in a fresh process, since the owner must be loaded before sac_plugin. The whole
engine suite also runs in that configuration (SAC_TEST_PRELOAD_FOREIGN_OWNER, see conftest.py).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OWNER = os.environ.get("SAC_TEST_FOREIGN_OWNER")
pytestmark = pytest.mark.skipif(
    not OWNER or not Path(OWNER).exists(),
    reason="needs SAC_TEST_FOREIGN_OWNER, the path of the built libsac_test_foreign_owner.so (tools/test.sh sets it)",
)

# Runs the same workloads before and after importing sac_plugin and reports what the owner
# acted on in each, plus whether gradients matched an unmodified model.
SCRIPT = textwrap.dedent("""
    import copy, functools, json, sys
    import torch
    from torch.utils.checkpoint import checkpoint
    torch.ops.load_library(sys.argv[1])
    owner = torch.ops.sac_test_foreign

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Sigmoid())
    x = torch.randn(4, 8)

    def run(context_fn, mode_during):
        model = copy.deepcopy(base)
        kwargs = {} if context_fn is None else {"context_fn": context_fn}
        owner.reset_counts()
        owner.set_mode(mode_during == "forward")
        out = checkpoint(model, x, use_reentrant=False, **kwargs)
        owner.set_mode(mode_during == "backward")
        out.pow(2).sum().backward()
        owner.set_mode(False)
        return owner.acted_calls(), [p.grad for p in model.parameters()]

    modes = ["none", "forward", "backward"]
    without = {mode: run(None, mode) for mode in modes}

    import sac_plugin
    policy = sac_plugin.Policy(kept_ops=["aten::addmm", "aten::tanh"])
    with_plugin = {mode: run(sac_plugin.context_fn(policy), mode) for mode in modes}
    with sac_plugin.audit() as audit:
        run(sac_plugin.context_fn(policy), "none")
    reference = copy.deepcopy(base)
    reference(x).pow(2).sum().backward()
    expected = [p.grad for p in reference.parameters()]
    print(json.dumps({
        "path": sac_plugin.interception_path(),
        "acted_without": {m: without[m][0] for m in modes},
        "acted_with": {m: with_plugin[m][0] for m in modes},
        "gradients_equal": {m: all(torch.equal(a, b) for a, b in zip(with_plugin[m][1], expected)) for m in modes},
        "hits": audit.hits("aten::addmm") + audit.hits("aten::tanh"),
    }))
""")


@pytest.fixture(scope="module")
def report():
    # The coexisting path is the native engine's: the child runs it whatever engine this run uses.
    env = {k: v for k, v in os.environ.items() if k not in ("SAC_TEST_PRELOAD_FOREIGN_OWNER", "SAC_PLUGIN_ENGINE")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, OWNER], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_works_and_takes_the_coexisting_path(report):
    assert report["path"] == "coexisting"


@pytest.mark.parametrize("mode_during", ["none", "forward", "backward"])
def test_the_owner_acts_on_the_same_calls_as_without_the_plugin(report, mode_during):
    assert report["acted_with"][mode_during] == report["acted_without"][mode_during]
    if mode_during != "none":
        assert report["acted_with"][mode_during] > 0, "the owner's mode saw nothing: the case proves nothing"


@pytest.mark.parametrize("mode_during", ["none", "forward", "backward"])
def test_gradients_are_bitwise_equal_whatever_the_owner_does(report, mode_during):
    assert report["gradients_equal"][mode_during]


def test_the_plugin_still_keeps_and_serves(report):
    assert report["hits"] == 3  # both addmm and the tanh, served in the recompute
