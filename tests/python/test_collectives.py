"""In-place collectives write tensors their schemas do not mark as written (NOTE: [Writes no
schema declares] in csrc/ops/op_traits.h). A kept output the forward then all-reduces in place
(Megatron-style row parallelism) is preserved from that write, so the recompute reduces the value
the kept call made, not the reduced one: gradients bitwise on two gloo ranks, in whichever
engine the suite runs."""

import json
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sac_plugin import _engine

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _run_two_ranks(tmp_path, engine):
    from support import collective_write_worker

    result_file = tmp_path / "result.json"
    context = mp.start_processes(
        collective_write_worker.main,
        args=(2, str(tmp_path / "init"), str(result_file), _engine.ENGINE_VARIABLE, engine),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + 120  # a hung collective fails this test instead of stalling CI
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two ranks did not finish within 120 s")
    return json.loads(result_file.read_text())


def test_a_kept_output_all_reduced_in_place_gives_bitwise_gradients_on_two_ranks(tmp_path):
    engine = _engine.engine()
    result = _run_two_ranks(tmp_path, engine)
    assert result["engine"] == engine
    assert result["bitwise"] == [True, True, True], result["largest_difference"]
    assert result["mm_hits"] == 2  # both mm calls kept and served
    assert (result["allreduce_forward"], result["allreduce_recompute"]) == (1, 1)
