"""Another owner of the plugin's dispatch key, loaded before sac_plugin (the future C++
FakeTensor, played by tests/support/foreign_fake_owner.cpp): the plugin still works, on its
coexisting path, and the other owner acts on exactly the calls it acts on without the plugin.

Each case runs in a fresh process, since the owner must be loaded before sac_plugin. The whole
engine suite also runs in that configuration (SAC_TEST_PRELOAD_FOREIGN_OWNER, see conftest.py).
"""

import json
import os
from pathlib import Path

import pytest
from support.subprocesses import run_program

OWNER = os.environ.get("SAC_TEST_FOREIGN_OWNER")
pytestmark = pytest.mark.skipif(
    not OWNER or not Path(OWNER).exists(),
    reason="needs SAC_TEST_FOREIGN_OWNER, the path of the built libsac_test_foreign_owner.so (tools/test.sh sets it)",
)


@pytest.fixture(scope="module")
def report():
    # The coexisting path is the native engine's: the child runs it whatever engine this run uses.
    done = run_program("coexisting_owner.py", OWNER, drop=("SAC_TEST_PRELOAD_FOREIGN_OWNER", "SAC_PLUGIN_ENGINE"))
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
