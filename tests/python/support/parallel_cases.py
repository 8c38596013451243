"""The models of the parallelism tests (test_parallelism.py), one class a parallelism: each builds
its model for one rank with a Checkpointer (support.parallel_counting) that checkpoints each block
as the run's variant says, and runs one training step, telling the counter its phases."""

import torch
import torch.distributed as dist
from support.parallel_counting import phase
from torch import nn

__all__ = ["DTensorTensorParallel", "ExpertParallel", "FsdpWithTensorParallel", "ManualTensorParallel", "Pipeline"]

DIM, HIDDEN, SEQ, BATCH = 16, 32, 8, 2


def _inputs(step, seed=0):
    generator = torch.Generator().manual_seed(1000 * step + seed)
    return torch.randn(BATCH, SEQ, DIM, generator=generator)


def _backward(counter, loss):
    with phase(counter, "backward"):
        loss.backward()


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _TwoMlpBlock(nn.Module):
    """Two MLPs, each behind a norm and added to the residual."""

    def __init__(self, checkpointed):
        super().__init__()
        self.norm1, self.mlp1 = nn.LayerNorm(DIM), _Mlp()
        self.norm2, self.mlp2 = nn.LayerNorm(DIM), _Mlp()
        self._checkpointed = checkpointed

    def _block(self, x):
        h = x + self.mlp1(self.norm1(x))
        return h + self.mlp2(self.norm2(h))

    def forward(self, x):
        return self._checkpointed(self._block, x)


class _TwoBlocks(nn.Module):
    def __init__(self, checkpointer):
        super().__init__()
        self.blocks = nn.ModuleList(_TwoMlpBlock(checkpointer.site(f"block{i}")) for i in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _tensor_parallel_plan():
    """SequenceParallel norms; each MLP's up projection column-parallel (its input all-gathered
    from the sequence shards) and its down projection row-parallel, all-reduced to a replicated
    output that the replicated residual adds."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {}
    for i in range(2):
        for n in (1, 2):
            plan[f"blocks.{i}.norm{n}"] = SequenceParallel()
            plan[f"blocks.{i}.mlp{n}.up"] = ColwiseParallel(input_layouts=Shard(1))
            plan[f"blocks.{i}.mlp{n}.down"] = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
    return plan


class DTensorTensorParallel:
    """DTensor tensor parallelism over all ranks, two blocks of two MLPs."""

    def __init__(self, mesh=None):
        self.mesh = mesh

    def build(self, checkpointer):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if self.mesh is None:
            self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return parallelize_module(_TwoBlocks(checkpointer), self.mesh, _tensor_parallel_plan())

    def step(self, model, step, counter):
        from torch.distributed.tensor import DTensor, Replicate

        with phase(counter, "forward"):
            x = DTensor.from_local(_inputs(step), self.mesh, [Replicate()], run_check=False)
            loss = model(x).to_local().pow(2).mean()
        _backward(counter, loss)
        return loss


class FsdpWithTensorParallel(DTensorTensorParallel):
    """FSDP2 over the mesh's first dimension, DTensor tensor parallelism over its second."""

    def build(self, checkpointer):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        self.mesh = mesh["tp"]
        self.data_rank = mesh["dp"].get_local_rank()
        model = parallelize_module(_TwoBlocks(checkpointer), self.mesh, _tensor_parallel_plan())
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])

    def step(self, model, step, counter):
        from torch.distributed.tensor import DTensor, Replicate

        with phase(counter, "forward"):
            x = DTensor.from_local(_inputs(step, seed=self.data_rank), self.mesh, [Replicate()], run_check=False)
            loss = model(x).to_local().pow(2).mean()
        _backward(counter, loss)
        return loss


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the identity forward, the input's gradient all-reduced in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: the row-parallel partial sums all-reduced in place in the forward, the
    gradient passed through."""

    @staticmethod
    def forward(ctx, partial):
        dist.all_reduce(partial)  # in place, on the kept mm's output
        ctx.mark_dirty(partial)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ManualBlock(nn.Module):
    def __init__(self, checkpointed, shards, bare_all_reduce):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        rank = dist.get_rank()
        self.up = nn.ParameterList(
            nn.Parameter(torch.randn(HIDDEN, DIM).chunk(shards)[rank].T.contiguous() * 0.2) for _ in range(2)
        )
        self.down = nn.ParameterList(
            nn.Parameter(torch.randn(DIM, HIDDEN).chunk(shards, 1)[rank].T.contiguous() * 0.2) for _ in range(2)
        )
        self._checkpointed = checkpointed
        self._bare_all_reduce = bare_all_reduce

    def _mlp(self, x, n):
        h = torch.relu(_CopyToTensorParallel.apply(x) @ self.up[n])
        out = h @ self.down[n]
        if self._bare_all_reduce:  # autograd passes the gradient through the unregistered in-place op
            dist.all_reduce(out)
            return out
        return _ReduceFromTensorParallel.apply(out)

    def _block(self, x):
        h = x + self._mlp(self.norm1(x), 0)
        return h + self._mlp(self.norm2(h), 1)

    def forward(self, x):
        return self._checkpointed(self._block, x)


class ManualTensorParallel:
    """Megatron-style tensor parallelism by hand: in-place `dist.all_reduce` on the row-parallel
    (kept) matmul's output, inside Megatron's autograd function or bare."""

    def __init__(self, bare_all_reduce=False):
        self.bare_all_reduce = bare_all_reduce

    def build(self, checkpointer):
        world = dist.get_world_size()
        return nn.ModuleList(
            _ManualBlock(checkpointer.site(f"block{i}"), world, self.bare_all_reduce) for i in range(2)
        )

    def step(self, model, step, counter):
        with phase(counter, "forward"):
            x = _inputs(step).view(BATCH * SEQ, DIM)
            for block in model:
                x = block(x)
            loss = x.pow(2).mean()
        _backward(counter, loss)
        return loss


class _ExpertLayer(nn.Module):
    """A router choosing one of `EXPERTS_PER_RANK * world` experts per token; each rank holds its
    own experts, and the tokens travel to them and back by `all_to_all_single` with split sizes
    read to the host (`.tolist()`). `starved_rank`'s experts are never chosen: it receives no tokens."""

    EXPERTS_PER_RANK = 2

    def __init__(self, checkpointed, starved_rank):
        super().__init__()
        self.world, rank = dist.get_world_size(), dist.get_rank()
        experts = self.EXPERTS_PER_RANK * self.world
        self.router = nn.Parameter(torch.randn(DIM, experts) * 0.5)
        up = torch.randn(experts, DIM, HIDDEN) * 0.2
        down = torch.randn(experts, HIDDEN, DIM) * 0.2
        local = slice(rank * self.EXPERTS_PER_RANK, (rank + 1) * self.EXPERTS_PER_RANK)
        self.up, self.down = nn.Parameter(up[local].clone()), nn.Parameter(down[local].clone())
        bias = torch.zeros(experts)
        if starved_rank is not None:
            bias[starved_rank * self.EXPERTS_PER_RANK : (starved_rank + 1) * self.EXPERTS_PER_RANK] = -1e4
        self.register_buffer("bias", bias)
        self._checkpointed = checkpointed

    def _layer(self, x):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        probs = torch.softmax(x @ self.router + self.bias, dim=-1)
        gate, expert = probs.max(dim=-1)
        order = torch.argsort(expert, stable=True)
        per_expert = torch.bincount(expert, minlength=probs.shape[-1])
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert)
        sent = per_expert.view(self.world, -1).sum(1).tolist()
        received_counts = received_per_expert.view(self.world, -1)
        received_splits = received_counts.sum(1).tolist()
        tokens = all_to_all_single_autograd(x[order], received_splits, sent, dist.group.WORLD)
        chunks = tokens.split(received_counts.flatten().tolist())
        outputs = [
            torch.relu(chunk @ self.up[i % self.EXPERTS_PER_RANK]) @ self.down[i % self.EXPERTS_PER_RANK]
            for i, chunk in enumerate(chunks)
        ]
        back = all_to_all_single_autograd(torch.cat(outputs), sent, received_splits, dist.group.WORLD)
        routed = torch.zeros_like(x).index_copy(0, order, back)
        return x + routed * gate.unsqueeze(-1)

    def forward(self, x):
        return self._checkpointed(self._layer, x)


class ExpertParallel:
    """Expert parallelism over all ranks, two expert layers."""

    def __init__(self, starved_rank=None):
        self.starved_rank = starved_rank

    def build(self, checkpointer):
        return nn.ModuleList(_ExpertLayer(checkpointer.site(f"moe{i}"), self.starved_rank) for i in range(2))

    def step(self, model, step, counter):
        with phase(counter, "forward"):
            x = _inputs(step, seed=dist.get_rank()).view(BATCH * SEQ, DIM)
            for layer in model:
                x = layer(x)
            loss = x.pow(2).mean()
        _backward(counter, loss)
        return loss


class Pipeline:
    """A GPipe schedule over two stages, one a rank, each stage two checkpointed blocks; the
    last stage computes the loss. Two microbatches."""

    MICROBATCHES = 2

    def build(self, checkpointer):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        rank, world = dist.get_rank(), dist.get_world_size()
        stages = [_TwoBlocks(checkpointer) for _ in range(world)]  # every rank draws every stage's weights alike
        module = stages[rank]
        self.stage = PipelineStage(module, rank, world, torch.device("cpu"))
        self.schedule = ScheduleGPipe(
            self.stage, self.MICROBATCHES, loss_fn=lambda out, target: (out - target).pow(2).mean()
        )
        return module

    def step(self, model, step, counter):
        stage = self.stage
        counter.switch("forward")
        for name in ("get_bwd_recv_ops", "backward_one_chunk"):
            # The schedule asks for the gradients to receive, or runs a backward, once its forwards are done.
            original = getattr(type(stage), name)
            setattr(stage, name, self._into_backward(counter, original.__get__(stage)))
        try:
            if stage.is_first:
                self.schedule.step(_inputs(step))
                return None
            losses = []
            self.schedule.step(target=_inputs(step, seed=7), losses=losses)
            return torch.stack(losses)
        finally:
            for name in ("get_bwd_recv_ops", "backward_one_chunk"):
                delattr(stage, name)

    @staticmethod
    def _into_backward(counter, method):
        def run(*args, **kwargs):
            if counter.phase == "forward":
                counter.switch("backward")
            return method(*args, **kwargs)

        return run
