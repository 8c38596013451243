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
    # named] in csrc/dispatch/kept_outputs.cpp). Added here rather than in pytest.ini, whose filters pytest
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


# NOTE: [Which runs a test module needs]
# tools/test.sh runs the suite in three engine configurations (the native engine, the coexisting
# path, the dispatch-mode engine) and CI runs it again on the oldest and newest supported torch. A
# module runs in every one of those runs unless it is named below, so a new module is covered
# everywhere until someone decides otherwise here:
#   ENGINE_INDEPENDENT  what it checks comes out the same whichever engine the run chose (text, file
#                       formats, command lines, tools, benchmark smoke tests whose tools start each
#                       engine themselves): marked `engine_independent`, it runs in the native-engine
#                       run only (tools/test.sh's other two runs deselect it).
#   TORCH_INDEPENDENT   the docs, the CLI's arguments, the repository's tools and the benchmark smoke
#                       tests: a failure there on another torch would name the docs or a tool, while
#                       anything that reaches torch's internals (the engines, torch.compile,
#                       torch.utils.checkpoint, FSDP/DTensor, offloading, the test accelerator,
#                       transformers, op registrations, installing against a torch) is
#                       version-sensitive and stays. Marked `torch_independent`, it runs on the
#                       default torch only (CI's other torch versions deselect it, SAC_TEST_SUITE in
#                       tools/test.sh).
#   STARTS_EACH_ENGINE  each case starts every engine itself, in a fresh process with
#                       SAC_PLUGIN_ENGINE set, so the dispatch-mode run would repeat the native run
#                       exactly; the coexisting run still differs (its processes inherit the other
#                       owner of the key). Marked `starts_each_engine`, the dispatch-mode run
#                       deselects it.
#   OVER_THE_ENGINES    features built over the engines' mechanics (the planner, reports, Hugging
#                       Face models, fine-tuning, the combination matrix, property-based steps):
#                       they reach torch through the same engine code the rest of the suite tests
#                       call by call. Marked `over_the_engines`, they run in every engine on the
#                       default torch and in the native engine on the other torch versions, whose
#                       coexisting and dispatch-mode runs test the mechanics (SAC_TEST_SUITE in
#                       tools/test.sh): a torch change that breaks an engine shows there first.
ENGINE_INDEPENDENT = frozenset(
    {
        "test_bench_offload_simulation",
        "test_benchmarks_and_examples",
        "test_ci_selection",
        "test_ci_summary",
        "test_cli",
        "test_docs",
        "test_glossary",
        "test_gpu_check",
        "test_hostile_arguments",
        "test_install",
        "test_layers",
        "test_library",
        "test_public_api",
        "test_target_maps",
        "test_warm_interpreters",
    }
)
# Of those, the ones that do not check torch itself: install, library and target maps read torch's
# version and op names, the hostile-argument calls reach the ops torch registers, and the warm
# interpreters fork only where torch's import starts no thread.
TORCH_INDEPENDENT = ENGINE_INDEPENDENT - {
    "test_hostile_arguments",
    "test_install",
    "test_library",
    "test_target_maps",
    "test_warm_interpreters",
}
STARTS_EACH_ENGINE = frozenset({"test_dispatch_mode_data_flow"})
OVER_THE_ENGINES = frozenset(
    {
        "test_combinations",
        "test_fine_tuning",
        "test_huggingface_models",
        "test_plan_matches_runtime",
        "test_plan_step",
        "test_planner",
        "test_planner_offload",
        "test_property",
        "test_report",
    }
)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(items):
    for item in items:
        module = item.path.stem
        if module in ENGINE_INDEPENDENT:
            item.add_marker(pytest.mark.engine_independent)
        if module in TORCH_INDEPENDENT:
            item.add_marker(pytest.mark.torch_independent)
        if module in STARTS_EACH_ENGINE:
            item.add_marker(pytest.mark.starts_each_engine)
        if module in OVER_THE_ENGINES:
            item.add_marker(pytest.mark.over_the_engines)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("native_engine")
    if marker is not None and sac_plugin.engine() != "native":
        pytest.skip(f"native engine only ({sac_plugin.engine()} engine running): {marker.args[0]}")
