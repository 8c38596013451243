"""The program test_test_accelerator.py runs for test_a_copy_takes_at_least_its_bytes_over_the_bandwidth_on_its_stream,
which asserts what it reports."""

import time

import sac_test_accelerator
import torch
from support.programs.report import report

# 1 MB each way: 0.2 s to the host at 5 MB/s, 0.1 s to the device at 10 MB/s.
sac_test_accelerator.set_copy_bandwidth(to_host=5e6, to_device=1e7)
side = torch.Stream(device="sac_accel")
source = torch.arange(250_000, dtype=torch.float32, device="sac_accel")
host = torch.empty(250_000, pin_memory=True)
start, copied = torch.Event(device="sac_accel", enable_timing=True), torch.Event(device="sac_accel", enable_timing=True)
with side:
    start.record()
    host.copy_(source, non_blocking=True)
    copied.record()
copied.synchronize()
to_host_ms = start.elapsed_time(copied)
back = torch.empty(250_000, dtype=torch.float32, device="sac_accel")
with side:
    start.record()
    back.copy_(host, non_blocking=True)
    copied.record()
copied.synchronize()
to_device_ms = start.elapsed_time(copied)
# A blocking copy takes the modelled time on the calling thread.
started = time.perf_counter()
plain = source.cpu()
blocking_s = time.perf_counter() - started
report(
    to_host_ms=to_host_ms >= 200,
    to_device_ms=to_device_ms >= 100,
    blocking=blocking_s >= 0.2,
    values=torch.equal(back, source) and torch.equal(plain, host),
    model=sac_test_accelerator.simulation(),
)
