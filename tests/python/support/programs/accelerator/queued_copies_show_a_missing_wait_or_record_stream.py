"""The program test_test_accelerator.py runs for test_queued_copies_show_a_missing_wait_or_record_stream,
which asserts what it reports."""

import sac_test_accelerator
import torch
from support.programs.report import report

sac_test_accelerator.set_copy_delay(0.2)
side = torch.Stream(device="sac_accel")


def ones():
    return torch.ones(4, device="sac_accel")


# Read before waiting: the old values; after the event: the copied ones.
host = torch.zeros(4, pin_memory=True)
source = ones()
with side:
    host.copy_(source, non_blocking=True)
    copied = side.record_event()
early, query_early = host.tolist(), copied.query()
copied.synchronize()
waited = host.tolist()

# Freed without record_stream while the copy is queued: the copy reads the poisoned block.
host = torch.zeros(4, pin_memory=True)
with side:
    host.copy_(ones(), non_blocking=True)
side.synchronize()
unrecorded = host.tolist()

# The same with record_stream: the block outlives the queued copy.
host = torch.zeros(4, pin_memory=True)
source = ones()
with side:
    host.copy_(source, non_blocking=True)
source.record_stream(side)
del source
side.synchronize()
recorded = host.tolist()

# Unpinned host memory: non_blocking copies run at once, as on CUDA.
plain = torch.zeros(4)
with side:
    plain.copy_(ones(), non_blocking=True)
report(
    early=early,
    query_early=query_early,
    waited=waited,
    unrecorded=[str(v) for v in unrecorded],
    recorded=recorded,
    unpinned=plain.tolist(),
    bytes=torch.accelerator.memory_allocated(),
)
