"""The program test_test_accelerator.py runs for test_a_modelled_copy_blocks_only_the_streams_that_wait_on_its_event,
which asserts what it reports."""

import sac_test_accelerator
import torch
from support.programs.report import report

# 1 MB to the host at 1 MB/s: the copy is in flight for a second.
sac_test_accelerator.set_copy_bandwidth(to_host=1e6, to_device=None)
default, side = torch.accelerator.current_stream(), torch.Stream(device="sac_accel")
source = torch.ones(250_000, device="sac_accel")
host = torch.zeros(250_000, pin_memory=True)
with side:
    host.copy_(source, non_blocking=True)
    copied = side.record_event()
# Compute on the default stream runs while the copy is in flight.
product = torch.randn(64, 64, device="sac_accel") @ torch.randn(64, 64, device="sac_accel")
computed = product.sum().item()
in_flight_after_compute = not copied.query()
# Once the default stream waits on the copy's event, its next op runs after the copy.
default.wait_event(copied)
after_wait = (source + 1).sum().item()
done_after_wait = copied.query()
report(
    in_flight_after_compute=in_flight_after_compute,
    computed=computed == computed,
    done_after_wait=done_after_wait,
    after_wait=after_wait,
    host=host.sum().item(),
)
