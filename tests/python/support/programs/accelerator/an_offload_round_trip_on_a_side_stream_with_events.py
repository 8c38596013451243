"""The program test_test_accelerator.py runs for test_an_offload_round_trip_on_a_side_stream_with_events,
which asserts what it reports."""

import threading

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

default = torch.accelerator.current_stream()
side = torch.Stream(device="sac_accel")
activation = torch.randn(64, device="sac_accel")
expected = activation.cpu()
host = torch.empty(64, pin_memory=True)
copied = torch.Event(device="sac_accel", enable_timing=True)
start = torch.Event(device="sac_accel", enable_timing=True)
side.wait_stream(default)
with side:
    current_inside = torch.accelerator.current_stream()
    seen_by_another_thread = []
    worker = threading.Thread(target=lambda: seen_by_another_thread.append(torch.accelerator.current_stream()))
    worker.start()
    worker.join()
    start.record()
    host.copy_(activation, non_blocking=True)
    copied.record()
activation.record_stream(side)  # the side stream still reads it after the free below
default.wait_event(copied)
del activation
freed = torch.accelerator.memory_allocated()
copied.synchronize()
back = host.to("sac_accel", non_blocking=True)
side.synchronize()
torch.accelerator.synchronize()
report(
    side_is_not_default=side != default,
    current_inside=current_inside == side,
    other_thread_default=seen_by_another_thread[0] == default,
    restored=torch.accelerator.current_stream() == default,
    query=copied.query(),
    stream_idle=side.query(),
    elapsed_ms_nonnegative=start.elapsed_time(copied) >= 0,
    freed=freed,
    round_trip=torch.equal(back.cpu(), expected),
)
