"""The test accelerator (tests/support/test_accelerator): a PrivateUse1 backend over host memory.

Each test runs in a fresh interpreter: autograd starts its per-device threads once per process,
counting the devices registered at that moment, so the backend must be loaded before the first
backward of the process, and the pytest process has run many backwards by now. Each test's program
is a file of support/programs/accelerator named after the test.
"""

import subprocess
import sys

import pytest
from support.accelerator import SKIP_REASON, accelerator_environment, run_accelerator_program

# slow: each test starts an interpreter; and the backend does not depend on the plugin's engine, so
# tools/test.sh's passes with another engine (-m "not slow") need not run it again.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


def test_the_backend_is_torch_accelerator():
    values = run_accelerator_program("the_backend_is_torch_accelerator.py")
    assert values == {
        "available": True,
        "accelerator": "sac_accel",
        "count": 2,
        "device": "sac_accel:0",
        "second": "sac_accel:1",
        "generated_method": True,
        "module": True,
    }


def test_a_training_step_on_the_device_matches_the_cpu_bitwise():
    values = run_accelerator_program("a_training_step_on_the_device_matches_the_cpu_bitwise.py")
    assert values == {
        "devices": ["sac_accel:0"],
        "grad_devices": ["sac_accel:0"],
        "unequal_grads": [],
        "unequal_params": [],
        "losses_equal": True,
    }


def test_memory_allocated_counts_the_bytes_of_each_tensor():
    values = run_accelerator_program("memory_allocated_counts_the_bytes_of_each_tensor.py")
    assert values == {
        "grew": 4000,
        "device_1": 80,
        "unchanged_0": 4000,
        "dropped": 4000,
        "peak": 4000,
        "peak_after_reset": 0,
        "live_allocations": 0,
        "base": 0,
    }


def test_storage_resize_frees_and_reallocates_device_memory():
    values = run_accelerator_program("storage_resize_frees_and_reallocates_device_memory.py")
    assert values == {"full": 1024, "emptied": 0, "refilled": 1024, "values_back": True}


def test_views_share_device_memory():
    values = run_accelerator_program("views_share_device_memory.py")
    assert values == {"base": [1.0, 5.0, 1.0, 5.0, 1.0, 5.0], "shares": True, "bytes": 24}


def test_pinned_host_tensors_are_pinned():
    values = run_accelerator_program("pinned_host_tensors_are_pinned.py")
    assert values == {
        "plain": False,
        "pinned": True,
        "empty_pinned": True,
        "pinned_device": "cpu",
        "copied": True,
        "device_bytes": 16,
    }


def test_an_offload_round_trip_on_a_side_stream_with_events():
    values = run_accelerator_program("an_offload_round_trip_on_a_side_stream_with_events.py")
    assert values == {
        "side_is_not_default": True,
        "current_inside": True,
        "other_thread_default": True,
        "restored": True,
        "query": True,
        "stream_idle": True,
        "elapsed_ms_nonnegative": True,
        "freed": 0,
        "round_trip": True,
    }


def test_backward_runs_on_a_device_thread_of_its_own():
    values = run_accelerator_program("backward_runs_on_a_device_thread_of_its_own.py")
    assert values == {
        "cpu_on_caller": True,
        "device_0_elsewhere": True,
        "device_1_elsewhere": True,
        "one_thread_per_device": True,
    }


def test_a_device_index_out_of_range_is_refused_by_name():
    values = run_accelerator_program("a_device_index_out_of_range_is_refused_by_name.py")
    assert values == {"message": "sac_test_accelerator: device index 2 is out of range; devices are 0..1", "bytes": 0}


def test_importing_after_the_first_backward_says_why_backward_would_fail():
    values = run_accelerator_program("importing_after_the_first_backward_says_why_backward_would_fail.py")
    assert values == {
        "message": (
            "sac_test_accelerator was imported after this process ran its first backward: autograd starts its device "
            "threads once, counting the devices registered then, so it has none for sac_accel; import "
            "sac_test_accelerator before any backward (the device stays registered, but backward on it fails in this "
            "process)"
        )
    }


def test_queued_copies_show_a_missing_wait_or_record_stream():
    values = run_accelerator_program("queued_copies_show_a_missing_wait_or_record_stream.py")
    assert values == {
        "early": [0.0] * 4,
        "query_early": False,
        "waited": [1.0] * 4,
        "unrecorded": ["nan"] * 4,
        "recorded": [1.0] * 4,
        "unpinned": [1.0] * 4,
        "bytes": 0,
    }


def test_the_copy_delay_must_be_a_number_of_seconds():
    values = run_accelerator_program("the_copy_delay_must_be_a_number_of_seconds.py")
    assert values == {"message": "sac_test_accelerator.set_copy_delay: seconds must be a number >= 0, got -1"}


def test_a_copy_takes_at_least_its_bytes_over_the_bandwidth_on_its_stream():
    values = run_accelerator_program("a_copy_takes_at_least_its_bytes_over_the_bandwidth_on_its_stream.py")
    assert values == {
        "to_host_ms": True,
        "to_device_ms": True,
        "blocking": True,
        "values": True,
        "model": {"bandwidth_to_host": 5e6, "bandwidth_to_device": 1e7, "compute_scale": 1.0},
    }


def test_a_modelled_copy_blocks_only_the_streams_that_wait_on_its_event():
    values = run_accelerator_program("a_modelled_copy_blocks_only_the_streams_that_wait_on_its_event.py")
    assert values == {
        "in_flight_after_compute": True,
        "computed": True,
        "done_after_wait": True,
        "after_wait": 500_000.0,
        "host": 250_000.0,
    }


def test_the_compute_scale_stretches_kernels_and_leaves_their_values():
    values = run_accelerator_program("the_compute_scale_stretches_kernels_and_leaves_their_values.py")
    assert values == {
        "stretched": True,
        "bitwise": True,
        "reset": 1.0,
        "model": {"bandwidth_to_host": None, "bandwidth_to_device": None, "compute_scale": 20.0},
    }


def test_the_copy_model_is_read_from_the_environment():
    values = run_accelerator_program(
        "the_copy_model_is_read_from_the_environment.py",
        env={
            "SAC_TEST_ACCELERATOR_BANDWIDTH_TO_HOST": "2e9",
            "SAC_TEST_ACCELERATOR_BANDWIDTH_TO_DEVICE": "3e9",
            "SAC_TEST_ACCELERATOR_COMPUTE_SCALE": "1.5",
        },
    )
    assert values == {"model": {"bandwidth_to_host": 2e9, "bandwidth_to_device": 3e9, "compute_scale": 1.5}}


def test_bad_copy_model_parameters_are_refused_by_name():
    values = run_accelerator_program("bad_copy_model_parameters_are_refused_by_name.py")
    assert values == {
        "messages": [
            "sac_test_accelerator.set_copy_bandwidth: to_host must be a number of bytes per second > 0, or None (copies "
            "as fast as the memcpy), got -1",
            "sac_test_accelerator.set_copy_bandwidth: to_device must be a number of bytes per second > 0, or None (copies "
            "as fast as the memcpy), got 'fast'",
            "sac_test_accelerator.set_compute_scale: scale must be a number >= 1, got 0.5",
        ],
        "model": {"bandwidth_to_host": None, "bandwidth_to_device": None, "compute_scale": 1.0},
    }


def test_a_copy_model_in_the_environment_that_is_not_a_number_is_refused_by_name():
    program = "try:\n    import sac_test_accelerator\nexcept ImportError as error:\n    print(error)\n"
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
        env=accelerator_environment({"SAC_TEST_ACCELERATOR_COMPUTE_SCALE": "quick"}),
    )
    assert (
        result.stdout.strip()
        == "sac_test_accelerator: SAC_TEST_ACCELERATOR_COMPUTE_SCALE must be a number, got 'quick'"
    )
