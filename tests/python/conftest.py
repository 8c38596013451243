import os
import threading

# The suite compares losses and gradients bitwise between a checkpointed model and an unmodified
# copy, whose buffers the allocator places differently. On some CPUs (AMD EPYC) MKL's default code
# path rounds a matmul differently depending on its operands' alignment, so the two differ in the
# last bit for reasons unrelated to checkpointing; its conditional numerical reproducibility mode
# gives the same bits whatever the alignment. Set before torch loads MKL; subprocesses inherit it.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402
import torch  # noqa: E402

# The engine suite also runs with another owner of the plugin's dispatch key loaded first (the
# coexisting path): SAC_TEST_PRELOAD_FOREIGN_OWNER names the test library that registers it.
if os.environ.get("SAC_TEST_PRELOAD_FOREIGN_OWNER"):
    torch.ops.load_library(os.environ["SAC_TEST_PRELOAD_FOREIGN_OWNER"])

import sac_plugin  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--combinations",
        choices=("default", "wide"),
        default=os.environ.get("SAC_TEST_COMBINATIONS", "default"),
        help="test_combinations.py: a fixed set of cases (default), or every combination and a hypothesis "
        "search over drawn policies (wide; also SAC_TEST_COMBINATIONS=wide)",
    )


def pytest_configure(config):
    # Kept outputs a recompute never asked for fail the test that held them (NOTE: [Served, or
    # named] in csrc/dispatch/region.cpp). Added here rather than in pytest.ini, whose filters pytest
    # resolves before this file runs: importing sac_plugin there would install its dispatch key
    # before the coexistence suite's other owner loads above.
    config.addinivalue_line("filterwarnings", "error::sac_plugin.HeldNeverServedWarning")


@pytest.fixture(autouse=True, scope="session")
def gloo_over_loopback():
    """Gloo process groups in these tests (one rank, or two spawned ranks) talk over loopback only,
    unless the environment names an interface; spawned ranks inherit the environment."""
    with pytest.MonkeyPatch.context() as patch:
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield


def _thread_state():
    return (
        repr(torch._C._dispatch_tls_local_include_set()),
        repr(torch._C._dispatch_tls_local_exclude_set()),
        sac_plugin.open_units(),
    )


@pytest.fixture(autouse=True)
def leaves_no_thread_state():
    """Every test must leave the dispatch key sets and the unit stack as it found them."""
    before = _thread_state()
    yield
    assert _thread_state() == before


@pytest.fixture
def other_thread_state():
    """Reads the key sets on a fresh thread, while the calling thread may be inside a region."""

    def read():
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(state=_thread_state()))
        thread.start()
        thread.join()
        return seen["state"]

    return read


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("native_engine")
    if marker is not None and sac_plugin.engine() != "native":
        pytest.skip(f"native engine only ({sac_plugin.engine()} engine running): {marker.args[0]}")
