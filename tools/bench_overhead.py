"""Interception overhead: sac_plugin against torch's own SAC, side by side in one process.

    .venv/bin/python tools/bench_overhead.py [--sizes 64 256 1024] [--reps 15]

A checkpointed block of many small ops (tiny matmuls, elementwise chains, a tiny attention) so
that per-op cost dominates. Every mode runs on the same inputs, interleaved round by round in a
shuffled order so that machine noise and allocator state hit all modes alike. Reported per mode: forward+backward time per step (min
and median) and, for the intercepting modes, the overhead per intercepted op:
(mode - full recompute) / ops intercepted, where ops intercepted is what the audit counts in
the forward and the recompute (executions + kept outputs served). Two ratios: with the same
kept-op list (both modes also skip the kept ops' recompute), and "intercept only", a policy that
intercepts every op and keeps none, which isolates the interception cost itself.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import random
import statistics
import time

import sac_plugin
import torch
from sac_plugin.targets import ATTENTION_OPS
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def make_block(num_ops: int, dim: int, device):
    """A function of ~num_ops intercepted ops: groups of 8 (mm, tanh, mul, add, sin, mm, sigmoid, mul)."""
    torch.manual_seed(0)
    groups = max(1, num_ops // 8)
    weights = [torch.randn(dim, dim, device=device, requires_grad=True) * 0.1 for _ in range(2 * groups)]
    weights = [w.detach().requires_grad_() for w in weights]

    def block(x):
        h = x
        for g in range(groups):
            a = torch.tanh(h @ weights[2 * g])
            b = a * 0.5 + a.sin()
            h = torch.sigmoid(b @ weights[2 * g + 1]) * b
        return h

    return block, weights


def make_attention_block(num_ops: int, dim: int, device):
    """The same block with a tiny causal attention every 8 groups (4 heads, seq = batch rows)."""
    block, weights = make_block(num_ops, dim, device)

    def with_attention(x):
        h = block(x)
        q = h.view(1, 4, h.shape[0], dim // 4)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(h.shape)

    return with_attention, weights


def torch_sac_context(kept_overloads):
    kept = frozenset(kept_overloads)

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    # The policy function a torch SAC user writes: a set lookup, nothing more.
    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


# An op the block never calls: the policy intercepts every op and keeps none, which isolates
# the cost of interception from the compute saved by kept ops. The tool registers it itself, so
# it exists in every torch (aten::cholesky, used before, is gone from torch 2.14).
_LIBRARY = torch.library.Library("sac_bench", "DEF")  # lives as long as the tool
_LIBRARY.define("never_called(Tensor x) -> Tensor")
_LIBRARY.impl("never_called", lambda x: x.clone(), "CompositeExplicitAutograd")
INTERCEPT_ONLY = ["sac_bench::never_called"]


def run_modes(block, x, grad, policy):
    plugin_ctx = sac_plugin.context_fn(policy)
    empty_ctx = sac_plugin.context_fn(sac_plugin.Policy())
    torch_ctx = torch_sac_context(policy.kept_overloads())
    plugin_intercept_ctx = sac_plugin.context_fn(sac_plugin.Policy(kept_ops=INTERCEPT_ONLY))
    torch_intercept_ctx = torch_sac_context(sac_plugin.Policy(kept_ops=INTERCEPT_ONLY).kept_overloads())

    def step(fn):
        def run():
            out = fn(x)
            out.backward(grad)
        return run

    return {
        "no checkpointing": step(block),
        "full recompute": step(lambda v: checkpoint(block, v, use_reentrant=False)),
        "torch SAC": step(lambda v: checkpoint(block, v, use_reentrant=False, context_fn=torch_ctx)),
        "sac_plugin": step(lambda v: checkpoint(block, v, use_reentrant=False, context_fn=plugin_ctx)),
        "sac_plugin + audit": step(lambda v: checkpoint(block, v, use_reentrant=False, context_fn=plugin_ctx)),
        "sac_plugin, nothing kept": step(lambda v: checkpoint(block, v, use_reentrant=False, context_fn=empty_ctx)),
        "torch SAC, intercept only": step(lambda v: checkpoint(block, v, use_reentrant=False, context_fn=torch_intercept_ctx)),
        "sac_plugin, intercept only": step(
            lambda v: checkpoint(block, v, use_reentrant=False, context_fn=plugin_intercept_ctx)),
    }


def intercepted_ops(run) -> int:
    with sac_plugin.audit() as audit:
        run()
    return sum(row.forward + row.recompute + row.hits for row in audit.rows())


def measure(size: int, reps: int, dim: int, device, steps_per_sample: int) -> dict:
    block, _ = make_attention_block(size, dim, device)
    x = torch.randn(16, dim, device=device)
    grad = torch.ones(16, dim, device=device)
    policy = sac_plugin.Policy(kept_ops={"aten::mm"} | ATTENTION_OPS.resolve())
    modes = run_modes(block, x, grad, policy)
    ops = intercepted_ops(modes["sac_plugin"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in modes}
    for name, run in modes.items():  # warm-up
        for _ in range(3):
            run()
    # Like timeit: the garbage collector stays off while timing, and each sample is the mean
    # of a few steps, so one sample is not one timer tick or one collection.
    gc.collect()
    gc.disable()
    try:
        order = list(modes.items())
        shuffle = random.Random(0).shuffle
        for _ in range(reps):
            shuffle(order)  # no mode always runs first, right after a collection
            for name, run in order:
                audit = sac_plugin.audit() if name == "sac_plugin + audit" else contextlib.nullcontext()
                with audit:
                    sync()
                    started = time.perf_counter()
                    for _ in range(steps_per_sample):
                        run()
                    sync()
                    times[name].append((time.perf_counter() - started) / steps_per_sample)
            gc.collect()
    finally:
        gc.enable()
    summary = {name: {"min": min(t), "median": statistics.median(t)} for name, t in times.items()}

    def overhead(name, stat):
        return summary[name][stat] - summary["full recompute"][stat]

    for name in summary:
        if name not in ("no checkpointing", "full recompute"):
            summary[name]["overhead_per_op_us"] = overhead(name, "min") / ops * 1e6

    def ratio(plugin, reference, stat):
        return overhead(plugin, stat) / overhead(reference, stat)

    return {
        "size": size,
        "ops_intercepted": ops,
        "modes": summary,
        # Headline, as the issue defines it: same kept-op list, (mode - full recompute).
        "kept_list_ratio": {s: ratio("sac_plugin", "torch SAC", s) for s in ("min", "median")},
        # Interception alone: a policy that intercepts every op and keeps none.
        "intercept_only_ratio": {
            s: ratio("sac_plugin, intercept only", "torch SAC, intercept only", s) for s in ("min", "median")},
        "nothing_kept_over_full": {
            s: summary["sac_plugin, nothing kept"][s] / summary["full recompute"][s] for s in ("min", "median")},
    }


def print_report(results, device):
    print(f"interception overhead, {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for r in results:
        print(f"\nblock of ~{r['size']} ops ({r['ops_intercepted']} intercepted per step: forward + recompute)")
        print(f"  {'mode':<28}{'min ms':>10}{'median ms':>11}{'overhead/op (min)':>19}")
        for name, m in r["modes"].items():
            per_op = f"{m['overhead_per_op_us']:>11.2f} us" if "overhead_per_op_us" in m else ""
            print(f"  {name:<28}{m['min'] * 1e3:>10.2f}{m['median'] * 1e3:>11.2f}{per_op:>19}")
        for label, key in (("plugin overhead / torch SAC overhead, same kept list", "kept_list_ratio"),
                           ("plugin overhead / torch SAC overhead, intercept only", "intercept_only_ratio"),
                           ("plugin with nothing kept / full recompute", "nothing_kept_over_full")):
            print(f"  {label}: {r[key]['min']:.3f} (min), {r[key]['median']:.3f} (median)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps-per-sample", type=int, default=5)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = [measure(size, args.reps, args.dim, device, args.steps_per_sample) for size in args.sizes]
    print_report(results, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
