"""The recompute runs only what backward needs (NOTE: [The recompute runs only what backward
needs] in csrc/dispatch/dead_calls.cpp): a call whose output only a kept call reads is skipped,
with exact counts and gradients bitwise the unmodified model's; a call read after all is run
first; a site with nothing to skip stops watching; a collective is skipped only where the forward
read no value on the host."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sac_plugin
from sac_plugin import Policy

pytestmark = pytest.mark.native_engine(
    "the native engine's regions find the dead calls; the dispatch-mode engine runs every recompute call"
)

KEEP_MM_AND_ADD = ["aten::mm", "aten::add.Tensor"]


class ScaledResidual(nn.Module):
    """`scaled` is read only by the kept add: nothing the backward needs comes from it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        projected = torch.mm(x, self.weight)  # kept
        scaled = projected * 2.0  # read only by the kept add
        return self.out(torch.tanh(x) + scaled)  # the add is kept; tanh saves its result


def _pair(layers: int = 2, module=ScaledResidual):
    torch.manual_seed(0)
    reference = nn.Sequential(*(module() for _ in range(layers)))
    return reference, copy.deepcopy(reference)


def _train(model, steps: int = 2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    audits, grads = [], []
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with sac_plugin.audit() as counts:
            model(x).pow(2).mean().backward()
        audits.append(counts)
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
        optimizer.step()
        optimizer.zero_grad()
    return audits, grads, [p.detach().clone() for p in model.parameters()]


def _assert_bitwise(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_call_only_a_kept_call_reads_is_skipped_and_gradients_are_bitwise():
    reference, model = _pair()
    for layer in model:
        sac_plugin.apply_selective_checkpointing(layer, Policy(kept_ops=KEEP_MM_AND_ADD))
    audits, grads, params = _train(model)
    _, reference_grads, reference_params = _train(reference)
    _assert_bitwise(grads, reference_grads)
    assert all(torch.equal(a, b) for a, b in zip(params, reference_params))
    for counts in audits:  # the first, watched step and the second alike
        assert counts.skipped("aten::mul.Tensor") == 2
        assert counts.count("aten::mul.Tensor", phase="recompute") == 0
        assert counts.count("aten::tanh", phase="recompute") == 2
        assert counts.hits("aten::mm") == 2 and counts.hits("aten::add.Tensor") == 2
        assert counts.skipped() == 2
        assert [row.skipped for row in counts.rows() if row.op == "aten::mul.Tensor"] == [2]
        assert "skipped" in counts.table().splitlines()[0].split()


def test_the_per_op_trace_says_skipped():
    _, model = _pair(layers=1)
    sac_plugin.apply_selective_checkpointing(model[0], Policy(kept_ops=KEEP_MM_AND_ADD))
    x = torch.randn(4, 16, requires_grad=True)
    with sac_plugin.trace(model) as report:
        model(x).sum().backward()
    recompute = [(entry.op, entry.status) for entry in report.trace if entry.phase == "recompute"]
    assert ("aten::mul.Tensor", "skipped") in recompute
    assert ("aten::mm.default", "served") in recompute
    assert "skipped" in report.trace_table()


class Unmatched(nn.Module):
    """The kept add also reads a constant, a different tensor of the same values in each pass (a
    cache the code refills): named by its storage, the add's recompute call is not the forward's,
    is not served and runs, and reads what the skipped mul stands in for."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.constants = [torch.full((1, width), 0.5), torch.full((1, width), 0.5)]
        self.passes = 0

    def forward(self, x):
        self.passes += 1
        constant = self.constants[self.passes % 2]
        scaled = torch.mm(x, self.weight) * 2.0
        return torch.sin(scaled + constant)  # sin saves what the kept add made


def test_a_skipped_call_read_after_all_runs_first_and_gradients_stay_bitwise():
    reference, model = _pair(layers=1, module=Unmatched)
    sac_plugin.apply_selective_checkpointing(model[0], Policy(kept_ops=KEEP_MM_AND_ADD))
    with pytest.warns(sac_plugin.HeldNeverServedWarning):
        audits, grads, _ = _train(model, steps=1)
    _, reference_grads, _ = _train(reference, steps=1)
    _assert_bitwise(grads, reference_grads)
    # The mul was skipped, then run for the add that read its stand-in: a recompute execution.
    assert audits[0].skipped("aten::mul.Tensor") == 0
    assert audits[0].count("aten::mul.Tensor", phase="recompute") == 1


class NothingDead(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * x


def test_a_site_with_nothing_to_skip_stops_watching_its_forwards():
    torch.manual_seed(0)
    model = NothingDead()
    context = sac_plugin.context_fn(Policy(kept_ops=["aten::addmm"]), name="NothingDead")
    site = context.args[0]
    assert site.watches_saves
    x = torch.randn(4, 16, requires_grad=True)
    torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False, context_fn=context).sum().backward()
    assert not site.watches_saves

    dead = ScaledResidual()
    context = sac_plugin.context_fn(Policy(kept_ops=KEEP_MM_AND_ADD), name="ScaledResidual")
    for _ in range(2):
        torch.utils.checkpoint.checkpoint(dead, x, use_reentrant=False, context_fn=context).sum().backward()
        assert context.args[0].watches_saves


@pytest.fixture
def single_rank_group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(directory, 'store')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


class ReducedResidual(nn.Module):
    """A row-parallel projection's all-reduce, read only by the kept residual add; `read_a_value`
    reads a value on the host first, as an expert loop reads its token counts."""

    def __init__(self, group, read_a_value: bool, width: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.group, self.read_a_value = group, read_a_value

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        if self.read_a_value:
            assert torch.isfinite(x).all().item()
        reduced = funcol.all_reduce(torch.mm(x, self.weight), "sum", self.group)
        return torch.sin(torch.tanh(x) + reduced)  # sin saves what the kept add made


@pytest.mark.parametrize("read_a_value", [False, True], ids=["structural", "after a value read"])
def test_a_collective_is_skipped_only_where_the_forward_read_no_value(single_rank_group, read_a_value):
    torch.manual_seed(0)
    reference = ReducedResidual(single_rank_group, read_a_value)
    torch.manual_seed(0)
    model = ReducedResidual(single_rank_group, read_a_value)
    sac_plugin.apply_selective_checkpointing(model, Policy(kept_ops=KEEP_MM_AND_ADD))
    x = torch.randn(4, 16, requires_grad=True)
    with sac_plugin.audit() as counts:
        model(x).pow(2).mean().backward()
    grads = [model.weight.grad.clone(), x.grad.clone()]
    x.grad = None
    reference(x).pow(2).mean().backward()
    assert torch.equal(grads[0], reference.weight.grad) and torch.equal(grads[1], x.grad)
    reduce = "_c10d_functional::all_reduce"
    # On torch 2.11 the AsyncCollectiveTensor's handler runs below the plugin's key, where the
    # region cannot follow what it reads: that forward skips nothing.
    if read_a_value or sac_plugin._compat.python_handlers_run_below_the_plugin():
        assert (counts.skipped(reduce), counts.count(reduce, phase="recompute")) == (0, 1)
    else:
        assert (counts.skipped(reduce), counts.count(reduce, phase="recompute")) == (1, 0)
