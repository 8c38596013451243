"""Everything a region holds dies with the graph that holds the region (NOTE: [A region owns what
it holds] in csrc/dispatch/region.h), and the pinned pool stays within host_memory_limit (NOTE: [A
bounded pinned pool] in csrc/dispatch/offload.cpp): measured on the test accelerator, whose
allocator counts every device byte."""

import pytest
from support.accelerator import SKIP_REASON, runner_with_models

pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

# Each layer offloads its first projection (1 MiB) and keeps its second (512 KiB, under the floor):
# one step offloads 2 MiB, the limit given.
ONE_STEP = 2 << 20
_on_accelerator = runner_with_models("offloaded_outputs")


@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
def test_a_forward_dropped_without_a_backward_leaves_nothing_held(engine):
    values = _on_accelerator(
        f"""
policy = Policy(offloaded_ops=["aten::addmm"], host_memory_limit={ONE_STEP})
model, x = checkpointed(policy)
first_held = step(model, x)
torch.accelerator.synchronize()
device_before, regions_before = torch.accelerator.memory_allocated(), sac_plugin._C.live_regions()
for _ in range(3):
    loss = model(x).square().mean()  # a skipped NaN loss, a validation loss with grad on
    del loss
torch.accelerator.synchronize()
after = stats()
report(first_held=first_held, later_held=step(model, x),
       device_back=torch.accelerator.memory_allocated() - device_before,
       regions_back=sac_plugin._C.live_regions() - regions_before,
       pool_in_use=after["pool_bytes_in_use"], pool_bytes=after["pool_bytes"])
""",
        engine,
    )
    # Two layers each hold 512 KiB on the device, plus the loss's 4 bytes and the model output.
    assert values["later_held"] == values["first_held"]
    assert values["device_back"] == 0 and values["regions_back"] == 0
    assert values["pool_in_use"] == 0 and values["pool_bytes"] <= ONE_STEP


@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
def test_an_exception_in_backward_leaves_nothing_held_once_the_graph_is_gone(engine):
    values = _on_accelerator(
        """
class Boom(Exception):
    pass

def explode(grad):
    raise Boom()

model, x = checkpointed(Policy(offloaded_ops=["aten::addmm"]))
step(model, x)  # every gradient exists: later steps accumulate into them
torch.accelerator.synchronize()
device_before, regions_before = torch.accelerator.memory_allocated(), sac_plugin._C.live_regions()
middle = model[0](x)
middle.register_hook(explode)  # after the last layer's recompute, which fetched the first's back
loss = model[1](middle).square().mean()
try:
    loss.backward()
    raised = False
except Boom:
    raised = True
torch.accelerator.synchronize()
fetched_while_alive = stats()["copies_to_device"]
del loss, middle
# The exception's traceback and torch's checkpoint frames form reference cycles: the graph goes
# when the collector runs, as it would in a training loop. The hook raised on the autograd
# engine's thread for this device, which still holds the graph task (the root's gradient, the
# nodes not run) for a moment after the error woke this thread: collect until everything is back,
# or for 10 s, after which what is still held is held for good.
import gc, time
deadline = time.monotonic() + 10
while True:
    gc.collect()
    torch.accelerator.synchronize()
    settled = (torch.accelerator.memory_allocated() == device_before and sac_plugin._C.live_regions() == regions_before
               and stats()["pool_bytes_in_use"] == 0)
    if settled or time.monotonic() > deadline:
        break
    time.sleep(0.01)
report(raised=raised, fetched=fetched_while_alive,
       device_back=torch.accelerator.memory_allocated() - device_before,
       regions_back=sac_plugin._C.live_regions() - regions_before, pool_in_use=stats()["pool_bytes_in_use"])
""",
        engine,
    )
    assert values["raised"]
    assert values["fetched"] == 4  # the first step's two, then the last layer's and, ahead, the first's
    assert values["device_back"] == 0 and values["regions_back"] == 0 and values["pool_in_use"] == 0


def test_the_pinned_pool_stays_within_the_limit_as_shapes_grow():
    values = _on_accelerator("""
class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256)

    def forward(self, x):
        return self.up(x).tanh().sum(-1, keepdim=True) * x

torch.manual_seed(0)
limit = 4 * 64 * 4 * 256 * 50  # the largest step's offload: 4 layers of (64 x 50 tokens, 256) floats
model = torch.nn.Sequential(*[Wide() for _ in range(4)]).to("sac_accel")
policy = Policy(offloaded_ops=["aten::addmm"], offload_min_bytes=0, host_memory_limit=limit)
for layer in model:
    sac_plugin.apply_selective_checkpointing(layer, policy)
largest = 0
for step_index in range(1, 51):
    x = torch.randn(64 * step_index, 64, device="sac_accel", requires_grad=True)
    model(x).square().mean().backward()
    torch.accelerator.synchronize()
    largest = max(largest, stats()["pool_bytes"])
final = stats()
freed = sac_plugin.memory.empty_offload_pool()
report(largest=largest, limit=limit, allocations=final["pool_allocations"], trims=final["pool_trims"],
       in_use=final["pool_bytes_in_use"], cached=final["pool_bytes_cached"], pool_bytes=final["pool_bytes"],
       freed=freed, after_empty=stats()["pool_bytes"], copies=final["copies_to_host"])
""")
    assert values["largest"] <= values["limit"]
    assert values["in_use"] == 0 and values["cached"] == values["pool_bytes"]
    assert values["freed"] == values["pool_bytes"] and values["after_empty"] == 0
    assert values["trims"] > 0  # idle buffers of smaller classes made room for larger ones
    # Size classes: far fewer allocations than outputs offloaded. Rounded up to their classes, the
    # last steps' outputs do not all fit the limit, so a few of them stay on the device.
    assert 150 < values["copies"] <= 200 and values["allocations"] < 60
