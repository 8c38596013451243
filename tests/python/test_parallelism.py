"""Every torch parallelism that runs on gloo, with the plugin's selective checkpointing, torch's
own (`create_selective_checkpoint_contexts`, the same kept ops: `aten::mm` and the residual
`aten::add`) and full recompute: losses and every gradient over two SGD steps bitwise those of
the unmodified model under the same parallelism, and the collectives each phase runs counted
exactly (NOTE: [Collectives counted per phase] in support/parallel_counting.py).

The ranks are spawned once per world size: one job runs every two-rank case
(support/parallelism_worker.py), one the four-rank case, each under a timeout, and a collective
waiting past the worker's COLLECTIVE_TIMEOUT raises on its rank, so a hang fails instead of
stalling CI. The counts are one rank's, of the second step, summed over its two blocks or layers.
"""

import json

import pytest
import torch
import torch.distributed as dist
from support.subprocesses import run_ranks

from sac_plugin import _engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.skipif(
        tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
        reason="torch 2.11 dispatches Python below the plugin's key: calls on tensor subclasses (DTensor, the "
        "functional collectives' AsyncCollectiveTensor) are counted and run, never kept or served (NOTE: [Python "
        "below our key (torch 2.11)] in csrc/dispatch/fallback.cpp), so the counts these cases expect are torch "
        "2.13's and later (docs/limits.md)",
    ),
]

CHECKPOINTED = ("plugin", "torch_sac", "full")

ALL_GATHER = "_c10d_functional::all_gather_into_tensor"
ALL_REDUCE = "_c10d_functional::all_reduce"
REDUCE_SCATTER = "_c10d_functional::reduce_scatter_tensor"
ALL_TO_ALL = "_c10d_functional::all_to_all_single"

# The DTensor tensor-parallel block's recompute (two blocks, each two MLPs). The all-gathers run
# again everywhere: the gathered input is what autograd saves for the up projection's weight
# gradient. Each all-reduce only feeds the kept residual add, which is served, so the plugin skips
# it (NOTE: [The recompute runs only what backward needs] in csrc/dispatch/dead_calls.cpp); torch's
# SAC and full recompute run it again.
TENSOR_PARALLEL_RECOMPUTE = {
    "torch_sac": {ALL_GATHER: 4, ALL_REDUCE: 2},
    "plugin": {ALL_GATHER: 4},
    "full": {ALL_GATHER: 4, ALL_REDUCE: 2},
}
# torch's early stop ends each block's recompute at its last saved tensor, before the second
# MLP's all-reduce: two of the four forward all-reduces are never run again.

TENSOR_PARALLEL = {
    "forward": {ALL_GATHER: 4, ALL_REDUCE: 4},
    "backward": {ALL_GATHER: 3, REDUCE_SCATTER: 4},
}
MANUAL = {"forward": {"c10d::allreduce_": 4}, "backward": {"c10d::allreduce_": 4}}
MANUAL_RECOMPUTE = {"c10d::allreduce_": 2}
# Per expert layer: the per-expert counts exchanged in place (alltoall_base_), the tokens sent
# and brought back; the first layer's input needs no gradient, so its first exchange has no backward.
EXPERT = {
    "forward": {ALL_TO_ALL: 4, "c10d::alltoall_base_": 2},
    "backward": {ALL_TO_ALL: 3},
}
EXPERT_RECOMPUTE = {ALL_TO_ALL: 4, "c10d::alltoall_base_": 2}
# Two microbatches: activations sent forward, gradients sent back; nothing is recomputed across
# stages.
PIPELINE = {
    0: {"forward": {"c10d::send": 2}, "backward": {"c10d::recv_": 2}},
    1: {"forward": {"c10d::recv_": 2}, "backward": {"c10d::send": 2}},
}
# FSDP2 over the first mesh dimension adds its parameter all-gathers (forward, and again for the
# backward) and gradient reduce-scatters; the sequence-parallel norms' replicated weights get
# their gradients all-reduced over the tensor-parallel dimension (four norms, weight and bias).
FSDP_TENSOR_PARALLEL = {
    "forward": {ALL_GATHER: 4, ALL_REDUCE: 4, "c10d::_allgather_base_": 2},
    "backward": {
        ALL_GATHER: 3,
        ALL_REDUCE: 8,
        REDUCE_SCATTER: 4,
        "c10d::_allgather_base_": 2,
        "c10d::_reduce_scatter_base_": 2,
    },
}


def tensor_parallel_recompute(variant):
    """A variant's row of TENSOR_PARALLEL_RECOMPUTE in the engine running: the dispatch-mode engine
    runs every recompute call (docs/limits.md), so its plugin row is torch's SAC's."""
    if variant == "plugin" and _engine.engine() != "native":
        variant = "torch_sac"
    return TENSOR_PARALLEL_RECOMPUTE.get(variant)


def _expected(forward_and_backward, recompute, variant):
    return {**forward_and_backward, "recompute": recompute if variant != "reference" else {}}


def expected_counts(case, variant, rank):
    """The collectives one rank runs per phase in the second step."""
    if case == "dtensor tensor parallel":
        return _expected(TENSOR_PARALLEL, tensor_parallel_recompute(variant), variant)
    if case.startswith("manual tensor parallel"):
        return _expected(MANUAL, MANUAL_RECOMPUTE, variant)
    if case.startswith("expert parallel"):
        return _expected(EXPERT, EXPERT_RECOMPUTE, variant)
    if case == "pipeline parallel":
        return _expected(PIPELINE[rank], {}, variant)
    assert case == "fsdp2 + tensor parallel"
    return _expected(FSDP_TENSOR_PARALLEL, tensor_parallel_recompute(variant), variant)


# The plugin's served outputs over the two steps, per rank.
PLUGIN_HITS = {
    "dtensor tensor parallel": [16, 16],
    "manual tensor parallel": [16, 16],
    "manual tensor parallel, bare all_reduce": [16, 16],
    "expert parallel": [44, 44],
    "expert parallel, rank 1 starved": [44, 44],
    "pipeline parallel": [32, 40],
    "fsdp2 + tensor parallel": [16, 16, 16, 16],
}

TWO_RANK_CASES = [
    "dtensor tensor parallel",
    "manual tensor parallel",
    "manual tensor parallel, bare all_reduce",
    "expert parallel",
    "expert parallel, rank 1 starved",
    "pipeline parallel",
]
FOUR_RANK_CASES = ["fsdp2 + tensor parallel"]

# Megatron's `g` writes the kept row-parallel mm output in place inside an autograd.Function
# (mark_dirty). torch's SAC refuses any kept output mutated after it was cached.
TORCH_REFUSES = {
    ("manual tensor parallel", "torch_sac"): "Tensor cached during selective activation checkpoint has been mutated"
}


def _spawn(tmp_path_factory, world_size, seconds):
    from support import parallelism_worker

    tmp = tmp_path_factory.mktemp(f"parallel{world_size}")
    prefix = str(tmp / "result")
    arguments = (world_size, str(tmp / "init"), prefix, _engine.ENGINE_VARIABLE, _engine.engine())
    run_ranks(parallelism_worker.main, arguments, nprocs=world_size, seconds=seconds, what=f"the {world_size} ranks")
    return [json.loads(open(f"{prefix}.rank{rank}.json").read()) for rank in range(world_size)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, 2, seconds=240)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, 4, seconds=240)


@pytest.fixture
def ranks(request, two_ranks):
    return (
        request.getfixturevalue("four_ranks") if request.node.callspec.params["case"] in FOUR_RANK_CASES else two_ranks
    )


def _outcomes(ranks, case, variant):
    outcomes = []
    for rank, result in enumerate(ranks):
        assert result["engine"] == _engine.engine()
        outcome = result["cases"][case]
        assert "error" not in outcome, outcome.get("error")
        assert "error" not in outcome[variant], f"rank {rank}: {outcome[variant]['error']}"
        outcomes.append(outcome[variant])
    return outcomes


CASE_VARIANTS = [
    pytest.param(case, variant, id=f"{case}-{variant}")
    for case in TWO_RANK_CASES + FOUR_RANK_CASES
    for variant in CHECKPOINTED
    if (case, variant) not in TORCH_REFUSES
]


@pytest.mark.parametrize(("case", "variant"), CASE_VARIANTS)
def test_losses_and_gradients_are_bitwise_the_unmodified_models(ranks, case, variant):
    for rank, outcome in enumerate(_outcomes(ranks, case, variant)):
        assert (outcome["same_losses"], outcome["same_grads"]) == (True, True), f"rank {rank}"


@pytest.mark.parametrize(("case", "variant"), CASE_VARIANTS)
def test_collectives_per_phase(ranks, case, variant):
    for rank, outcome in enumerate(_outcomes(ranks, case, variant)):
        assert outcome["counts"] == expected_counts(case, variant, rank), f"rank {rank}"


@pytest.mark.parametrize("case", TWO_RANK_CASES + FOUR_RANK_CASES)
def test_the_unmodified_models_collectives_per_phase(ranks, case):
    for rank, outcome in enumerate(_outcomes(ranks, case, "reference")):
        assert outcome["counts"] == expected_counts(case, "reference", rank), f"rank {rank}"


@pytest.mark.parametrize(
    "case", [param.values[0] for param in CASE_VARIANTS if param.values[1] == "plugin" and not param.marks]
)
def test_the_plugin_serves_its_kept_calls(ranks, case):
    assert [outcome["hits"] for outcome in _outcomes(ranks, case, "plugin")] == PLUGIN_HITS[case]


@pytest.mark.parametrize(("case", "variant"), list(TORCH_REFUSES))
def test_torch_sac_refuses_a_kept_output_written_in_place_by_an_autograd_function(two_ranks, case, variant):
    for result in two_ranks:
        assert TORCH_REFUSES[case, variant] in result["cases"][case][variant]["error"]


def test_the_tensor_parallel_benchmark_counts_the_recompute_as_the_tests_do(two_ranks, capsys):
    from support.parallelism_worker import BENCHMARK_ARGS, load_benchmark

    measured = two_ranks[0]["benchmark"]
    assert "error" not in measured, measured.get("error")
    load_benchmark().print_report(measured, BENCHMARK_ARGS, "python3 benchmarks/bench_tp.py --dim 32 --seq 16")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "command: python3 benchmarks/bench_tp.py --dim 32 --seq 16"
    for mode, variant in {"full recompute": "full", "torch SAC": "torch_sac", "sac_plugin": "plugin"}.items():
        # The benchmark's one block is half the tests' two.
        per_block = sorted((op, n // 2) for op, n in tensor_parallel_recompute(variant).items())
        recompute = ", ".join(f"{n} {op.split('::')[1]}" for op, n in per_block) or "none"
        assert [line for line in lines if line.startswith(f"{mode} ")][0].endswith(recompute), mode
        assert sum(line.startswith(f"collectives per phase, {mode}: ") for line in lines) == 1
    assert [line for line in lines if line.startswith("no checkpointing ")][0].endswith("none")
