"""The GPU check's steps for what goes below full recompute: a stack of Llama blocks with their
layer inputs offloaded (`offload-inputs`), and a training step planned for a peak
(`plan-step`), at bf16, hidden 4096, sequence 4096 by default, the peak measured by the device
allocator (torch.cuda.max_memory_allocated on CUDA).

    python3 tools/gpu_check_features.py offload-inputs --device cuda
    python3 tools/gpu_check_features.py plan-step --device cuda

A build of sac_plugin without the feature (no `offload_inputs` argument of sac_plugin.Policy, no
sac_plugin.plan_step) prints "<feature>: not available in this build" and exits with status 77,
which tools/gpu_check.sh reports as such rather than as a failure. A run prints one row per mode
(bytes held between forward and backward, peak over the step, median step time, its ratio to no
checkpointing, whether the gradients equal no checkpointing's bitwise) and exits 1 where the
feature misses its promise: inputs offloaded holding no less than full recompute, or a plan's
measured peak over its budget.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import statistics
import sys
import time

import torch

NOT_AVAILABLE = 77  # tools/gpu_check.sh: "not available in this build"


class Stack(torch.nn.Module):
    """Llama blocks one after another, sharing the rotary tables: what a decoder's layers are."""

    def __init__(self, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        from sac_plugin.models import LlamaBlock, rotary_tables

        self.layers = torch.nn.ModuleList(LlamaBlock(dim, heads) for _ in range(layers))
        cos, sin = rotary_tables(dim // heads, seq)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def recompute_wrap_sites(self):
        return list(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return x


def _not_available(feature: str, why: str) -> None:
    print(f"{feature}: not available in this build ({why})")
    sys.stdout.flush()
    raise SystemExit(NOT_AVAILABLE)


def _device_module(device: torch.device):
    return torch.cuda if device.type == "cuda" else torch.accelerator


def _measure(model, x, grad, device, steps: int) -> dict:
    """Bytes held after the forward, the peak over forward and backward (both above what was
    allocated before the step), the median step time, and the gradients of the first step."""
    memory = _device_module(device)
    times, held, peak, gradients = [], None, None, None
    for step in range(steps + 1):
        x.grad = None
        model.zero_grad(set_to_none=True)
        torch.accelerator.synchronize()
        memory.reset_peak_memory_stats()
        before = memory.memory_allocated()
        started = time.perf_counter()
        out = model(x)
        torch.accelerator.synchronize()
        if step == 0:
            held = memory.memory_allocated() - before
        out.backward(grad)
        torch.accelerator.synchronize()
        if step == 0:
            peak = memory.max_memory_allocated() - before
            gradients = [p.grad.detach().cpu() for p in model.parameters()] + [x.grad.detach().cpu()]
        else:
            times.append(time.perf_counter() - started)
        del out
    return {"held_bytes": held, "peak_bytes": peak, "step_s": statistics.median(times), "gradients": gradients}


def _print_rows(title: str, rows: dict) -> None:
    base = rows["no checkpointing"]
    print(title)
    print(f"{'mode':<44}{'held MiB':>10}{'peak MiB':>10}{'step ms':>9}{'vs none':>9}  bitwise")
    for name, row in rows.items():
        print(
            f"{name:<44}{row['held_bytes'] / 2**20:>10.1f}{row['peak_bytes'] / 2**20:>10.1f}"
            f"{row['step_s'] * 1e3:>9.2f}{row['step_s'] / base['step_s']:>9.3f}  {row['bitwise']}"
        )


def _rows(results: dict) -> dict:
    reference = results["no checkpointing"]["gradients"]
    rows = {}
    for name, result in results.items():
        gradients = result.pop("gradients")
        result["bitwise"] = all(torch.equal(a, b) for a, b in zip(reference, gradients))
        rows[name] = result
    return rows


def _setup(args):
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Stack(args.dim, args.heads, args.layers, args.seq).to(device=device, dtype=dtype)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    return model, x, torch.randn_like(x), device


def _checkpointed(model, policy, checkpoint=True):
    import sac_plugin

    # The buffers (the rotary tables, read only) are shared rather than copied, as the layers share
    # them: a plain tensor on a PrivateUse1 device (the test accelerator) cannot be deep-copied.
    copied = copy.deepcopy(model, {id(buffer): buffer for buffer in model.buffers()})
    for layer in copied.layers if checkpoint else ():
        sac_plugin.apply_selective_checkpointing(layer, policy)
    return copied


def offload_inputs(args) -> int:
    import sac_plugin

    if "offload_inputs" not in inspect.signature(sac_plugin.Policy).parameters:
        _not_available("layer inputs offloaded", "sac_plugin.Policy has no offload_inputs argument")
    from sac_plugin.targets import ATTENTION_OPS

    model, x, grad, device = _setup(args)
    attention = sorted(ATTENTION_OPS.resolve())
    modes = {
        "no checkpointing": model,
        "full recompute": _checkpointed(model, None),
        "full recompute, inputs offloaded": _checkpointed(model, sac_plugin.Policy(offload_inputs=True)),
        "offload attention, inputs offloaded": _checkpointed(
            model, sac_plugin.Policy(offloaded_ops=attention, offload_inputs=True)
        ),
    }
    rows = _rows({name: _measure(module, x, grad, device, args.steps) for name, module in modes.items()})
    _print_rows(
        f"layer inputs offloaded: {args.layers} Llama blocks, dim {args.dim}, seq {args.seq}, {args.dtype}, "
        f"{device}, torch {torch.__version__}",
        rows,
    )
    full, offloaded = rows["full recompute"], rows["full recompute, inputs offloaded"]
    print(
        f"inputs offloaded hold {(full['held_bytes'] - offloaded['held_bytes']) / 2**20:.1f} MiB less than full "
        f"recompute; peak {offloaded['peak_bytes'] / max(full['peak_bytes'], 1):.3f} of full recompute's"
    )
    _write(args, rows)
    return 0 if offloaded["held_bytes"] < full["held_bytes"] else 1


def _absolute_peak(model, x, grad, device) -> int:
    """The device's peak over one step from zeroed gradients, everything allocated counted (what
    plan_step's peak_bytes bounds)."""
    memory = _device_module(device)
    model.zero_grad(set_to_none=True)
    x.grad = None
    gc.collect()  # the copies measured before (a checkpointed module refers to itself) are gone
    torch.accelerator.synchronize()
    memory.reset_peak_memory_stats()
    model(x).backward(grad)
    torch.accelerator.synchronize()
    return memory.max_memory_allocated()


def plan_step(args) -> int:
    import sac_plugin

    if not hasattr(sac_plugin, "plan_step"):
        _not_available("plan_step", "sac_plugin has no plan_step")
    model, x, grad, device = _setup(args)
    reference = {
        "no checkpointing": _measure(model, x, grad, device, args.steps),
        "full recompute": _measure(_checkpointed(model, None), x, grad, device, args.steps),
    }
    # plan_step bounds the step's absolute peak (parameters, inputs and gradients included), so
    # each peak is measured with the same models alive: this one, and one copy of it.
    none_peak = _absolute_peak(_checkpointed(model, None, checkpoint=False), x, grad, device)
    full_peak = _absolute_peak(_checkpointed(model, None), x, grad, device)
    offloaded_peak = _absolute_peak(_checkpointed(model, sac_plugin.Policy(offload_inputs=True)), x, grad, device)
    # Between full recompute's peak and no checkpointing's (the plan uses the room); and, where
    # offloading the layers' inputs lowers the peak at these sizes, between that peak and full
    # recompute's (only offloading reaches there).
    budgets = {"halfway, no offload": (full_peak + (none_peak - full_peak) // 2, False)}
    if offloaded_peak < full_peak:
        budgets["below full recompute, offload"] = ((offloaded_peak + full_peak) // 2, True)
    else:
        print(
            f"plan_step: offloading the inputs does not lower the peak at these sizes "
            f"({offloaded_peak / 2**20:.2f} against full recompute's {full_peak / 2**20:.2f} MiB)"
        )
    print(
        f"plan_step: peaks {none_peak / 2**20:.2f} MiB without checkpointing, {full_peak / 2**20:.2f} MiB full "
        f"recompute, {offloaded_peak / 2**20:.2f} MiB full recompute with the inputs offloaded"
    )
    results, failed = dict(reference), False
    for name, (peak_bytes, offload) in budgets.items():
        # The buffers (the rotary tables) are shared, as in _checkpointed.
        gc.collect()
        planned = _checkpointed(model, None, checkpoint=False)

        def step(module=planned):
            module.zero_grad(set_to_none=True)
            x.grad = None
            module(x).backward(grad)

        try:
            plan = sac_plugin.plan_step(
                planned, step, peak_bytes=peak_bytes, layers=list(planned.layers), offload=offload
            )
        except Exception as error:  # a budget no plan reaches is a PlanError naming the lowest peak
            print(f"plan_step, {name} ({peak_bytes / 2**20:.2f} MiB): {type(error).__name__}: {error}")
            failed = True
            continue
        measured = _absolute_peak(planned, x, grad, device)
        result = _measure(planned, x, grad, device, args.steps)
        result.update(budget_bytes=peak_bytes, predicted_peak=plan.predicted_peak, measured_step_peak=measured)
        results[f"plan, {name}"] = result
        print(
            f"plan_step, {name}: budget {peak_bytes / 2**20:.2f} MiB, predicted {plan.predicted_peak / 2**20:.2f}, "
            f"measured {measured / 2**20:.2f}"
        )
        if measured > peak_bytes:
            print(
                f"plan_step, {name}: measured peak {measured / 2**20:.2f} MiB is over its budget "
                f"{peak_bytes / 2**20:.2f} MiB"
            )
            failed = True
        print(plan.table())
    rows = _rows(results)
    _print_rows(
        f"plan_step: {args.layers} Llama blocks, dim {args.dim}, seq {args.seq}, {args.dtype}, {device}, "
        f"torch {torch.__version__}",
        rows,
    )
    _write(args, rows)
    return 1 if failed else 0


def _write(args, rows) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": rows}, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["offload-inputs", "plan-step"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device.startswith("sac_accel"):
        import sac_test_accelerator  # noqa: F401  registers the device before the first backward
    elif args.device == "cpu":
        parser.error("--device cpu: the peak needs a device allocator (cuda, or sac_accel on the test accelerator)")
    return offload_inputs(args) if args.check == "offload-inputs" else plan_step(args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    if any(arg.startswith("sac_accel") for arg in sys.argv):
        # The test accelerator's device threads can still be letting go of the last backward
        # while the interpreter finalizes (its package docstring says why); leave without that.
        import os

        os._exit(code)
    sys.exit(code)
