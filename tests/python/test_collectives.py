"""In-place collectives write tensors their schemas do not mark as written (NOTE: [Writes no
schema declares] in csrc/ops/op_traits.h). A kept output the forward then all-reduces in place
(Megatron-style row parallelism) is preserved from that write, so the recompute reduces the value
the kept call made, not the reduced one: gradients bitwise on two gloo ranks, in whichever
engine the suite runs."""

import json

import pytest
import torch.distributed as dist
from support.subprocesses import run_ranks

from sac_plugin import _engine

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _run_two_ranks(tmp_path, engine):
    from support import collective_write_worker

    result_file = tmp_path / "result.json"
    arguments = (2, str(tmp_path / "init"), str(result_file), _engine.ENGINE_VARIABLE, engine)
    run_ranks(collective_write_worker.main, arguments, nprocs=2, seconds=120, what="the two ranks")
    return json.loads(result_file.read_text())


def test_a_kept_output_all_reduced_in_place_gives_bitwise_gradients_on_two_ranks(tmp_path):
    engine = _engine.engine()
    result = _run_two_ranks(tmp_path, engine)
    assert result["engine"] == engine
    assert result["bitwise"] == [True, True, True], result["largest_difference"]
    assert result["mm_hits"] == 2  # both mm calls kept and served
    assert (result["allreduce_forward"], result["allreduce_recompute"]) == (1, 1)
