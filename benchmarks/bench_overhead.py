"""Interception overhead: sac_plugin against torch's own SAC, side by side in one process.

    .venv/bin/python benchmarks/bench_overhead.py [--sizes 64 400 1600] [--seconds 40] [--paths ...]

A checkpointed block of many small ops (tiny matmuls, elementwise chains, a tiny attention) so
that per-op cost dominates. Every mode runs on the same inputs, interleaved round by round in a
shuffled order so that machine noise and allocator state hit all modes alike. Reported per mode: forward+backward time per step (min
and median) and, for the intercepting modes, the overhead per intercepted op:
(mode - full recompute) / ops intercepted, where ops intercepted is what the audit counts in
the forward and the recompute (executions + kept outputs served). Two ratios: with the same
kept-op list (both modes also skip the kept ops' recompute), and "intercept only", a policy that
intercepts every op and keeps none, which isolates the interception cost itself. "median" is the
median of paired differences: each round's (mode - full recompute) from the same round, so load
that drifts between rounds cancels; "min" uses each mode's fastest sample. Each size gets as many
rounds as fill --seconds, and at least 20 (--reps fixes the number instead): a small block's
overhead is a few percent of its step, and twenty rounds of it do not resolve a ratio of 0.05
from 0.07, while a large block's twenty rounds already take longer than that. Beside them, the
per-region set-up: what the region of one checkpoint call costs in the step before any call is
intercepted (the plugin's context function making its two scopes, and each scope's enter and
exit), timed around the calls torch's checkpoint makes.

Each of the plugin's three ways of running is measured in its own process, each against torch's
SAC in that same process (--paths, all three by default): the native path (its fallback on the
dispatch key), the coexisting path (per-op kernels beside another owner's fallback on the key:
the test library tests/support/foreign_fake_owner.cpp, loaded first) and the dispatch-mode
engine (SAC_PLUGIN_ENGINE=dispatch_mode: torch's SAC modes making the plugin's decisions).

A second table keeps only the attention core, in stacks of checkpointed layers, and adds
torch_remat (PyPI; Meta's region-based rematerialization, the core in a `remat.region(...,
recompute=False)`), when it is installed: step time minus full recompute's, per engine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# The coexisting path needs the other owner of the key loaded before sac_plugin.
if os.environ.get("SAC_BENCH_PRELOAD"):
    torch.ops.load_library(os.environ["SAC_BENCH_PRELOAD"])

import sac_plugin  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from sac_plugin.targets import ATTENTION_OPS  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402

from _common import rounds_to_fill, time_interleaved  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AT_LEAST_ROUNDS = 20  # per size, whatever --seconds allows
REGION_SETUP_STEPS = 1000  # timed steps of the per-region set-up (at most; fewer with a small --reps)
PATHS = ("native", "coexisting", "dispatch_mode")


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
# that it exists in every torch version.
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
        "torch SAC, intercept only": step(
            lambda v: checkpoint(block, v, use_reentrant=False, context_fn=torch_intercept_ctx)
        ),
        "sac_plugin, intercept only": step(
            lambda v: checkpoint(block, v, use_reentrant=False, context_fn=plugin_intercept_ctx)
        ),
    }


REGION_STEPS = ("make", "forward enter", "forward exit", "recompute enter", "recompute exit")


class _TimedScope:
    """One of a region's two scopes, its enter and exit timed where the step runs them."""

    __slots__ = ("_scope", "_enter", "_exit")

    def __init__(self, scope, enter: list, exit: list):
        self._scope, self._enter, self._exit = scope, enter, exit

    def __enter__(self):
        start = time.perf_counter_ns()
        self._scope.__enter__()
        self._enter.append(time.perf_counter_ns() - start)
        return self

    def __exit__(self, *exc_info):
        start = time.perf_counter_ns()
        suppress = self._scope.__exit__(*exc_info)
        self._exit.append(time.perf_counter_ns() - start)
        return suppress


def region_setup(block, x, grad, policy, steps: int) -> dict:
    """The per-region set-up of a checkpoint call in a real step, in us (median of `steps`): the
    plugin's context function making the region's two scopes, and each scope's enter and exit,
    timed around the very calls torch's checkpoint makes, with the caches as the step leaves them
    (a step's kernels run between them), the garbage collector off as in time_interleaved. The
    calls the region intercepts are not in it."""
    make_contexts = sac_plugin.context_fn(policy)
    samples = {step: [] for step in REGION_STEPS}

    def timed_contexts():
        start = time.perf_counter_ns()
        forward, recompute = make_contexts()
        samples["make"].append(time.perf_counter_ns() - start)
        return (
            _TimedScope(forward, samples["forward enter"], samples["forward exit"]),
            _TimedScope(recompute, samples["recompute enter"], samples["recompute exit"]),
        )

    gc.disable()  # as while the modes are timed
    try:
        for _ in range(steps + steps // 2):  # the first third warms up
            checkpoint(block, x, use_reentrant=False, context_fn=timed_contexts).backward(grad)
    finally:
        gc.enable()
    medians = {step: statistics.median(t[-steps:]) / 1e3 for step, t in samples.items()}
    medians["total"] = sum(medians.values())
    return medians


def intercepted_ops(run) -> int:
    with sac_plugin.audit() as audit:
        run()
    return sum(row.forward + row.recompute + row.hits for row in audit.rows())


def measure(size: int, reps: int | None, seconds: float, dim: int, device, steps_per_sample: int) -> dict:
    block, _ = make_attention_block(size, dim, device)
    x = torch.randn(16, dim, device=device)
    grad = torch.ones(16, dim, device=device)
    policy = sac_plugin.Policy(kept_ops={"aten::mm"} | ATTENTION_OPS.resolve())
    modes = run_modes(block, x, grad, policy)
    ops = intercepted_ops(modes["sac_plugin"])
    if reps is None:
        reps = rounds_to_fill(modes, seconds, steps_per_sample, at_least=AT_LEAST_ROUNDS, device=device)
    times = time_interleaved(
        modes,
        reps,
        steps_per_sample,
        device=device,
        around=lambda name: sac_plugin.audit() if name == "sac_plugin + audit" else contextlib.nullcontext(),
    )
    summary = {name: {"min": min(t), "median": statistics.median(t)} for name, t in times.items()}
    setup = region_setup(block, x, grad, policy, steps=min(50 * reps, REGION_SETUP_STEPS))
    # The median of paired differences: each round times every mode once, back to back, so a
    # mode's overhead in that round is its time minus full recompute's in the same round. Load
    # that drifts between rounds (a shared machine) cancels out; a median of all of one mode's
    # samples minus a median of another's does not.
    paired = {name: statistics.median(a - b for a, b in zip(t, times["full recompute"])) for name, t in times.items()}

    def overhead(name, stat):
        if stat == "median":
            return paired[name]
        return summary[name][stat] - summary["full recompute"][stat]

    for name in summary:
        if name not in ("no checkpointing", "full recompute"):
            summary[name]["overhead_per_op_us"] = overhead(name, "min") / ops * 1e6
            summary[name]["overhead_median_us"] = overhead(name, "median") * 1e6

    def ratio(plugin, reference, stat):
        return overhead(plugin, stat) / overhead(reference, stat)

    return {
        "size": size,
        "ops_intercepted": ops,
        "rounds": reps,
        "steps_per_sample": steps_per_sample,
        "modes": summary,
        # The headline: same kept-op list, (mode - full recompute).
        "kept_list_ratio": {s: ratio("sac_plugin", "torch SAC", s) for s in ("min", "median")},
        # Interception alone: a policy that intercepts every op and keeps none.
        "intercept_only_ratio": {
            s: ratio("sac_plugin, intercept only", "torch SAC, intercept only", s) for s in ("min", "median")
        },
        "region_setup_us": setup,
        "nothing_kept_over_full": {
            s: summary["sac_plugin, nothing kept"][s] / summary["full recompute"][s] for s in ("min", "median")
        },
    }


# --- the attention core kept, in stacks of layers, with torch_remat ------------------------------------


class Layer(nn.Module):
    """A pre-norm attention layer; its attention core (SDPA) is the one thing every engine keeps.
    `chain` > 0 replaces the MLP by that many tiny elementwise ops (a per-op-cost workload)."""

    def __init__(self, dim: int, heads: int, chain: int):
        super().__init__()
        self.heads, self.chain = heads, chain
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, dim if chain else 4 * dim)
        self.proj = nn.Linear(dim if chain else 4 * dim, dim)

    @staticmethod
    def attention_core(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x, core=None):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = (core or self.attention_core)(q, k, v)
        x = x + self.out(y.transpose(1, 2).reshape(batch, seq, dim))
        h = self.fc(x)
        for i in range(self.chain):
            h = torch.tanh(h) if i % 2 else h * 0.5 + 0.1
        return x + self.proj(F.gelu(h) if not self.chain else h)


def remat_forward(remat, layer):
    """The layer under torch_remat: the whole layer replayed, the attention core a saved region."""

    def run(x):
        y = remat.region(layer.attention_core, "attention", recompute=False)

        def core(q, k, v):
            out = y(q, k, v)
            remat.recompute_needs_tensor(out)
            return out

        return layer(x, core)

    return remat.checkpoint(region_name="layer")(run)


LAYER_CONFIGS = {
    # name: (layers, batch, seq, dim, heads, tiny-op chain)
    "16 layers of 16x16 ops": (16, 1, 16, 16, 4, 16),
    "4 layers, seq 512, dim 256": (4, 1, 512, 256, 4, 0),
}


def measure_layers(name: str, reps: int, steps_per_sample: int, device) -> dict:
    layers_n, batch, seq, dim, heads, chain = LAYER_CONFIGS[name]
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(dim, heads, chain) for _ in range(layers_n)).to(device)
    x = torch.randn(batch, seq, dim, device=device)
    policy = sac_plugin.Policy(kept_ops=ATTENTION_OPS.resolve())
    plugin_ctx = sac_plugin.context_fn(policy)
    torch_ctx = torch_sac_context(policy.kept_overloads())

    def stack(apply_layer):
        def run():
            h = x
            for layer in layers:
                h = apply_layer(layer, h)
            h.sum().backward()

        return run

    modes = {
        "no checkpointing": stack(lambda layer, h: layer(h)),
        "full recompute": stack(lambda layer, h: checkpoint(layer, h, use_reentrant=False)),
        "torch SAC": stack(lambda layer, h: checkpoint(layer, h, use_reentrant=False, context_fn=torch_ctx)),
        "sac_plugin": stack(lambda layer, h: checkpoint(layer, h, use_reentrant=False, context_fn=plugin_ctx)),
    }
    try:
        import torch_remat as remat
    except ImportError:
        remat = None
    if remat is not None:
        wrapped = {id(layer): remat_forward(remat, layer) for layer in layers}
        modes["torch_remat"] = stack(lambda layer, h: wrapped[id(layer)](h))
    times = time_interleaved(modes, reps, steps_per_sample, device=device)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    full = times["full recompute"]
    return {
        "config": name,
        "median_ms": {mode: m * 1e3 for mode, m in median.items()},
        # Median of paired differences, round by round (see measure()).
        "minus_full_recompute_ms": {
            mode: statistics.median(a - b for a, b in zip(t, full)) * 1e3
            for mode, t in times.items()
            if mode not in ("no checkpointing", "full recompute")
        },
        "torch_remat": remat is not None,
    }


# --- report -------------------------------------------------------------------------------------------


def current_path() -> str:
    """The way this process runs the plugin: native, coexisting, or dispatch_mode."""
    return "dispatch_mode" if sac_plugin.engine() == "dispatch_mode" else sac_plugin.interception_path()


def print_report(report):
    results = report["results"]
    print(
        f"\n#### path: {report['path']} (interception overhead, {report['device']}, torch {report['torch']}, "
        f"{report['threads']} threads)"
    )
    for r in results:
        print(
            f"\nblock of ~{r['size']} ops ({r['ops_intercepted']} intercepted per step: forward + recompute; "
            f"{r['rounds']} rounds of {r['steps_per_sample']} step{'' if r['steps_per_sample'] == 1 else 's'})"
        )
        print(f"  {'mode':<28}{'min ms':>10}{'median ms':>11}{'overhead/op (min)':>19}")
        for name, m in r["modes"].items():
            per_op = f"{m['overhead_per_op_us']:>11.2f} us" if "overhead_per_op_us" in m else ""
            print(f"  {name:<28}{m['min'] * 1e3:>10.2f}{m['median'] * 1e3:>11.2f}{per_op:>19}")
        for label, key in (
            ("plugin overhead / torch SAC overhead, same kept list", "kept_list_ratio"),
            ("plugin overhead / torch SAC overhead, intercept only", "intercept_only_ratio"),
            ("plugin with nothing kept / full recompute", "nothing_kept_over_full"),
        ):
            print(f"  {label}: {r[key]['min']:.3f} (min), {r[key]['median']:.3f} (median)")
        setup, overhead = r["region_setup_us"], r["modes"]["sac_plugin"]["overhead_median_us"]
        print(
            f"  per-region set-up in the step: {setup['total']:.1f} us of the plugin's {overhead:.1f} us overhead "
            "(median): " + ", ".join(f"{step} {setup[step]:.1f}" for step in REGION_STEPS)
        )
    for layers in report.get("layers", []):
        print(
            f"\n{layers['config']}, attention core kept: step time minus full recompute's (median of paired "
            "differences)"
        )
        for mode, ms in layers["minus_full_recompute_ms"].items():
            print(f"  {mode:<28}{ms:>+10.2f} ms")
        if not layers["torch_remat"]:
            print("  torch_remat                 not installed (pip install --no-deps torch_remat)")


def print_summary(reports):
    print("\n#### summary: plugin overhead / torch SAC overhead, same kept list, median (min)")
    sizes = [r["size"] for r in reports[0]["results"]]
    print(f"  {'path':<15}" + "".join(f"{f'{s} ops':>20}" for s in sizes) + f"{'overhead/op, largest':>24}")
    for report in reports:
        cells = "".join(
            f"{r['kept_list_ratio']['median']:>11.3f} ({r['kept_list_ratio']['min']:.3f})" for r in report["results"]
        )
        largest = report["results"][-1]["modes"]["sac_plugin"]["overhead_per_op_us"]
        torch_per_op = report["results"][-1]["modes"]["torch SAC"]["overhead_per_op_us"]
        print(f"  {report['path']:<15}{cells}{largest:>10.2f} us (torch {torch_per_op:.2f})")


def measure_this_process(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    report = {
        "path": current_path(),
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    report["results"] = [
        measure(size, args.reps, args.seconds, args.dim, device, args.steps_per_sample) for size in args.sizes
    ]
    layer_reps = AT_LEAST_ROUNDS if args.reps is None else args.reps
    report["layers"] = [measure_layers(name, layer_reps, args.steps_per_sample, device) for name in args.layers]
    return report


def foreign_owner_library() -> Path:
    version = torch.__version__.split("+")[0]
    return Path(
        os.environ.get("SAC_TEST_FOREIGN_OWNER", ROOT / "build" / f"torch-{version}" / "libsac_test_foreign_owner.so")
    )


def measure_in_subprocess(path: str, args) -> dict | None:
    """Runs this tool for one path in a fresh process (the path is chosen at import)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SAC_PLUGIN_ENGINE", "SAC_BENCH_PRELOAD")}
    if path == "coexisting":
        owner = foreign_owner_library()
        if not owner.exists():
            print(f"bench: skipping the coexisting path: {owner} is not built (bash tools/build.sh builds it)")
            return None
        env["SAC_BENCH_PRELOAD"] = str(owner)
    elif path == "dispatch_mode":
        env["SAC_PLUGIN_ENGINE"] = "dispatch_mode"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable,
            __file__,
            "--this-process",
            "--json",
            out.name,
            "--sizes",
            *map(str, args.sizes),
            *(["--reps", str(args.reps)] if args.reps is not None else []),
            "--seconds",
            str(args.seconds),
            "--steps-per-sample",
            str(args.steps_per_sample),
            "--dim",
            str(args.dim),
            "--device",
            args.device,
            "--threads",
            str(args.threads),
            "--layers",
            *args.layers,
        ]
        subprocess.run(command, env=env, check=True)
        report = json.loads(Path(out.name).read_text())
    if report["path"] != path:
        raise SystemExit(f"bench: asked for the {path} path, the process ran {report['path']}")
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 400, 1600])
    parser.add_argument(
        "--seconds",
        type=float,
        default=40.0,
        help=f"timing per size and path: as many rounds as fill it, at least {AT_LEAST_ROUNDS} (default %(default)s)",
    )
    parser.add_argument("--reps", type=int, help="rounds per size, fixed (overrides --seconds)")
    parser.add_argument("--steps-per-sample", type=int, default=5)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: steadier timings)")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(PATHS),
        help="the plugin's ways of running to measure, each in its own process",
    )
    parser.add_argument(
        "--layers",
        nargs="*",
        choices=list(LAYER_CONFIGS),
        default=list(LAYER_CONFIGS),
        help="stacks of layers for the attention-core table (none: skip it)",
    )
    parser.add_argument("--this-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.this_process:
        report = measure_this_process(args)
        print_report(report)
        Path(args.json).write_text(json.dumps(report, indent=2))
        return
    reports = [r for r in (measure_in_subprocess(path, args) for path in args.paths) if r is not None]
    print_summary(reports)
    if args.json:
        Path(args.json).write_text(json.dumps({"reports": reports}, indent=2))


if __name__ == "__main__":
    main()
