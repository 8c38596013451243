"""Runs the same workloads before and after importing sac_plugin, with another owner of the
plugin's dispatch key (the library named by argv[1]) loaded first, and prints as JSON what the
owner acted on in each, whether gradients matched an unmodified model, and the plugin's path."""

import copy
import json
import sys

import torch
from torch.utils.checkpoint import checkpoint

torch.ops.load_library(sys.argv[1])
owner = torch.ops.sac_test_foreign

torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Sigmoid())
x = torch.randn(4, 8)


def run(context_fn, mode_during):
    model = copy.deepcopy(base)
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    owner.reset_counts()
    owner.set_mode(mode_during == "forward")
    out = checkpoint(model, x, use_reentrant=False, **kwargs)
    owner.set_mode(mode_during == "backward")
    out.pow(2).sum().backward()
    owner.set_mode(False)
    return owner.acted_calls(), [p.grad for p in model.parameters()]


modes = ["none", "forward", "backward"]
without = {mode: run(None, mode) for mode in modes}

import sac_plugin  # noqa: E402 - the workloads above run without the plugin

policy = sac_plugin.Policy(kept_ops=["aten::addmm", "aten::tanh"])
with_plugin = {mode: run(sac_plugin.context_fn(policy), mode) for mode in modes}
with sac_plugin.audit() as audit:
    run(sac_plugin.context_fn(policy), "none")
reference = copy.deepcopy(base)
reference(x).pow(2).sum().backward()
expected = [p.grad for p in reference.parameters()]
print(
    json.dumps(
        {
            "path": sac_plugin.interception_path(),
            "acted_without": {m: without[m][0] for m in modes},
            "acted_with": {m: with_plugin[m][0] for m in modes},
            "gradients_equal": {m: all(torch.equal(a, b) for a, b in zip(with_plugin[m][1], expected)) for m in modes},
            "hits": audit.hits("aten::addmm") + audit.hits("aten::tanh"),
        }
    )
)
