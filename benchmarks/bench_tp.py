"""A tensor-parallel block on gloo ranks: collectives and time per phase, sac_plugin against
torch's SAC keeping the same ops, full recompute and no checkpointing.

    python3 benchmarks/bench_tp.py --ranks 2 --dim 256 --seq 256 --steps 5

The block is two MLPs behind SequenceParallel norms, each up projection ColwiseParallel and each
down projection RowwiseParallel, all-reduced and added to the replicated residual
(torch.distributed.tensor.parallel). The selective modes keep aten::mm and the residual
aten::add. Per mode, rank 0 reports the median forward, backward and recompute (inside the
backward) milliseconds, and the collectives each phase ran in the last step, counted by
sac_plugin.audit (functional collectives by op, wait_tensor left out). The modes run interleaved,
round by round in a shuffled order; every mode runs under the same audit, which intercepts every
op, so the times include that cost for all of them.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MODES = ("no checkpointing", "full recompute", "torch SAC", "sac_plugin")
_COLLECTIVES = ("c10d::", "_c10d_functional::")
_NOT_COUNTED = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")


class _Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, dim, checkpointed):
        super().__init__()
        self.norm1, self.mlp1 = nn.LayerNorm(dim), _Mlp(dim)
        self.norm2, self.mlp2 = nn.LayerNorm(dim), _Mlp(dim)
        self.checkpointed = checkpointed

    def _block(self, x):
        h = x + self.mlp1(self.norm1(x))
        return h + self.mlp2(self.norm2(h))

    def forward(self, x):
        return self.checkpointed(self._block, x)


class _Phases:
    """Collective counts and seconds per phase; the recompute is the checkpointed function run
    inside a backward."""

    def __init__(self, audit):
        self.audit, self.phase, self.counts, self.seconds = audit, None, {}, {}
        self._last, self._since = self._totals(), time.perf_counter()

    def _totals(self):
        return {
            row.op: row.forward + row.recompute + row.backward
            for row in self.audit.rows()
            if row.op.startswith(_COLLECTIVES) and row.op not in _NOT_COUNTED
        }

    def switch(self, phase):
        now, totals = time.perf_counter(), self._totals()
        if self.phase is not None:
            counts = self.counts.setdefault(self.phase, {})
            for op, total in totals.items():
                if total > self._last.get(op, 0):
                    counts[op] = counts.get(op, 0) + total - self._last.get(op, 0)
            self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self._since
        self.phase, self._last, self._since = phase, totals, time.perf_counter()

    def marked(self, function):
        def run(*args):
            if torch._C._current_graph_task_id() == -1:
                return function(*args)
            outer = self.phase
            self.switch("recompute")
            try:
                return function(*args)
            finally:
                self.switch(outer)

        return run


def _checkpointed(mode, phases):
    import sac_plugin
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "no checkpointing":
        return lambda function, x: function(x)
    options = {}
    if mode == "torch SAC":
        kept = [torch.ops.aten.mm.default, torch.ops.aten.add.Tensor]
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, kept)
    elif mode == "sac_plugin":
        options["context_fn"] = sac_plugin.context_fn(sac_plugin.Policy(kept_ops=["aten::mm", "aten::add"]))
    return lambda function, x: checkpoint(phases.marked(function), x, use_reentrant=False, **options)


def measure(args):
    """Every mode's milliseconds and collectives per phase on this rank, in a process group of
    gloo ranks that is already up (the ranks the block is parallelized over)."""
    import sac_plugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {}
    for n in (1, 2):
        plan[f"norm{n}"] = SequenceParallel()
        plan[f"mlp{n}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"mlp{n}.down"] = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
    torch.manual_seed(0)
    x = DTensor.from_local(torch.randn(args.batch, args.seq, args.dim), mesh, [Replicate()], run_check=False)
    # Every mode runs each round, in a shuffled order, as _common.time_interleaved does: machine
    # noise hits all modes alike. One audit counts for all; each mode charges its own phases.
    with sac_plugin.audit() as audit:
        runs = {}
        for mode in MODES:
            phases = _Phases(audit)
            torch.manual_seed(0)
            block = parallelize_module(_Block(args.dim, _checkpointed(mode, phases)), mesh, plan)
            runs[mode] = (block, phases, {"forward": [], "backward": [], "recompute": []})
        order = list(MODES)
        shuffle = random.Random(0).shuffle
        gc.collect()
        gc.disable()
        try:
            for step in range(args.steps + 1):  # the first round warms up
                shuffle(order)
                for mode in order:
                    block, phases, samples = runs[mode]
                    phases.counts, phases.seconds = {}, {}
                    phases.switch("forward")
                    loss = block(x).to_local().pow(2).mean()
                    phases.switch("backward")
                    loss.backward()
                    phases.switch(None)
                    block.zero_grad(set_to_none=True)
                    if step:
                        seconds = {phase: phases.seconds.get(phase, 0.0) for phase in samples}
                        seconds["backward"] += seconds["recompute"]  # the recompute runs inside the backward
                        for phase, value in seconds.items():
                            samples[phase].append(value)
        finally:
            gc.enable()
    results = {
        mode: {
            "ms": {phase: 1e3 * statistics.median(values) for phase, values in samples.items()},
            "collectives": phases.counts,
        }
        for mode, (_, phases, samples) in runs.items()
    }
    return results


def _rank(rank, world, init_file, result_file, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = measure(args)
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _describe(counts):
    if not counts:
        return "none"
    return ", ".join(f"{n} {op.split('::')[1]}" for op, n in sorted(counts.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(args.ranks, os.path.join(tmp, "init"), result_file, args), nprocs=args.ranks)
        with open(result_file) as f:
            results = json.load(f)
    print_report(results, args, "python3 " + " ".join(sys.argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=2)


def print_report(results, args, command):
    """Prints what measure() returned on rank 0, the command, date, torch and machine first."""
    print(f"command: {command}")
    print(
        f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs, "
        f"{args.ranks} gloo ranks, one thread each"
    )
    print(f"TP block: dim {args.dim}, seq {args.seq}, batch {args.batch}, median of {args.steps} steps, rank 0")
    print(
        f"{'mode':<18}{'fwd ms':>8}{'bwd ms':>8}{'recomp ms':>10}{'bwd vs torch SAC':>18}  collectives in the recompute"
    )
    reference = results["torch SAC"]["ms"]["backward"]
    for mode, r in results.items():
        ms = r["ms"]
        print(
            f"{mode:<18}{ms['forward']:>8.2f}{ms['backward']:>8.2f}{ms['recompute']:>10.2f}"
            f"{ms['backward'] / reference:>18.3f}  {_describe(r['collectives'].get('recompute'))}"
        )
    for mode, r in results.items():
        print(
            f"collectives per phase, {mode}: " + "; ".join(f"{p}: {_describe(c)}" for p, c in r["collectives"].items())
        )


if __name__ == "__main__":
    main()
