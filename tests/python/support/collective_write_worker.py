"""One rank of the in-place collective tests (spawned by test_collectives.py): a Megatron-style
row-parallel layer whose kept `mm` output the forward then all-reduces in place
(`dist.all_reduce(out)`, `c10d::allreduce_`), trained with and without selective checkpointing;
reports whether the gradients are bitwise equal and what the audit counted."""

import torch
import torch.distributed as dist


def _layer(x, w_in, w_out, group):
    h = torch.relu(x @ w_in)  # column-parallel: each rank holds a slice of the hidden size
    out = h @ w_out  # row-parallel: each rank holds a partial sum
    dist.all_reduce(out, group=group)  # in place: the kept mm's output is written
    return torch.sin(out)  # saves the reduced value for backward


def main(rank, world_size, init_file, result_file, engine_variable, engine):
    import json
    import os

    os.environ[engine_variable] = engine
    import sac_plugin
    from sac_plugin import Policy
    from torch.utils.checkpoint import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(rank)
        w_in = torch.randn(16, 8, requires_grad=True)
        w_out = torch.randn(8, 16, requires_grad=True)
        torch.manual_seed(1234)
        x = torch.randn(4, 16, requires_grad=True)
        _layer(x, w_in, w_out, dist.group.WORLD).sum().backward()
        expected = [t.grad.clone() for t in (x, w_in, w_out)]
        for t in (x, w_in, w_out):
            t.grad = None
        context_fn = sac_plugin.context_fn(Policy(kept_ops=["aten::mm"]))
        with sac_plugin.audit() as audit:
            out = checkpoint(_layer, x, w_in, w_out, dist.group.WORLD, use_reentrant=False, context_fn=context_fn)
            out.sum().backward()
        got = [t.grad for t in (x, w_in, w_out)]
        result = {
            "engine": sac_plugin.engine(),
            "bitwise": [torch.equal(a, b) for a, b in zip(expected, got)],
            "largest_difference": max(float((a - b).abs().max()) for a, b in zip(expected, got)),
            "mm_hits": audit.hits("aten::mm"),
            "allreduce_forward": audit.count("c10d::allreduce_", phase="forward"),
            "allreduce_recompute": audit.count("c10d::allreduce_", phase="recompute"),
        }
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
