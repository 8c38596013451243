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

    python3 benchmarks/bench_offload.py --device sac_accel --simulate h200 --dim 512 --heads 8 --seq 512

--simulate h200 times the test accelerator as a simulated H200 (NOTE: [The copy and compute model]
in tests/support/test_accelerator/streams.cpp): it measures this CPU's matmul rate and sets the
device's copy bandwidths so that copies take the share of the step they would take on an H200
(--sim-h2d and --sim-d2h bytes/s over PCIe against --sim-flops FLOP/s of matmul) for the block at
--sim-reference size in --sim-reference-dtype: this block's copy time over its compute time at
the simulated bandwidths is the reference block's at the H200's. It prints the parameters. Per
mode it then also reports the exposed copy time (how long compute waited for copies back, from
events) beside the one the offload plan's copy model predicts for the mode's policy, and, for the
offloaded rows, the step ratio to the row that keeps the same calls.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import inspect
import json
import os
import re
import statistics
import sys
import time

import sac_plugin
import torch
import sac_plugin.memory
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import LlamaBlock, MoEBlock, rotary_tables
from sac_plugin.targets import ATTENTION_OPS

from _common import time_interleaved

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


# Whether this build offloads the layers' inputs too (Policy(offload_inputs=True)).
OFFLOADS_INPUTS = "offload_inputs" in inspect.signature(sac_plugin.Policy).parameters


def _policies(args):
    """name -> (Policy arguments, {} for full recompute; the row this one is timed against, or
    None): the checkpointed rows, in table order (names fit the table's 36 columns). A row with
    inputs offloaded adds offload_inputs=True to the arguments of the row it extends."""
    attention = sorted(ATTENTION_OPS.resolve())
    floor = {"offload_min_bytes": args.min_bytes}
    keep = "keep attention + matmuls"
    rows = {
        "full recompute": ({}, None),
        keep: ({"kept_ops": attention + MATMULS}, None),
        "offload attention + matmuls": ({"offloaded_ops": attention + MATMULS, **floor}, keep),
        "keep attention, offload matmuls": ({"kept_ops": attention, "offloaded_ops": MATMULS, **floor}, keep),
    }
    if OFFLOADS_INPUTS:
        for extended, name in (
            ("full recompute", "full recompute, offload inputs"),
            ("offload attention + matmuls", "offload attn + matmuls + inputs"),
        ):
            arguments, _ = rows[extended]
            rows[name] = ({**arguments, "offload_inputs": True}, extended)
    return rows


def _stack_inputs(block, x, cos, sin, layers: int, device: torch.device) -> dict:
    """Held bytes of a stack of `layers` copies of the block, each checkpointed, under full recompute
    and with the layers' inputs offloaded: one block's input is the leaf x, which stays put, so
    the stack is where offloading inputs shows. The first block's input is x * 1, an activation as
    in a model."""
    rows = {}
    for name, policy in (
        ("full recompute", None),
        ("full recompute, offload inputs", sac_plugin.Policy(offload_inputs=True)),
    ):
        blocks = [_checkpointed(block, policy) for _ in range(layers)]
        x.grad = None
        _sync(device)
        before = _allocated(device)
        h = x * 1
        for each in blocks:
            h = each(h, cos, sin)
        _sync(device)
        held = _allocated(device) - before
        h.sum().backward()
        _sync(device)
        rows[name] = {
            "held_bytes": held,
            "gradients": [p.grad.cpu() for each in blocks for p in each.parameters()] + [x.grad.cpu()],
        }
        del h
    return rows


def _modes(block, inputs, args):
    """(name -> (module to run, context around its forward), name -> the exposed copy seconds per
    step the offload plan's model predicts for the mode's policy, for the modes it can price)."""
    modes = {"no checkpointing": (block, contextlib.nullcontext)}
    policies = {"no checkpointing": None}
    for name, (arguments, _) in _policies(args).items():
        policies[name] = sac_plugin.Policy(**arguments) if arguments else sac_plugin.Policy()
        modes[name] = (_checkpointed(block, policies[name] if arguments else None), contextlib.nullcontext)
    plan = sac_plugin.plan(copy.deepcopy(block), *inputs, budget=args.budget)
    modes[f"budget {args.budget} plan"] = (_checkpointed(block, plan.policy), contextlib.nullcontext)
    policies[f"budget {args.budget} plan"] = plan.policy
    predicted = {}
    try:
        offload_plan = sac_plugin.plan(
            copy.deepcopy(block), *inputs, budget=args.budget, offload=True, offload_min_bytes=args.min_bytes
        )
        modes[f"budget {args.budget} plan, offload"] = (
            _checkpointed(block, offload_plan.policy),
            contextlib.nullcontext,
        )
        policies[f"budget {args.budget} plan, offload"] = offload_plan.policy
        if offload_plan.offload is not None:
            # The model's exposed copy time: its predicted overhead less its recompute time. The
            # block's input is the bench's leaf x, which offload_inputs leaves where it is.
            for name, policy in policies.items():
                priced = offload_plan.evaluate(policy) if policy is not None else None
                predicted[name] = priced["overhead_seconds"] - priced["recompute_seconds"] if priced else 0.0
    except TypeError as error:  # a planner without the offload outcome
        print(f"(budget plan with offload skipped: {error})")
    if _accelerator(torch.device(args.device)):
        modes["torch save_on_cpu (pinned)"] = (
            block,
            lambda: torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=args.device.split(":")[0]),
        )
    if importlib.util.find_spec("torchtune") is not None:
        from torchtune.training import OffloadActivations

        modes["torchtune OffloadActivations"] = (block, OffloadActivations)
    return modes, predicted


# The simulated H200: PCIe 5.0 x16 copies each way against dense bf16 matmul.
H200 = {"h2d": 55e9, "d2h": 55e9, "flops": 800e12}


def _matmul_rate(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """This CPU's matmul rate in FLOP/s (the best of a few n x n products in the bench's dtype),
    the rate the device's kernels run at: they are the CPU's kernels."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def _block_flops(model_class, dim: int, heads: int, seq: int, batch: int) -> int:
    """FLOPs of one forward and backward of the block at this size, counted on meta tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        block = model_class(dim, heads)
        cos, sin = rotary_tables(dim // heads, seq, device="meta")
        x = torch.randn(batch, seq, dim, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x, cos, sin).sum().backward()
    return counter.get_total_flops()


def _simulate(args, model_class) -> dict:
    """Sets the test accelerator's copy model to the simulated H200 (the module docstring says
    how it is scaled) and returns its parameters."""
    import sac_test_accelerator

    rate = _matmul_rate(getattr(torch, args.dtype))
    ref_dim, ref_seq = (int(v) for v in args.sim_reference.split("x"))
    flops = _block_flops(model_class, args.dim, args.heads, args.seq, args.batch)
    ref_heads = max(1, args.heads * ref_dim // args.dim)
    ref_flops = _block_flops(model_class, ref_dim, ref_heads, ref_seq, args.batch)
    # Copies carry activations, batch x seq x dim of them: the bytes scale with seq * dim and the
    # element size (the reference block runs in --sim-reference-dtype).
    item, ref_item = getattr(torch, args.dtype).itemsize, getattr(torch, args.sim_reference_dtype).itemsize
    bytes_ratio = (args.seq * args.dim * item) / (ref_seq * ref_dim * ref_item)
    # On the H200 a copy of the reference block's bytes takes r = (bytes / bandwidth) /
    # (flops / rate) of its compute; here the block's compute runs at rate / scale, so the
    # bandwidth giving the same r is the H200's times the ratio of rates, of bytes and of FLOPs.
    effective_rate = rate / args.compute_scale
    factor = effective_rate / args.sim_flops * bytes_ratio * ref_flops / flops
    to_device, to_host = args.sim_h2d * factor, args.sim_d2h * factor
    sac_test_accelerator.set_compute_scale(args.compute_scale)
    sac_test_accelerator.set_copy_bandwidth(to_host=to_host, to_device=to_device)
    return {
        "cpu_matmul_flops": rate,
        "compute_scale": args.compute_scale,
        "sim_flops": args.sim_flops,
        "sim_h2d": args.sim_h2d,
        "sim_d2h": args.sim_d2h,
        "reference": args.sim_reference,
        "reference_dtype": args.sim_reference_dtype,
        "block_flops": flops,
        "reference_flops": ref_flops,
        "bytes_ratio": bytes_ratio,
        "bandwidth_to_device": to_device,
        "bandwidth_to_host": to_host,
        "device": sac_test_accelerator.simulation(),
    }


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
    parser.add_argument(
        "--min-bytes",
        type=int,
        default=0,
        help="offload_min_bytes of the offloading policies (0: offload every output)",
    )
    parser.add_argument(
        "--simulate",
        choices=["h200"],
        help="on the test accelerator: time it as this GPU (copies at its bandwidth, scaled)",
    )
    parser.add_argument("--sim-h2d", type=float, default=H200["h2d"], help="simulated host-to-device bytes/s")
    parser.add_argument("--sim-d2h", type=float, default=H200["d2h"], help="simulated device-to-host bytes/s")
    parser.add_argument("--sim-flops", type=float, default=H200["flops"], help="simulated matmul FLOP/s")
    parser.add_argument(
        "--sim-reference",
        default="4096x4096",
        help="DIMxSEQ of the block whose copy/compute ratio the simulation keeps",
    )
    parser.add_argument("--sim-reference-dtype", default="bfloat16", help="the dtype of the reference block")
    parser.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="the test accelerator's kernels take their CPU time times this (>= 1)",
    )
    parser.add_argument(
        "--stack", type=int, default=4, help="blocks in the stack that measures the layer inputs offloaded (0: skip it)"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.simulate and not args.device.startswith("sac_accel"):
        parser.error(f"--simulate runs on the test accelerator (--device sac_accel), got --device {args.device}")
    if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", args.sim_reference):
        parser.error(f"--sim-reference takes DIMxSEQ (e.g. 4096x4096), got {args.sim_reference!r}")
    if args.device.startswith("sac_accel"):
        import sac_test_accelerator  # noqa: F401  registers the device before the first backward
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    model_class = LlamaBlock if args.model == "llama" else MoEBlock
    simulation = _simulate(args, model_class) if args.simulate else None
    if simulation:
        print(f"SIMULATION of an {args.simulate.upper()} on the test accelerator (sac_accel), not a GPU measurement:")
        print(
            f"  simulated: {args.sim_h2d / 1e9:.0f} GB/s host to device, {args.sim_d2h / 1e9:.0f} GB/s device to host, "
            f"{args.sim_flops / 1e12:.0f} TFLOP/s, block at {args.sim_reference} (dim x seq), {args.sim_reference_dtype}"
        )
        print(
            f"  this CPU: {simulation['cpu_matmul_flops'] / 1e9:.1f} GFLOP/s matmul ({args.dtype}), compute scale "
            f"{args.compute_scale:g}; block {simulation['block_flops'] / 1e9:.2f} GFLOP per step, reference "
            f"{simulation['reference_flops'] / 1e12:.2f} TFLOP, bytes ratio {simulation['bytes_ratio']:.4f}"
        )
        print(
            f"  device bandwidths set: {simulation['bandwidth_to_device'] / 1e6:.2f} MB/s host to device, "
            f"{simulation['bandwidth_to_host'] / 1e6:.2f} MB/s device to host"
        )
    block = model_class(args.dim, args.heads).to(device=device, dtype=dtype)
    cos, sin = rotary_tables(args.dim // args.heads, args.seq, device=device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    modes, predicted = _modes(block, (x, cos, sin), args)

    # A first step per mode measures bytes, the peak and the gradients; the timed steps then run
    # interleaved, round by round in shuffled order (_common.time_interleaved), so that load on
    # the machine hits every mode alike.
    results, reference = {}, None
    for name, (module, around) in modes.items():
        x.grad = None
        module.zero_grad(set_to_none=True)
        _sync(device)
        _peak_reset(device)
        before = _allocated(device)
        with track_activation_memory(module.parameters()) as memory, around():
            out = module(x, cos, sin)
        _sync(device)
        held = _allocated(device) - before if _accelerator(device) else memory.bytes()
        host = memory.offloaded_by_plugin()
        out.backward(grad)
        _sync(device)
        peak = _peak(device)
        peak = None if peak is None else peak - before
        gradients = [p.grad.cpu() for p in module.parameters()] + [x.grad.cpu()]
        if reference is None:
            reference = gradients
        del out, memory
        results[name] = {
            "held_bytes": held,
            "host_bytes": host,
            "peak_bytes": peak,
            "bitwise": all(torch.equal(a, b) for a, b in zip(reference, gradients)),
        }

    def run(module, around):
        def step():
            x.grad = None
            module.zero_grad(set_to_none=True)
            with around():
                out = module(x, cos, sin)
            out.backward(grad)
            _sync(device)

        return step

    exposed_us = {name: 0 for name in modes}

    @contextlib.contextmanager
    def exposed_copies(name):
        # How long compute waited for copies back in this mode's samples (timed events).
        _sync(device)
        before = sac_plugin.memory.offload_stats()["exposed_copy_us"]
        yield
        _sync(device)
        exposed_us[name] += sac_plugin.memory.offload_stats()["exposed_copy_us"] - before

    times = time_interleaved(
        {name: run(*mode) for name, mode in modes.items()},
        reps=args.steps,
        steps_per_sample=1,
        warmup=0,
        device=args.device,
        around=exposed_copies,
    )
    for name, samples in times.items():
        results[name].update(
            step_s=statistics.median(samples),
            exposed_copy_s=exposed_us[name] / len(samples) / 1e6,
            predicted_exposed_copy_s=predicted.get(name),
        )
    base = results["no checkpointing"]
    against = {name: kept for name, (_, kept) in _policies(args).items() if kept}
    stats = sac_plugin.memory.offload_stats()
    print(
        f"{args.model} block: dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, {args.dtype}, "
        f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        + (f", SIMULATED {args.simulate.upper()}" if simulation else "")
    )
    # "exposed ms": per step, how long compute waited for copies back (timed events); "predicted":
    # what the offload plan's copy model predicts for the mode's policy ("-" where it cannot
    # price it); "vs kept": the step over the step of the row that keeps the same calls.
    print(
        f"{'mode':<36}{'held MiB':>10}{'ratio':>7}{'host MiB':>10}{'peak MiB':>10}{'step ms':>9}{'vs none':>9}"
        f"{'exposed ms':>12}{'predicted':>11}{'vs kept':>9}  bitwise"
    )
    for name, r in results.items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        kept = f"{r['step_s'] / results[against[name]]['step_s']:.3f}" if name in against else "-"
        guess = r["predicted_exposed_copy_s"]
        guess = "-" if guess is None else f"{guess * 1e3:.1f}"
        print(
            f"{name:<36}{r['held_bytes'] / 2**20:>10.2f}{r['held_bytes'] / max(base['held_bytes'], 1):>7.3f}"
            f"{r['host_bytes'] / 2**20:>10.2f}{peak:>10}{r['step_s'] * 1e3:>9.1f}{r['step_s'] / base['step_s']:>9.3f}"
            f"{r['exposed_copy_s'] * 1e3:>12.1f}{guess:>11}{kept:>9}  {r['bitwise']}"
        )
    keep, offload = results.get("keep attention + matmuls"), results.get("offload attention + matmuls")
    if keep and offload:
        # The same calls held either way: what offloading adds to the step is the copy time that
        # did not hide behind compute.
        print(
            f"exposed copy time (offload minus keep, same calls): {(offload['step_s'] - keep['step_s']) * 1e3:.1f} ms "
            f"per step; step ratio offload / keep {offload['step_s'] / keep['step_s']:.3f}"
        )
    print(
        f"offload copies in the run: {stats['copies_to_host']} to the host ({stats['bytes_to_host'] / 2**20:.1f} MiB), "
        f"{stats['copies_to_device']} back; compute waited {stats['exposed_copy_us'] / 1e3:.1f} ms for copies back "
        f"in all; pinned pool {stats['pool_bytes'] / 2**20:.1f} MiB in {stats['pool_allocations']} buffers"
    )
    stack = None
    if OFFLOADS_INPUTS and args.stack > 0 and _accelerator(device):
        rows = _stack_inputs(block, x, cos, sin, args.stack, device)
        full, offloaded = rows["full recompute"], rows["full recompute, offload inputs"]
        stack = {name: row["held_bytes"] for name, row in rows.items()}
        input_bytes = x.numel() * x.element_size()
        print(
            f"layer inputs offloaded, a stack of {args.stack} blocks: full recompute holds "
            f"{full['held_bytes'] / 2**20:.2f} MiB, with the inputs offloaded {offloaded['held_bytes'] / 2**20:.2f} "
            f"MiB ({(full['held_bytes'] - offloaded['held_bytes']) / input_bytes:g} inputs of "
            f"{input_bytes / 2**20:.2f} MiB less); gradients bitwise the same: "
            f"{all(torch.equal(a, b) for a, b in zip(full['gradients'], offloaded['gradients']))}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "torch": torch.__version__,
                    "results": results,
                    "offload": stats,
                    "simulation": simulation,
                    "stack_held_bytes": stack,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
    if any(arg.startswith("sac_accel") for arg in sys.argv):
        # The test accelerator's device threads can still be letting go of the last backward
        # while the interpreter finalizes (its package docstring says why); leave without that.
        sys.stdout.flush()
        os._exit(0)
