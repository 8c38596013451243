"""Soak: a checkpointed model trained for SAC_SOAK_STEPS steps (10,000 in CI's soak job)
must not grow the process: no region, kept output, unit or audit state may accumulate."""

import os

import pytest
import sac_plugin
import torch
from sac_plugin import Policy
from support.toy_models import make_pair

STEPS = int(os.environ.get("SAC_SOAK_STEPS", "0"))
WARM_UP = 200
MAX_GROWTH = 64 * 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(STEPS == 0, reason="opt-in soak test: set SAC_SOAK_STEPS (e.g. 10000) to run it")
def test_rss_stays_flat_over_many_steps():
    policy = Policy(kept_ops=["aten::addmm"], kept_units=["attn"], every_nth_op={"aten::mm": 2})
    model, _ = make_pair(policy=policy, dropout="inside", nested_unit=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    start = None
    for step in range(STEPS):
        if step == min(WARM_UP, STEPS // 2):
            start = rss_bytes()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:  # audits open and close too
            with sac_plugin.audit():
                model(x).pow(2).mean().backward()
        else:
            model(x).pow(2).mean().backward()
        optimizer.step()
    end = rss_bytes()
    print(
        f"soak: {STEPS} steps, RSS after warm-up {start / 2**20:.1f} MiB, at the end {end / 2**20:.1f} MiB, "
        f"growth {(end - start) / 2**20:+.1f} MiB"
    )
    assert end - start < MAX_GROWTH
