"""sac_plugin beside torch_remat on the same torch_remat-annotated model.

    python benchmarks/bench_remat.py [--layers 4] [--dim 256] [--tokens 512] [--reps 7] [--steps 2]

The model is a stack of blocks written as torchtitan's main branch writes them: regions in the
model code (`torch_remat.region(fn, name, recompute=...)`): the attention core and the router
with recompute=False, the experts' up projection (`routed_experts.w13`) and down projection with
recompute=True. Each block is checkpointed on its own, by torch_remat
(`torch_remat.checkpoint(region_name="layers.i")`) or by sac_plugin
(`apply_selective_checkpointing(block, policy)`), where the regions are recompute units.

Rows:
  no checkpoint            every activation held: the reference for bytes
  torch_remat              the regions' own flags
  sac_plugin, flags        Policy(kept_units=["*.core", "router"]): the same selection as the flags
  sac_plugin, patterns     torchtitan's config: Policy(kept_units=["*"], recomputed_units=["*routed_experts.w13.*"])
  sac_plugin, no early stop the flags' selection with early_stop=False (torch_remat has no early stop)
  sac_plugin, per-op       per-op selection inside the regions: the flags plus every aten::mm kept
  sac_plugin, offload      the attention core offloaded (offloaded_units): on the CPU, offloading is keeping
Columns: bytes held between forward and backward (sac_plugin.memory.track_activation_memory, over
the whole stack), as a ratio to no checkpoint; the median step time (forward + backward, --reps
samples of --steps steps, modes interleaved), as a ratio to torch_remat. Every row's gradients are
checked bitwise against the unmodified model before timing.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import warnings

import torch

import sac_plugin
from _common import have_torch_remat, time_interleaved
from sac_plugin.memory import track_activation_memory


def make_block_class(remat):
    class Block(torch.nn.Module):
        def __init__(self, dim, experts=4, k=2):
            super().__init__()
            self.norm = torch.nn.LayerNorm(dim)
            self.wq = torch.nn.Linear(dim, dim)
            self.wo = torch.nn.Linear(dim, dim)
            self.gate = torch.nn.Linear(dim, experts, bias=False)
            self.w13 = torch.nn.Parameter(torch.randn(experts, dim, 2 * dim) / dim**0.5)
            self.w2 = torch.nn.Parameter(torch.randn(experts, 2 * dim, dim) / (2 * dim) ** 0.5)
            self.experts, self.k = experts, k

        def core(self, h):
            return self.wo(torch.tanh(self.wq(h)) * torch.sigmoid(h))

        def route(self, h):
            values, indices = torch.topk(self.gate(h), self.k, dim=-1)
            return torch.softmax(values, dim=-1), indices

        def forward(self, x):
            h = self.norm(x)
            core = remat.region(self.core, "attention.core", recompute=False)(h)
            remat.recompute_needs_tensor(core)  # its consumer is bare code (torch_remat's rule)
            x = x + core
            h = self.norm(x)
            weights, indices = remat.region(self.route, "router", recompute=False)(h)
            remat.recompute_needs_tensor(weights, indices)  # bare consumers below (torch_remat's rule)
            out = torch.zeros_like(h)
            for e in range(self.experts):
                tokens, slot = torch.nonzero(indices == e, as_tuple=True)
                u = remat.region(lambda t, e=e: torch.relu(t @ self.w13[e]), f"routed_experts.w13.{e}", recompute=True)(
                    h[tokens]
                )
                y = remat.region(lambda t, e=e: t @ self.w2[e], f"routed_experts.w2.{e}", recompute=True)(u)
                out = out.index_add(0, tokens, y * weights[tokens, slot].unsqueeze(-1))
            return x + out

    return Block


class RematBlock(torch.nn.Module):
    def __init__(self, block, index, remat):
        super().__init__()
        self.block = block
        self.run = remat.checkpoint(region_name=f"layers.{index}")(block)

    def forward(self, x):
        return self.run(x)


def build(args, remat):
    torch.manual_seed(0)
    Block = make_block_class(remat)
    base = torch.nn.Sequential(*[Block(args.dim) for _ in range(args.layers)])
    modes = {
        "no checkpoint": base,
        "torch_remat": torch.nn.Sequential(*[RematBlock(b, i, remat) for i, b in enumerate(copy.deepcopy(base))]),
    }
    flags = dict(kept_units=["*.core", "router"])
    plugin = {
        "sac_plugin, flags": (sac_plugin.Policy(**flags), True),
        "sac_plugin, patterns": (sac_plugin.Policy(kept_units=["*"], recomputed_units=["*routed_experts.w13.*"]), True),
        "sac_plugin, no early stop": (sac_plugin.Policy(**flags), False),
        "sac_plugin, per-op": (sac_plugin.Policy(kept_ops=["aten::mm"], **flags), True),
        "sac_plugin, offload": (sac_plugin.Policy(kept_units=["router"], offloaded_units=["*.core"]), True),
    }
    for name, (policy, early_stop) in plugin.items():
        model = copy.deepcopy(base)
        for block in model:
            sac_plugin.apply_selective_checkpointing(block, policy, early_stop=early_stop)
        modes[name] = model
    return modes


def step(model, x):
    x = x.detach().requires_grad_()
    model(x).square().mean().backward()
    return x.grad


def held(model, x):
    x = x.detach().requires_grad_()
    with track_activation_memory(model.parameters()) as memory:
        out = model(x)
        value = memory.bytes()
    out.square().mean().backward()
    model.zero_grad(set_to_none=True)
    return value


def check_gradients(modes, x):
    reference = modes["no checkpoint"]
    want = [step(reference, x)] + [p.grad.clone() for p in reference.parameters()]
    reference.zero_grad(set_to_none=True)
    for name, model in modes.items():
        got = [step(model, x)] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise SystemExit(f"bench_remat: {name}: gradients differ from the unmodified model")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    if not have_torch_remat():
        print("torch_remat is not installed (pip install --no-deps torch_remat==0.2.2): nothing to compare")
        return
    import torch_remat as remat

    if not hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"):
        # torch_remat 0.2.2 poisons the storage of a skipped region's placeholder with a message
        # through a function older torch lacks; without it a placeholder is just a null storage.
        torch._C._set_storage_data_ptr_access_error_msg = lambda *args: None
    torch.set_num_threads(1)  # bitwise comparisons: the MoE's index_add is not reproducible across threads
    modes = build(args, remat)
    x = torch.randn(args.tokens, args.dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "offloaded calls are kept on the device here" (CPU)
        check_gradients(modes, x)
        bytes_held = {name: held(model, x) for name, model in modes.items()}
        runs = {name: (lambda model=model: step(model, x)) for name, model in modes.items()}
        times = time_interleaved(runs, args.reps, args.steps, warmup=1)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{args.layers} blocks, dim {args.dim}, {args.tokens} tokens, 4 experts top-2; gradients of every row "
        "bitwise equal to the unmodified model"
    )
    print(f"{'mode':28} {'bytes held':>12} {'x no ckpt':>10} {'step ms':>9} {'x torch_remat':>14}")
    for name in modes:
        print(
            f"{name:28} {bytes_held[name]:>12,} {bytes_held[name] / bytes_held['no checkpoint']:>10.3f} "
            f"{median[name] * 1e3:>9.2f} {median[name] / median['torch_remat']:>14.3f}"
        )


if __name__ == "__main__":
    main()
