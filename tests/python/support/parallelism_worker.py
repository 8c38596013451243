"""One rank of the parallelism tests (spawned by test_parallelism.py): trains every case of its
world size under each variant (support.parallel_counting.VARIANTS) and writes, per case and
variant, whether losses and local gradients are bitwise the reference's, the collectives counted
per phase, and the plugin's served hits."""

import argparse
import importlib.util
import json
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# A collective waiting longer than this raises on its rank instead of hanging the test.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
# The tensor-parallel benchmark's smallest run, made by the two-rank job, whose ranks have already
# paid for importing DTensor: a spawn of its own would cost as much again.
BENCHMARK_ARGS = argparse.Namespace(ranks=2, dim=32, seq=16, batch=1, steps=1, json=None)


def load_benchmark():
    """benchmarks/bench_tp.py as a module."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_tp.py"
    spec = importlib.util.spec_from_file_location("bench_tp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases_for(world_size):
    from support import parallel_cases

    if world_size == 4:
        return {"fsdp2 + tensor parallel": parallel_cases.FsdpWithTensorParallel}
    return {
        "dtensor tensor parallel": parallel_cases.DTensorTensorParallel,
        "manual tensor parallel": parallel_cases.ManualTensorParallel,
        "manual tensor parallel, bare all_reduce": lambda: parallel_cases.ManualTensorParallel(bare_all_reduce=True),
        "expert parallel": parallel_cases.ExpertParallel,
        "expert parallel, rank 1 starved": lambda: parallel_cases.ExpertParallel(starved_rank=1),
        "pipeline parallel": parallel_cases.Pipeline,
    }


def _same(first, second):
    if first is None or second is None:
        return first is None and second is None
    return torch.equal(first, second)


def run_case(make_case):
    from support.parallel_counting import VARIANTS, train

    reference = train(make_case(), "reference")
    outcome = {}
    for variant in VARIANTS:
        try:
            losses, grads, counts, hits = reference if variant == "reference" else train(make_case(), variant)
        except Exception:
            outcome[variant] = {"error": traceback.format_exc()}
            continue
        outcome[variant] = {
            "same_losses": len(losses) == len(reference[0]) and all(map(_same, losses, reference[0])),
            "same_grads": all(_same(a, b) for ga, gb in zip(grads, reference[1]) for a, b in zip(ga, gb)),
            "counts": counts,
            "hits": hits,
        }
    return outcome


def main(rank, world_size, init_file, result_prefix, engine_variable, engine):
    import os

    os.environ[engine_variable] = engine
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
    import sac_plugin

    # As in the suite: a kept output no recompute asked for fails the case.
    warnings.simplefilter("error", sac_plugin.HeldNeverServedWarning)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    results = {"engine": sac_plugin.engine(), "cases": {}, "seconds": {}}
    try:
        for name, make_case in cases_for(world_size).items():
            started = time.perf_counter()
            try:
                results["cases"][name] = run_case(make_case)
            except Exception:
                results["cases"][name] = {"error": traceback.format_exc()}
            dist.barrier()
            results["seconds"][name] = round(time.perf_counter() - started, 2)
        if world_size == 2:
            try:
                results["benchmark"] = load_benchmark().measure(BENCHMARK_ARGS)
            except Exception:
                results["benchmark"] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(f"{result_prefix}.rank{rank}.json", "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
