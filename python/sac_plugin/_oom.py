"""The CUDA out-of-memory observer: when an allocation fails, it prints the latest running report."""

from __future__ import annotations

import torch

from ._report import running_reports

__all__ = ["install_oom_observer"]


def install_oom_observer() -> None:
    """On a failed CUDA allocation, prints its sizes and the latest running report's table.

    Opt-in; needs a CUDA build of torch and a device. Reports register themselves while they run,
    so the table printed is that of the innermost report running when the allocation failed.

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "sac_plugin: install_oom_observer needs CUDA (torch.cuda.is_available() is False); "
            "the OOM observer is a CUDA caching-allocator hook"
        )

    def observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        print(
            f"sac_plugin: CUDA out of memory on device {device}: {alloc} bytes requested, {device_alloc} "
            f"allocated, {device_free} free"
        )
        if running_reports:
            print(running_reports[-1].table())
        else:
            print("sac_plugin: no report is running; run the step inside sac_plugin.report(model) to see one")

    torch._C._cuda_attach_out_of_memory_observer(observer)
