"""The docs' example on the test accelerator: a TransformerEncoderLayer planned at every tenth of
its budget; reports, per budget, the bytes the plan predicts held, the bytes the allocator counts,
the calls the plan keeps and the hits the audit counts."""

import copy
import warnings

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report
from torch import nn

warnings.simplefilter("ignore")
import sac_plugin  # noqa: E402 - its warnings are ignored too

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True).to(
    "sac_accel"
)
x = torch.randn(2, 32, 64, requires_grad=True, device="sac_accel")
plan = sac_plugin.plan(layer, x, budget=1.0, runs=1)
rows = []
for budget in [i / 10 for i in range(11)]:
    budgeted = plan.with_budget(budget)
    checkpointed = sac_plugin.apply_selective_checkpointing(copy.deepcopy(layer), budgeted.policy)
    inputs = x.detach().clone().requires_grad_()
    checkpointed(inputs).sum().backward()
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    with sac_plugin.audit() as audit:
        out = checkpointed(inputs)
        torch.accelerator.synchronize()
        # The allocator's bytes from the forward, less its output (the caller's), plus the input
        # it saves (allocated before): what the plan calls held.
        held = (
            torch.accelerator.memory_allocated()
            - before
            - out.untyped_storage().nbytes()
            + inputs.untyped_storage().nbytes()
        )
        out.sum().backward()
    del out
    rows.append([budget, budgeted.held_bytes, held, len(budgeted.kept), sum(r.hits for r in audit.rows())])
report(rows=rows)
