"""The test accelerator: a PrivateUse1 backend named ``sac_accel`` whose memory is host memory.

Importing this package loads the backend's library (``libsac_test_accelerator.so``, next to this
file, or the path in ``SAC_TEST_ACCELERATOR_LIBRARY``) and registers the device with torch:
tensors live on ``sac_accel:0`` and ``sac_accel:1``, ``torch.accelerator`` reports it (memory
statistics, streams, events), pinned host memory comes from its host allocator, and autograd runs
backward for it on a device thread of its own, as for CUDA. Every op runs the CPU kernel on the
same memory, so results are bitwise those of the CPU. Ops run when called, after the work queued
on their stream; a non_blocking copy between the device and pinned host memory is queued on the
current stream's worker thread and runs later (after set_copy_delay's delay), so a missing wait
on its event or stream, or a missing Tensor.record_stream before freeing its source (the freed
block is poisoned with NaNs), shows in the values copied.

For timing, the device can be given a speed (set_copy_bandwidth, set_compute_scale, or the
environment variables SAC_TEST_ACCELERATOR_BANDWIDTH_TO_HOST, SAC_TEST_ACCELERATOR_BANDWIDTH_TO_DEVICE
(bytes/s) and SAC_TEST_ACCELERATOR_COMPUTE_SCALE, read at import): a copy of N bytes between the
device and host memory at B bytes/s takes at least N / B seconds on its stream, and every kernel
takes its CPU time times the scale, so that the ratio of copy to compute time can be a GPU's.

Autograd starts its device threads once per process, counting the devices registered at that
moment: import this package before the process's first backward (importing it later raises
ImportError, saying so). A process that exits right after a backward on the device can abort on
the way out ("terminate called without an active exception"): a device thread still letting go of
the graph reaches for the GIL while the interpreter finalizes, a race in torch's exit path that
every accelerator with device threads shares. Test scripts end with os._exit after reporting.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

__all__ = [
    "get_amp_supported_dtype",
    "BACKEND",
    "current_device",
    "device",
    "device_count",
    "get_rng_state",
    "is_available",
    "is_initialized",
    "library_path",
    "manual_seed",
    "manual_seed_all",
    "set_compute_scale",
    "set_copy_bandwidth",
    "set_copy_delay",
    "set_device",
    "set_rng_state",
    "simulation",
    "synchronize",
]

BACKEND = "sac_accel"
_LIBRARY_NAME = "libsac_test_accelerator.so"


def library_path() -> Path:
    """The backend's library: SAC_TEST_ACCELERATOR_LIBRARY, else the one next to this file."""
    configured = os.environ.get("SAC_TEST_ACCELERATOR_LIBRARY")
    path = Path(configured) if configured else Path(__file__).with_name(_LIBRARY_NAME)
    if not path.is_file():
        raise ImportError(
            f"sac_test_accelerator: no library at {path}; build it with the tests "
            "(bash tools/build.sh) or install it with bash tools/build_test_accelerator.sh"
        )
    return path


# The device module torch.get_device_module("sac_accel") returns. torch.accelerator asks it for
# is_available and device_count, and the backend's C++ hooks and device guard for the rest; the
# other functions are for code that asks the module (e.g. torch.utils.checkpoint saving and
# restoring device RNG state). Nothing here may call torch.accelerator.is_available or
# torch.accelerator.device_count, which would call back here.
def is_available() -> bool:
    return True  # the library is loaded (this module registers only after loading it)


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False  # no driver state: a forked child can use the device as its parent did


def device_count() -> int:
    return torch.ops.sac_test_accelerator.device_count()


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(index: int | str | torch.device) -> None:
    torch.accelerator.set_device_index(index)


def synchronize(index: int | str | torch.device | None = None) -> None:
    torch.accelerator.synchronize(index)


@contextlib.contextmanager
def device(index: int | str | torch.device | None):
    """Makes ``index`` the current device inside the block (None leaves it as it is)."""
    if index is None:
        yield
        return
    previous = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(index)
    try:
        yield
    finally:
        torch.accelerator.set_device_index(previous)


# The backend has no generator of its own: its kernels are the CPU kernels and draw from the CPU
# generator. Its RNG state is therefore the CPU generator's state.
def get_rng_state(device: int | str | torch.device = BACKEND) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: int | str | torch.device = BACKEND) -> None:
    torch.set_rng_state(new_state)


def manual_seed(seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes autocast may cast to on this device (torch.utils.checkpoint asks, to restore
    the forward's autocast state around the recompute)."""
    return [torch.float16, torch.bfloat16]


def set_copy_delay(seconds: float, *, from_wait: bool = False) -> None:
    """Each queued (non_blocking) copy waits this long on its stream before it runs, so that a
    test reading its destination too early reliably sees the old values. 0 (the default) runs
    queued copies as soon as their stream reaches them.

    With ``from_wait=True`` a queued copy is held until something waits on its stream (a stream or
    the host waiting on an event recorded there, or a synchronize), and the delay starts then: each
    such wait lasts at least the delay, however long the host took before it waited."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        raise ValueError(f"sac_test_accelerator.set_copy_delay: seconds must be a number >= 0, got {seconds!r}")
    if not isinstance(from_wait, bool):
        raise ValueError(f"sac_test_accelerator.set_copy_delay: from_wait must be True or False, got {from_wait!r}")
    torch.ops.sac_test_accelerator.set_copy_delay_us(round(seconds * 1_000_000), from_wait)


def _bandwidth(value, name: str) -> float:
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(
            f"sac_test_accelerator.set_copy_bandwidth: {name} must be a number of bytes per second > 0, "
            f"or None (copies as fast as the memcpy), got {value!r}"
        )
    return float(value)


def set_copy_bandwidth(to_host: float | None, to_device: float | None) -> None:
    """A copy of N bytes between the device and host memory takes at least N / bandwidth seconds
    on its stream (non_blocking copies; blocking ones on the calling thread): device to host at
    ``to_host`` bytes/s, host to device at ``to_device``. None leaves that direction as fast as
    the memcpy, the default. Work queued behind a copy on its stream waits for it; other streams
    wait only where they wait on its event or stream."""
    torch.ops.sac_test_accelerator.set_copy_bandwidth(
        _bandwidth(to_host, "to_host"), _bandwidth(to_device, "to_device")
    )


def set_compute_scale(scale: float) -> None:
    """Every kernel takes its CPU time times ``scale`` (>= 1; 1, the default, leaves kernels as
    they are), so that copies and compute can keep a GPU's ratio on a CPU of another speed."""
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 1 <= scale < float("inf"):
        raise ValueError(f"sac_test_accelerator.set_compute_scale: scale must be a number >= 1, got {scale!r}")
    torch.ops.sac_test_accelerator.set_compute_scale(float(scale))


def simulation() -> dict:
    """The copy and compute model in force: bytes/s each way (None: not modelled) and the scale."""
    to_host, to_device, scale = torch.ops.sac_test_accelerator.simulation_parameters()
    return {"bandwidth_to_host": to_host or None, "bandwidth_to_device": to_device or None, "compute_scale": scale}


_ENVIRONMENT = (
    "SAC_TEST_ACCELERATOR_BANDWIDTH_TO_HOST",
    "SAC_TEST_ACCELERATOR_BANDWIDTH_TO_DEVICE",
    "SAC_TEST_ACCELERATOR_COMPUTE_SCALE",
)


def _configure_from_environment() -> None:
    """The model from the environment, so that a script that does not know the device can be
    timed under it; a value that is not a number is refused by name."""
    values = {}
    for name in _ENVIRONMENT:
        text = os.environ.get(name)
        if text is None or text == "":
            continue
        try:
            values[name] = float(text)
        except ValueError:
            raise ImportError(f"sac_test_accelerator: {name} must be a number, got {text!r}") from None
    try:
        if _ENVIRONMENT[0] in values or _ENVIRONMENT[1] in values:
            set_copy_bandwidth(values.get(_ENVIRONMENT[0]), values.get(_ENVIRONMENT[1]))
        if _ENVIRONMENT[2] in values:
            set_compute_scale(values[_ENVIRONMENT[2]])
    except ValueError as error:
        raise ImportError(f"sac_test_accelerator: from the environment: {error}") from None


def _register() -> None:
    import sys

    if torch._C._get_privateuse1_backend_name() == BACKEND:
        return  # loaded already (a second import under another module name)
    torch.ops.load_library(str(library_path()))
    torch.utils.rename_privateuse1_backend(BACKEND)
    torch._register_device_module(BACKEND, sys.modules[__name__])
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    _check_autograd_has_device_threads()
    _configure_from_environment()


def _check_autograd_has_device_threads() -> None:
    """A backward on each device, so that a process whose autograd engine started before the
    backend was registered (it then has no thread for these devices) hears it here, by name,
    rather than from an internal assertion in its first backward on the device."""
    for index in range(device_count()):
        # Tensors without elements: the device thread lets go of a graph's tensors a moment after
        # the backward returns, and these hold no bytes that the memory statistics would count.
        leaf = torch.empty(0, device=f"{BACKEND}:{index}", requires_grad=True)
        try:
            torch.autograd.grad(leaf * 2, leaf, torch.empty(0, device=leaf.device))
        except RuntimeError as error:
            if "device_ready_queues_" not in str(error):
                raise
            raise ImportError(
                "sac_test_accelerator was imported after this process ran its first backward: autograd "
                "starts its device threads once, counting the devices registered then, so it has none for "
                f"{BACKEND}; import sac_test_accelerator before any backward (the device stays registered, "
                "but backward on it fails in this process)"
            ) from None


_register()
