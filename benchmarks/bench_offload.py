"""Keep, offload or recompute: one Llama-style block (or the MoE block) per checkpointing mode.

    python3 benchmarks/bench_offload.py --device cuda --dtype bfloat16 --dim 4096 --seq 4096
    python3 benchmarks/bench_offload.py --device sac_accel      # the test accelerator: bytes, correctness

Modes: no checkpointing, full recompute, attention and matmuls kept (sac_plugin), the same calls
offloaded, attention kept with the matmuls offloaded, the memory-budget plan at --budget without
and with offload, torch's save_on_cpu (pinned), and torchtune's OffloadActivations where it is
installed. Per mode: the device bytes held between forward and backward (the device allocator's
memory_allocated after the forward minus before it, on an accelerator; sac_plugin.memory's count
on the CPU), the peak over the step, pinned host bytes the plugin's offloaded outputs hold, the
median step time and its ratio to no checkpointing, and whether every gradient is bitwise the
no-checkpointing one. On the CPU, offloading is keeping (there is no device memory to free).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import sys
import time

import sac_plugin
import torch
import sac_plugin.memory
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import LlamaBlock, MoEBlock, rotary_tables
from sac_plugin.targets import ATTENTION_OPS
from torch.utils.checkpoint import checkpoint

MATMULS = ["aten::mm", "aten::addmm", "aten::bmm"]


def _accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


def _sync(device: torch.device) -> None:
    if _accelerator(device):
        torch.accelerator.synchronize()


def _allocated(device: torch.device) -> int:
    return torch.accelerator.memory_allocated() if _accelerator(device) else 0


def _peak_reset(device: torch.device) -> None:
    if _accelerator(device):
        torch.accelerator.reset_peak_memory_stats()


def _peak(device: torch.device) -> int | None:
    return torch.accelerator.max_memory_allocated() if _accelerator(device) else None


def _checkpointed(block, policy):
    layer = copy.deepcopy(block)
    sac_plugin.apply_selective_checkpointing(layer, policy)
    return layer


def _modes(block, inputs, args):
    """name -> (module to run, context around its forward)."""
    attention = sorted(ATTENTION_OPS.resolve())
    floor = {"offload_min_bytes": args.min_bytes}
    modes = {
        "no checkpointing": (block, contextlib.nullcontext),
        "full recompute": (_checkpointed(block, None), contextlib.nullcontext),
        "keep attention + matmuls": (_checkpointed(block, sac_plugin.Policy(kept_ops=attention + MATMULS)),
                                     contextlib.nullcontext),
        "offload attention + matmuls": (
            _checkpointed(block, sac_plugin.Policy(offloaded_ops=attention + MATMULS, **floor)), contextlib.nullcontext),
        "keep attention, offload matmuls": (
            _checkpointed(block, sac_plugin.Policy(kept_ops=attention, offloaded_ops=MATMULS, **floor)),
            contextlib.nullcontext),
    }
    plan = sac_plugin.plan(copy.deepcopy(block), *inputs, budget=args.budget)
    modes[f"budget {args.budget} plan"] = (_checkpointed(block, plan.policy), contextlib.nullcontext)
    try:
        offload_plan = sac_plugin.plan(copy.deepcopy(block), *inputs, budget=args.budget, offload=True,
                                       offload_min_bytes=args.min_bytes)
        modes[f"budget {args.budget} plan, offload"] = (_checkpointed(block, offload_plan.policy),
                                                        contextlib.nullcontext)
    except TypeError as error:  # a planner without the offload outcome
        print(f"(budget plan with offload skipped: {error})")
    if _accelerator(torch.device(args.device)):
        modes["torch save_on_cpu (pinned)"] = (
            block, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=args.device.split(":")[0]))
    if importlib.util.find_spec("torchtune") is not None:
        from torchtune.training import OffloadActivations

        modes["torchtune OffloadActivations"] = (block, OffloadActivations)
    return modes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", choices=["llama", "moe"], default="llama")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-bytes", type=int, default=0,
                        help="offload_min_bytes of the offloading policies (0: offload every output)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device.startswith("sac_accel"):
        import sac_test_accelerator  # noqa: F401  registers the device before the first backward
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    model_class = LlamaBlock if args.model == "llama" else MoEBlock
    block = model_class(args.dim, args.heads).to(device=device, dtype=dtype)
    cos, sin = rotary_tables(args.dim // args.heads, args.seq, device=device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    modes = _modes(block, (x, cos, sin), args)

    results, reference = {}, None
    for name, (module, around) in modes.items():
        times, held, peak, host = [], None, None, 0
        for step in range(args.steps + 1):
            x.grad = None
            module.zero_grad(set_to_none=True)
            _sync(device)
            _peak_reset(device)
            before = _allocated(device)
            started = time.perf_counter()
            with track_activation_memory(module.parameters()) as memory, around():
                out = module(x, cos, sin)
            _sync(device)
            if step == 0:
                held = _allocated(device) - before if _accelerator(device) else memory.bytes()
                host = memory.offloaded_by_plugin()
            out.backward(grad)
            _sync(device)
            if step == 0:
                peak = _peak(device)
                peak = None if peak is None else peak - before
                gradients = [p.grad.cpu() for p in module.parameters()] + [x.grad.cpu()]
                if reference is None:
                    reference = gradients
                bitwise = all(torch.equal(a, b) for a, b in zip(reference, gradients))
            else:
                times.append(time.perf_counter() - started)
            del out, memory
        results[name] = {"held_bytes": held, "host_bytes": host, "peak_bytes": peak,
                         "step_s": statistics.median(times), "bitwise": bitwise}
    base = results["no checkpointing"]
    stats = sac_plugin.memory.offload_stats()
    print(f"{args.model} block: dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, {args.dtype}, "
          f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'mode':<36}{'held MiB':>10}{'ratio':>7}{'host MiB':>10}{'peak MiB':>10}{'step ms':>9}{'vs none':>9}"
          "  bitwise")
    for name, r in results.items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        print(f"{name:<36}{r['held_bytes'] / 2**20:>10.2f}{r['held_bytes'] / max(base['held_bytes'], 1):>7.3f}"
              f"{r['host_bytes'] / 2**20:>10.2f}{peak:>10}{r['step_s'] * 1e3:>9.1f}{r['step_s'] / base['step_s']:>9.3f}  {r['bitwise']}")
    keep, offload = results.get("keep attention + matmuls"), results.get("offload attention + matmuls")
    if keep and offload:
        # The same calls held either way: what offloading adds to the step is the copy time that
        # did not hide behind compute.
        print(f"exposed copy time (offload minus keep, same calls): {(offload['step_s'] - keep['step_s']) * 1e3:.1f} ms "
              f"per step")
    print(f"offload copies in the run: {stats['copies_to_host']} to the host ({stats['bytes_to_host'] / 2**20:.1f} MiB), "
          f"{stats['copies_to_device']} back; compute waited {stats['exposed_copy_us'] / 1e3:.1f} ms for copies back "
          f"in all; pinned pool {stats['pool_bytes'] / 2**20:.1f} MiB in {stats['pool_allocations']} buffers")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results, "offload": stats}, f,
                      indent=2)


if __name__ == "__main__":
    main()
    if any(arg.startswith("sac_accel") for arg in sys.argv):
        # The test accelerator's device threads can still be letting go of the last backward
        # while the interpreter finalizes (its package docstring says why); leave without that.
        sys.stdout.flush()
        os._exit(0)
