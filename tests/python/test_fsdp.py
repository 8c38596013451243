"""FSDP2 over gloo, two processes spawned here: selective checkpointing gives the same losses
and gradient shards, bitwise, as the same FSDP2 run without checkpointing. The reduction order
is the same in both runs (same sharding, same reduce-scatter), so bitwise equality is expected;
across different world sizes it would not be."""

import json

import pytest
import torch.distributed as dist
from support.subprocesses import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    from support import fsdp_worker

    tmp = tmp_path_factory.mktemp("fsdp")
    result_file = tmp / "results.json"
    run_ranks(fsdp_worker.main, (2, str(tmp / "init"), str(result_file)), nprocs=2, seconds=300, what="the FSDP2 ranks")
    return json.loads(result_file.read_text())


CASES = [
    "dense: attn + mlp units",
    "dense: every other mm",
    "moe, nested fully_shard: routing units",
    "moe, nested fully_shard: ops FSDP2 calls in one pass kept",
    "moe, nested fully_shard: units offloaded",
    "dense: attn unit, inputs offloaded",
]


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_matches_the_run_without_checkpointing(fsdp_results, case):
    result = fsdp_results[case]
    assert result["same_loss"], case
    assert result["same_grads"], case
    assert result["hits"] > 0, "nothing was kept: the case proves nothing"
