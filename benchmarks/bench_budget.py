"""Memory-budget plans against hand-written policies, torch.compile's memory budget and torch_remat,
measured side by side in one run, one table per layer.

    .venv/bin/python benchmarks/bench_budget.py                 # the full run (prints its command and wall time)
    .venv/bin/python benchmarks/bench_budget.py --quick         # a smoke run: tiny layers, every column
    options: [--sizes 128x128 256x256] [--budgets 0.1 0.25 0.5] [--models llama moe] [--reps 7]
             [--steps 1] [--tolerance 0.05] [--no-compile] [--no-remat] [--json out.json]
             [--plots] [--plot-dir docs]

For each reference layer (sac_plugin.models.LlamaBlock, MoEBlock) and size (dim x seq, batch 2),
one table, a row per mode:
  - no checkpointing, full recompute;
  - every hand-written policy (attention kept; attention + every other mm; attention + all mm;
    units: attention + the mlp unit for Llama, attention + moe_gate + moe_dispatch for MoE);
  - for each budget (a fraction of the layer's no-checkpointing activation bytes):
      the plan (sac_plugin.plan, profiled once per layer): bytes held as measured, predicted,
        and how far off the prediction is;
      torch.compile with torch._functorch.config.activation_memory_budget at the same budget
        (backend aot_eager_decomp_partition: the min-cut partitioner that honours the budget,
        without Inductor's codegen, so it runs on CPU);
      torch_remat keeping what the plan keeps, as far as regions can say it: torch_remat keeps
        the tensors a `remat.region(fn, name, recompute=False)` call saves, so each module the
        plan keeps a call in (the innermost module of each kept call, from sac_plugin.trace) is
        run as such a region, its outputs marked with recompute_needs_tensor, inside
        remat.checkpoint; calls in the layer's own body have no module to wrap and are left to
        recompute (README, "Memory budget").
  Columns: bytes held (benchmarks/bench_memory.py's accounting: sac_plugin.memory.
  track_activation_memory), predicted bytes and % off (plans), step time (forward + backward of
  the layer: the median of --reps samples of --steps steps each, modes interleaved in a shuffled
  order, the garbage collector off while timing), and whether it fits each budget.
Under the table, per budget, the verdict: the plan's median step time against the fastest
hand-written policy that fits the budget (medians), then the two timed again head to head (the
two alone, interleaved, 2 x --reps rounds; the median of the rounds' ratios), "plan <= best" when
that ratio is at most 1 + --tolerance. Also times the solver on a synthetic 1,000-call profile
(it should take under a second). The step times mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import sac_plugin
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import LlamaBlock, MoEBlock, rotary_tables
from sac_plugin.planner import LayerProfile, ProfiledCall, reference_policies
from sac_plugin.models import LLAMA_TARGETS, MOE_TARGETS

from _common import have_torch_remat, time_interleaved, why_trace_cannot_run

MIB = 2**20
QUICK = {"sizes": ["64x32"], "budgets": [0.25], "reps": 2, "steps": 1, "runs": 1}


def make_layer(model, dim, heads, seq, batch, device):
    torch.manual_seed(0)
    block = (LlamaBlock if model == "llama" else MoEBlock)(dim, heads).to(device)
    cos, sin = rotary_tables(dim // heads, seq, device=device)
    x = torch.randn(batch, seq, dim, device=device, requires_grad=True)
    return block, (x, cos, sin)


def units_config(model):
    if model == "llama":
        return sac_plugin.RecomputeConfig(kept_units=["attn", "mlp"]), LLAMA_TARGETS
    return sac_plugin.RecomputeConfig(kept_units=["attn", "moe_gate", "moe_dispatch"]), MOE_TARGETS


def checkpointed(block, policy=None, config=None):
    layer = copy.deepcopy(block)
    if config is not None:
        sac_plugin.apply_recompute_config(layer, config[0], target_map=config[1], wrap_sites=[layer])
    elif policy is not None:
        sac_plugin.apply_selective_checkpointing(layer, policy)
    return layer


def checkpoint_rng_state_bytes(device: torch.device) -> int:
    """Device bytes of the RNG state torch's checkpoint saves, measured apart from the planner's
    count: the CPU generator's state, a CPU tensor; an accelerator's states are host tensors."""
    return torch.get_rng_state().untyped_storage().nbytes() if device.type == "cpu" else 0


def held(layer, args, checkpointed_layer: bool):
    """Bytes the step holds from its forward to its backward beyond what the caller holds anyway
    (the layer's output): benchmarks/bench_memory.py's count of the saved and kept tensors, less
    the output's storage, plus the RNG state a checkpoint saves. The plan predicts this count."""
    x = args[0].detach().requires_grad_()
    with track_activation_memory(layer.parameters()) as memory:
        out = layer(x, *args[1:])
        output = out.untyped_storage()
        value = memory.bytes() - (
            output.nbytes()
            if any(t.untyped_storage().data_ptr() == output.data_ptr() for t in memory._tensors())
            else 0
        )
    out.sum().backward()
    if checkpointed_layer:
        value += checkpoint_rng_state_bytes(args[0].device)
    return value


def step(layer, args):
    x = args[0].detach().requires_grad_()
    layer(x, *args[1:]).sum().backward()


def median_step_times(modes: dict, args, reps: int, steps: int, device) -> dict:
    """Median seconds per step of every layer in `modes` (_common.time_interleaved)."""
    runs = {name: (lambda layer=layer: step(layer, args)) for name, layer in modes.items()}
    times = time_interleaved(runs, reps, steps, warmup=2, device=device)
    return {name: statistics.median(values) for name, values in times.items()}


def paired_ratio(plan_layer, best_layer, args, reps: int, steps: int, device) -> float:
    """The plan's step time over the best fitting hand-written policy's, timed head to head: the
    two alone, interleaved round by round, the median of the rounds' ratios (a round's two samples
    see the same machine load, so load that drifts between rounds cancels)."""
    runs = {"plan": lambda: step(plan_layer, args), "best": lambda: step(best_layer, args)}
    times = time_interleaved(runs, reps, steps, warmup=2, device=device)
    return statistics.median(p / b for p, b in zip(times["plan"], times["best"]))


class _Compiled(torch.nn.Module):
    """A copy of the layer under torch.compile, compiled (on its first call) and run with
    activation_memory_budget patched to its budget."""

    def __init__(self, block, budget):
        super().__init__()
        self.layer = copy.deepcopy(block)
        self.budget = budget
        self.compiled = torch.compile(self.layer, backend="aot_eager_decomp_partition", dynamic=False)

    def forward(self, x, cos, sin):
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.compiled(x, cos, sin)


def remat_modules(block, inputs, policy):
    """The modules torch_remat keeps for a plan: the innermost module of each call the plan keeps
    (sac_plugin.trace of one step), and the kept calls in the layer's own body (not wrappable)."""
    layer = checkpointed(block, policy)
    x = inputs[0].detach().requires_grad_()
    with sac_plugin.trace(layer) as trace:
        layer(x, *inputs[1:]).sum().backward()
    kept = [e for e in trace.trace if e.phase == "forward" and e.status == "kept"]
    modules = {e.module for e in kept if e.module != e.layer}
    # A region nested in a kept region is inert in torch_remat: name the outermost only.
    modules = sorted(m for m in modules if not any(m.startswith(other + ".") for other in modules))
    in_body = sorted({e.op for e in kept if e.module == e.layer})
    return modules, in_body


class _Remat(torch.nn.Module):
    """A copy of the layer under torch_remat: the whole layer a remat.checkpoint, each module in
    `keep` a remat.region(..., recompute=False) whose outputs are marked recompute_needs_tensor
    (their consumers are bare code, which torch_remat cannot see)."""

    def __init__(self, block, keep):
        import torch_remat as remat

        super().__init__()
        self.layer = copy.deepcopy(block)
        calls: dict[str, int] = {}
        for name in keep:
            module = self.layer.get_submodule(name)

            def forward(*args, _forward=module.forward, _name=name, **kwargs):
                n = calls.get(_name, 0)
                calls[_name] = n + 1  # region names are unique per phase: a module called twice gets #1
                out = remat.region(_forward, _name if n == 0 else f"{_name}#{n}", recompute=False)(*args, **kwargs)
                remat.recompute_needs_tensor(
                    *[t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
                )
                return out

            module.forward = forward

        def run(x, cos, sin):
            calls.clear()  # a phase (the forward, the recompute) starts
            return self.layer(x, cos, sin)

        self.run = remat.checkpoint(region_name="layer")(run)

    def forward(self, x, cos, sin):
        return self.run(x, cos, sin)


OPS = [
    "aten::mm",
    "aten::bmm",
    "aten::addmm",
    "aten::tanh",
    "aten::sin",
    "aten::cos",
    "aten::exp",
    "aten::mul.Tensor",
    "aten::add.Tensor",
    "aten::sigmoid",
]


def solver_speed(calls=1000):
    rng = random.Random(0)
    profile = LayerProfile(
        tuple(
            ProfiledCall(
                OPS[i % len(OPS)],
                i // len(OPS),
                "",
                rng.choice([0, 4096, 65536, 1 << 20, 3 << 20]) + rng.randrange(0, 4096, 4),
                rng.random() * 1e-3,
                "",
            )
            for i in range(calls)
        ),
        200 << 20,
        1 << 20,
        1,
    )
    nothing_kept = sac_plugin.Plan(profile, 1.0, frozenset())
    start = time.perf_counter()
    plan = nothing_kept.with_budget(0.3)  # builds the knapsack table, then solves
    seconds = time.perf_counter() - start
    assert plan.held_bytes <= plan.budget_bytes
    return seconds, len(plan.kept)


def run_layer(args, model, size):
    """One layer and size: every mode's bytes and median step time, and a row per budget."""
    dim, seq = map(int, size.split("x"))
    hand = reference_policies()
    hand_names = list(hand) + ["units"]
    block, inputs = make_layer(model, dim, args.heads, seq, args.batch, args.device)
    base_plan = sac_plugin.plan(block, *inputs, budget=1.0, runs=args.runs)
    none_bytes = base_plan.profile.no_checkpoint_bytes
    layers = {"no checkpointing": copy.deepcopy(block), "full recompute": checkpointed(block, sac_plugin.Policy())}
    for name, policy in hand.items():
        layers[name] = checkpointed(block, policy)
    layers["units"] = checkpointed(block, config=units_config(model))
    plans, remat_keep = {}, {}
    for budget in args.budgets:
        plans[budget] = plan = base_plan.with_budget(budget)
        layers[f"plan {budget}"] = checkpointed(block, plan.policy)
        if args.compile:
            layers[f"compile {budget}"] = _Compiled(block, budget)
        if args.remat:
            remat_keep[budget] = remat_modules(block, inputs, plan.policy)
            layers[f"torch_remat {budget}"] = _Remat(block, remat_keep[budget][0])
    if args.plot_dir:
        plot(args, model, dim, seq, plans[args.budgets[0]], hand)
    measured = {name: held(layer, inputs, name != "no checkpointing") for name, layer in layers.items()}
    times = median_step_times(layers, inputs, args.reps, args.steps, args.device)
    rows = []
    for budget in args.budgets:
        limit = int(budget * none_bytes)
        plan = plans[budget]
        fitting = [n for n in hand_names if measured[n] <= limit]
        best = min(fitting, key=lambda n: times[n]) if fitting else None
        plan_s = times[f"plan {budget}"]
        row = {
            "model": model,
            "dim": dim,
            "seq": seq,
            "batch": args.batch,
            "heads": args.heads,
            "budget": budget,
            "no_checkpointing_bytes": none_bytes,
            "budget_bytes": limit,
            "plan_predicted_bytes": plan.held_bytes,
            "plan_measured_bytes": measured[f"plan {budget}"],
            "plan_predicted_off": abs(plan.held_bytes - measured[f"plan {budget}"])
            / max(1, measured[f"plan {budget}"]),
            "plan_fits": measured[f"plan {budget}"] <= limit,
            "plan_kept_calls": len(plan.kept),
            "plan_step_s": plan_s,
            "no_checkpointing": {
                "bytes": none_bytes and measured["no checkpointing"],
                "step_s": times["no checkpointing"],
            },
            "full_recompute": {"bytes": measured["full recompute"], "step_s": times["full recompute"]},
            "hand": {n: {"bytes": measured[n], "step_s": times[n], "fits": measured[n] <= limit} for n in hand_names},
            "best_fitting_hand": best,
            "tolerance": args.tolerance,
            "plan_over_best": plan_s / times[best] if best else None,
        }
        if best:
            row["plan_over_best_paired"] = paired_ratio(
                layers[f"plan {budget}"], layers[best], inputs, 2 * args.reps, args.steps, args.device
            )
            row["plan_le_best"] = row["plan_over_best_paired"] <= 1 + args.tolerance
        else:
            row["plan_over_best_paired"] = row["plan_le_best"] = None
        if args.compile:
            c = f"compile {budget}"
            row["compile"] = {"bytes": measured[c], "step_s": times[c], "fits": measured[c] <= limit}
        if args.remat:
            r = f"torch_remat {budget}"
            row["torch_remat"] = {
                "bytes": measured[r],
                "step_s": times[r],
                "fits": measured[r] <= limit,
                "regions": remat_keep[budget][0],
                "kept_in_layer_body": remat_keep[budget][1],
            }
        rows.append(row)
    print_table(args, rows)
    return rows


def plot(args, model, dim, seq, plan, hand):
    try:
        path = plan.plot(
            f"{args.plot_dir}/plan_{model}_{dim}x{seq}.png",
            policies={**hand, "units": units_policy_for_plot(model)},
            title=f"{model} layer, dim {dim}, seq {seq}, batch {args.batch}",
        )
        print(f"plot: {path}")
    except ImportError as error:
        print(f"  (no plot: {error})", file=sys.stderr)


def units_policy_for_plot(model):
    # Units are evaluated on the profile by innermost unit; the reference layers open no units in
    # code, so the plot marks the units policy by its kept ops (attention, routing ops).
    config, targets = units_config(model)
    kept_ops = [targets[unit].resolve() for unit in config.units if isinstance(targets[unit], sac_plugin.KeptOps)]
    return sac_plugin.Policy(kept_ops=frozenset().union(*kept_ops))


def print_table(args, rows):
    """One table per layer: a row per mode, a fits column per budget, then the verdict per budget."""
    first = rows[0]
    budgets = [r["budget"] for r in rows]
    mib = lambda n: f"{n / MIB:.3f}"  # noqa: E731
    print(
        f"\n{first['model']} layer, dim {first['dim']}, seq {first['seq']}, batch {first['batch']}, heads "
        f"{first['heads']}, {args.device}, torch {torch.__version__}: no checkpointing holds "
        f"{mib(first['no_checkpointing_bytes'])} MiB; budgets "
        + ", ".join(f"{r['budget']:.2f} = {mib(r['budget_bytes'])} MiB" for r in rows)
    )
    header = f"{'mode':<34}{'held MiB':>10}{'predicted':>11}{'off':>7}{'step ms':>9}" + "".join(
        f"{'fits ' + format(b, '.2f'):>11}" for b in budgets
    )
    print(header)
    print("-" * len(header))

    def line(name, bytes_, step_s, predicted=None, only=None):
        fits = "".join(
            f"{('' if only is not None and b != only else 'yes' if bytes_ <= r['budget_bytes'] else 'NO'):>11}"
            for b, r in zip(budgets, rows)
        )
        pred = f"{predicted / MIB:.3f}" if predicted is not None else "-"
        off = f"{abs(predicted - bytes_) / max(1, bytes_):.1%}" if predicted is not None else "-"
        print(f"{name:<34}{mib(bytes_):>10}{pred:>11}{off:>7}{step_s * 1e3:>9.2f}{fits}")

    line("no checkpointing", first["no_checkpointing"]["bytes"], first["no_checkpointing"]["step_s"])
    line("full recompute", first["full_recompute"]["bytes"], first["full_recompute"]["step_s"])
    for name, h in first["hand"].items():
        line(name, h["bytes"], h["step_s"])
    for r in rows:
        b = r["budget"]
        line(
            f"plan {b:.2f} ({r['plan_kept_calls']} calls kept)",
            r["plan_measured_bytes"],
            r["plan_step_s"],
            predicted=r["plan_predicted_bytes"],
            only=b,
        )
        if "compile" in r:
            line(f"torch.compile budget {b:.2f}", r["compile"]["bytes"], r["compile"]["step_s"], only=b)
        if "torch_remat" in r:
            line(f"torch_remat, plan {b:.2f}'s modules", r["torch_remat"]["bytes"], r["torch_remat"]["step_s"], only=b)
    for r in rows:
        if "torch_remat" in r:
            t = r["torch_remat"]
            body = (
                f"; kept in the layer's body, recomputed: {', '.join(t['kept_in_layer_body'])}"
                if t["kept_in_layer_body"]
                else ""
            )
            print(f"  torch_remat {r['budget']:.2f} regions: {', '.join(t['regions']) or '(none)'}{body}")
    print(f"verdict (plan <= best fitting hand-written when the head-to-head ratio <= {1 + args.tolerance:.2f}):")
    for r in rows:
        best = r["best_fitting_hand"]
        if best is None:
            print(
                f"  budget {r['budget']:.2f}: no hand-written policy fits; plan fits: {'yes' if r['plan_fits'] else 'NO'}"
            )
        else:
            print(
                f"  budget {r['budget']:.2f}: best fitting hand-written: {best} ({r['hand'][best]['step_s'] * 1e3:.2f} ms); "
                f"plan {r['plan_step_s'] * 1e3:.2f} ms = {r['plan_over_best']:.3f}x; head to head (median of paired "
                f"rounds) {r['plan_over_best_paired']:.3f}x: plan <= best: {'yes' if r['plan_le_best'] else 'NO'}"
            )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: overrides sizes, budgets, reps, steps and runs with {QUICK}"
    )
    parser.add_argument("--models", nargs="+", default=["llama", "moe"], choices=["llama", "moe"])
    parser.add_argument("--sizes", nargs="+", default=["128x128", "256x256"], help="dim x seq")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--reps", type=int, default=7, help="timed samples per mode")
    parser.add_argument("--steps", type=int, default=1, help="steps per sample")
    parser.add_argument("--runs", type=int, default=3, help="profiling runs per layer")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="plan <= best fitting hand-written when plan median <= best median x (1 + this)",
    )
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="leave out torch.compile's activation_memory_budget"
    )
    parser.add_argument("--no-remat", dest="remat", action="store_false", help="leave out torch_remat")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--plots", action="store_true", help="regenerate the Pareto plots into docs/")
    parser.add_argument("--plot-dir", help="write the Pareto plots here (--plots: docs)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.plots and not args.plot_dir:
        args.plot_dir = "docs"
    if args.plot_dir:
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
    return args


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    if args.remat and not have_torch_remat():
        print("torch_remat is not installed (pip install --no-deps torch_remat==0.2.2): its rows are left out")
        args.remat = False
    if args.remat:
        # The plan's calls are mapped to torch_remat regions through sac_plugin.trace, which needs the
        # native engine on torch >= 2.13 (it says why otherwise).
        why_not = why_trace_cannot_run()
        if why_not is not None:
            print(f"torch_remat rows are left out: mapping a plan to its regions needs sac_plugin.trace: {why_not}")
            args.remat = False
    # One compiled copy per layer, size and budget, all of the same forward: let dynamo keep
    # them all, and fail rather than fall back to eager silently.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    seconds, kept = solver_speed()
    print(f"solver: a 1,000-call profile planned in {seconds * 1e3:.0f} ms ({kept} calls kept)")
    rows = []
    for model in args.models:
        for size in args.sizes:
            rows += run_layer(args, model, size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "torch": torch.__version__,
                    "solver_seconds_1000_calls": seconds,
                    "argv": sys.argv[1:],
                    "rows": rows,
                },
                f,
                indent=1,
            )
    print(f"\nwall time: {time.perf_counter() - started:.1f} s")
    over = [r for r in rows if not r["plan_fits"]]
    if over:
        raise SystemExit(f"{len(over)} plans hold more than their budget")


if __name__ == "__main__":
    main()
