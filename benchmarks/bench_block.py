"""One Llama-style block at realistic size: memory and step time per checkpointing mode.

    python3 benchmarks/bench_block.py --device cuda --dtype bfloat16 --dim 4096 --seq 4096

Modes: no checkpointing, full recompute, attention kept (sac_plugin and torch's SAC, same op
list), the "attn" and "mlp" units kept as LLAMA_TARGETS defines them (sac_plugin). Reported per mode: activation bytes held after the
forward (sac_plugin.memory's unique-storage count), on CUDA the peak of
torch.cuda.max_memory_allocated over forward+backward minus what was allocated before the step,
and the median step time.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time

import sac_plugin
import torch
from sac_plugin import RecomputeConfig, apply_recompute_config
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import LlamaBlock, rotary_tables
from sac_plugin.models import LLAMA_TARGETS
from sac_plugin.targets import ATTENTION_OPS
from torch.utils.checkpoint import checkpoint

from _common import cached_tensors, synchronizer, torch_sac


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    block = LlamaBlock(args.dim, args.heads).to(device=device, dtype=dtype)
    cos, sin = rotary_tables(args.dim // args.heads, args.seq, device=device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    attention = sac_plugin.Policy(kept_ops=ATTENTION_OPS.resolve())
    # The units as a config means them for Llama: attention ops by name, the SwiGLU MLP as a
    # callable run inside the "mlp" unit; on a copy, so the other modes see a plain block.
    units_block = copy.deepcopy(block)
    apply_recompute_config(
        units_block, RecomputeConfig(kept_units=["attn", "mlp"]), target_map=LLAMA_TARGETS, wrap_sites=[units_block]
    )
    torch_caches = []  # torch's SAC cache, counted as held memory like the plugin's store
    modes = {
        "no checkpointing": lambda: block(x, cos, sin),
        "full recompute": lambda: checkpoint(block, x, cos, sin, use_reentrant=False),
        "attention kept, torch SAC": functools.partial(
            checkpoint, block, x, cos, sin, use_reentrant=False, context_fn=torch_sac(attention, torch_caches)
        ),
        "attention kept, sac_plugin": functools.partial(
            checkpoint, block, x, cos, sin, use_reentrant=False, context_fn=sac_plugin.context_fn(attention)
        ),
        "attn + mlp units kept, sac_plugin": functools.partial(units_block, x, cos, sin),
    }
    sync = synchronizer(device)
    results = {}
    for name, forward in modes.items():
        times, peak = [], None
        for step in range(args.steps + 1):
            x.grad = None
            block.zero_grad(set_to_none=True)
            units_block.zero_grad(set_to_none=True)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            started = time.perf_counter()
            torch_caches.clear()
            with track_activation_memory(block.parameters()) as memory:
                memory.add_source(lambda: cached_tensors(torch_caches))
                out = forward()
            held = memory.bytes() if step == 0 else None
            out.backward(grad)
            sync()
            if step == 0:
                held_bytes = held
                if cuda:
                    peak = torch.cuda.max_memory_allocated() - before
            else:
                times.append(time.perf_counter() - started)
            del out, memory
            torch_caches.clear()
        results[name] = {"held_bytes": held_bytes, "peak_bytes": peak, "step_s": statistics.median(times)}
    base = results["no checkpointing"]
    print(
        f"Llama block: dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, {args.dtype}, "
        f"{device}, torch {torch.__version__}"
    )
    print(f"{'mode':<36}{'held MiB':>10}{'ratio':>7}{'peak MiB':>10}{'step ms':>9}{'vs none':>9}")
    for name, r in results.items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        print(
            f"{name:<36}{r['held_bytes'] / 2**20:>10.1f}{r['held_bytes'] / base['held_bytes']:>7.3f}{peak:>10}"
            f"{r['step_s'] * 1e3:>9.1f}{r['step_s'] / base['step_s']:>9.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
