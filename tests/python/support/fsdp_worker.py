"""One rank of the FSDP2 tests (spawned by test_fsdp.py): trains each case with and without
selective checkpointing under the same FSDP2 sharding and reports whether losses and gradient
shards are bitwise equal."""

import copy

import torch
import torch.distributed as dist


def run_case(model_class, config, nested, steps=2):
    import sac_plugin
    from sac_plugin import apply_recompute_config
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = model_class(layers=2, dim=64, seq=32)
    outcome = {}
    for mode in ("no checkpointing", "sac"):
        model = copy.deepcopy(base)
        if mode == "sac":
            apply_recompute_config(model, config)
        for layer in model.layers:
            if nested:  # a fully_shard inside the checkpointed layer: its all-gather runs in the region
                fully_shard(layer.moe.experts[0])
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        with sac_plugin.audit() as audit:
            for step in range(steps):
                torch.manual_seed(100 * step + dist.get_rank())
                tokens = torch.randint(512, (2, 32))
                optimizer.zero_grad()
                loss = model.loss(tokens, tokens)
                loss.backward()
                losses.append(loss.detach().clone())
                grads.append([p.grad.to_local().clone() for p in model.parameters()])
                optimizer.step()
        outcome[mode] = (losses, grads, sum(row.hits for row in audit.rows()))
    reference, sac = outcome["no checkpointing"], outcome["sac"]
    same_loss = all(torch.equal(a, b) for a, b in zip(reference[0], sac[0]))
    same_grads = all(torch.equal(a, b) for ga, gb in zip(reference[1], sac[1]) for a, b in zip(ga, gb))
    return {"same_loss": same_loss, "same_grads": same_grads, "hits": sac[2]}


def main(rank, world_size, init_file, result_file):
    from sac_plugin import RecomputeConfig
    from sac_plugin.models import Llama, MoEModel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # Ops FSDP2 also calls inside the region, and in the forward only (the nested module's
        # all-gather buffer and parameter views): keeping them must not shift serving.
        fsdp_ops = ["aten::view", "aten::split_with_sizes"]
        cases = {
            "dense: attn + mlp units": (Llama, RecomputeConfig(kept_units=["attn", "mlp"]), False),
            "dense: every other mm": (Llama, RecomputeConfig(kept_units=["attn"], every_nth_op={"aten::mm": 2}), False),
            "moe, nested fully_shard: routing units": (
                MoEModel,
                RecomputeConfig(kept_units=["attn", "moe_gate", "moe_dispatch"]),
                True,
            ),
            "moe, nested fully_shard: ops FSDP2 calls in one pass kept": (
                MoEModel,
                RecomputeConfig(kept_units=["attn", "moe_gate"], kept_ops=fsdp_ops),
                True,
            ),
            # On the CPU offloading is keeping: the same served calls through the offload rules.
            "moe, nested fully_shard: units offloaded": (
                MoEModel,
                RecomputeConfig(kept_units=["attn"], offloaded_units=["moe_gate", "moe_dispatch"], offload_min_bytes=0),
                True,
            ),
            # On the CPU the layers' inputs stay where torch's checkpoint holds them: the same run.
            "dense: attn unit, inputs offloaded": (
                Llama,
                RecomputeConfig(kept_units=["attn"], offload_inputs=True),
                False,
            ),
        }
        results = {name: run_case(*case) for name, case in cases.items()}
        if rank == 0:
            import json

            with open(result_file, "w") as f:
                json.dump(results, f)
        # Both ranks leave their last collective before either tears gloo down.
        dist.barrier()
    finally:
        dist.destroy_process_group()
