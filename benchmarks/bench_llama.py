"""A transformers Llama training step under each way of checkpointing, side by side in one process.

    .venv/bin/python benchmarks/bench_llama.py [--layers 4] [--hidden 256] [--seq 384] [--steps 30] [--threads 1]

`LlamaForCausalLM` (random init, SDPA attention, fp32, a small vocabulary), one training step:
forward with the loss, backward, AdamW step. Every decoder layer is checkpointed, except in the
first mode:

- no checkpointing;
- full recompute: transformers' own activation checkpointing (torch's checkpoint on every layer);
- torch SAC: the same, its `context_fn` torch's `create_selective_checkpoint_contexts` with a policy
  function that keeps `aten::mm` and the attention overloads this build has (a set lookup, what a
  torch SAC user writes);
- sac_plugin, same kept ops: `sac_plugin.integrations.huggingface.apply_recompute_config` with
  `RecomputeConfig(kept_ops=...)`, the same ops;
- sac_plugin, plan: the same with `RecomputeConfig(budget=...)`, planned on the benchmark's batch.

Every mode starts from the same weights, and the first step of each is checked: its loss and every
gradient must be bitwise those of no checkpointing (the tool says which differ and exits non-zero).
That first step also counts the bytes held between forward and backward (`sac_plugin.memory.
track_activation_memory`, as `benchmarks/bench_memory.py` counts them: the unique storages autograd
saves, the plugin's kept outputs and torch's SAC cache, parameters left out; the logits the loss
saves are in every mode's count). Then `--steps` rounds time one step of every mode each, modes
interleaved in a shuffled order with the garbage collector off (`_common.time_interleaved`).
Reported per mode: the median step, and its ratios to torch SAC and to no checkpointing, each the
median over the rounds of the two modes' ratio within a round (load that drifts between rounds
cancels).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import os
import platform
import shlex
import statistics
import sys
import time

import sac_plugin
import torch
from sac_plugin.integrations import huggingface
from sac_plugin.memory import track_activation_memory
from sac_plugin.targets import ATTENTION_OPS
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import LlamaConfig, LlamaForCausalLM

from _common import cached_tensors, time_interleaved

MIB = 2**20
NO_CHECKPOINTING = "no checkpointing"
FULL_RECOMPUTE = "full recompute"
TORCH_SAC = "torch SAC"
PLUGIN_OPS = "sac_plugin, same kept ops"
PLUGIN_PLAN = "sac_plugin, plan"
PLUGIN_MODES = (PLUGIN_OPS, PLUGIN_PLAN)
COLUMNS = ["mode", "step ms", "vs torch SAC", "vs none", "held MiB"]


def kept_ops() -> frozenset[str]:
    """Every matmul and the attention: the selection torch SAC and the plugin both keep."""
    return frozenset({"aten::mm"}) | ATTENTION_OPS.resolve()


class TorchSacContext:
    """A context_fn for torch's SAC keeping `kept_overloads`, its policy function a set lookup per
    call (what a torch SAC user writes). While `caches` is a list, each region's cache is appended
    to it, so that the bytes the cache holds can be counted; the timed steps leave it None, so
    that no step keeps an earlier step's cache alive."""

    def __init__(self, kept_overloads):
        kept = frozenset(kept_overloads)
        self.caches: list | None = None

        def policy_fn(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

        self._policy_fn = policy_fn

    def __call__(self):
        forward, recompute = create_selective_checkpoint_contexts(self._policy_fn)
        if self.caches is not None:
            self.caches.append(forward.storage)
        return forward, recompute


def build_model(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or (args.hidden * 43 // 16),  # Llama's 11008 / 4096
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 2048),
        attn_implementation="sdpa",
        use_cache=False,  # a training step: checkpointing turns the KV cache off anyway
    )
    model = LlamaForCausalLM(config)
    model.train()
    return model


def make_modes(args, base: LlamaForCausalLM, batch: dict) -> tuple[dict, dict]:
    """Each mode's model (a copy of `base`), and the torch SAC context_fns whose caches to count."""
    models = {name: copy.deepcopy(base) for name in (NO_CHECKPOINTING, FULL_RECOMPUTE, TORCH_SAC)}
    models[FULL_RECOMPUTE].activation_checkpointing_enable({"use_reentrant": False})
    policy = sac_plugin.Policy(kept_ops=kept_ops())
    torch_sac = TorchSacContext(policy.kept_overloads())
    models[TORCH_SAC].activation_checkpointing_enable({"use_reentrant": False, "context_fn": torch_sac})
    models[PLUGIN_OPS] = copy.deepcopy(base)
    huggingface.apply_recompute_config(
        models[PLUGIN_OPS], sac_plugin.RecomputeConfig(kept_ops=tuple(sorted(kept_ops())))
    )
    models[PLUGIN_PLAN] = copy.deepcopy(base)
    huggingface.apply_recompute_config(
        models[PLUGIN_PLAN], sac_plugin.RecomputeConfig(budget=args.budget), example_inputs=batch
    )
    return models, {TORCH_SAC: torch_sac}


def first_steps(models: dict, optimizers: dict, batch: dict, torch_sac_contexts: dict) -> dict:
    """Each mode's first training step: its loss, gradients and the bytes held from the forward
    to the backward (torch SAC's caches among them)."""
    first = {}
    for name, model in models.items():
        caches: list = []
        if name in torch_sac_contexts:
            torch_sac_contexts[name].caches = caches
        with track_activation_memory(model.parameters()) as memory:
            memory.add_source(functools.partial(cached_tensors, caches))
            loss = model(**batch).loss
            held = memory.bytes()
            loss.backward()
        if name in torch_sac_contexts:
            torch_sac_contexts[name].caches = None
        first[name] = {
            "loss": loss.detach().clone(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            # The dispatch-mode engine's kept outputs are not among the tensors counted.
            "held": held if sac_plugin.engine() == "native" or name not in PLUGIN_MODES else None,
        }
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
    return first


def mismatches(first: dict) -> list[str]:
    """The modes whose first loss or gradients differ, bitwise, from no checkpointing's."""
    reference = first[NO_CHECKPOINTING]
    found = []
    for name, got in first.items():
        if not torch.equal(got["loss"], reference["loss"]):
            found.append(f"{name}: loss {got['loss'].item()!r} != {reference['loss'].item()!r}")
        differing = [
            n for n, g in reference["grads"].items() if n not in got["grads"] or not torch.equal(got["grads"][n], g)
        ]
        if differing or set(got["grads"]) != set(reference["grads"]):
            found.append(f"{name}: gradients differ in {', '.join(differing) or 'the set of parameters'}")
    return found


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}, Python {platform.python_version()}"


def paired_ratio(times: dict, name: str, reference: str) -> float:
    return statistics.median(a / b for a, b in zip(times[name], times[reference]))


def print_table(args, first: dict, times: dict, plans: list) -> None:
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"\nLlamaForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, vocab {args.vocab}, fp32, {args.threads} thread(s), {sac_plugin.engine()} engine; "
        "torch SAC and sac_plugin keep aten::mm and every attention overload"
    )
    print(
        f"plan: budget {args.budget} of the {len(plans)} layers' "
        f"{sum(p.profile.no_checkpoint_bytes for p in plans) / MIB:.2f} MiB without checkpointing; their plans "
        f"keep {sum(len(p.kept) for p in plans)} calls and hold {sum(p.held_bytes for p in plans) / MIB:.2f} MiB "
        "(predicted)"
    )
    print(
        f"{len(times[NO_CHECKPOINTING])} interleaved rounds of one step per mode; ratios: median over the rounds "
        "of the round's ratio; held: bytes from the forward to the backward, the whole model's"
    )
    header = f"{COLUMNS[0]:<28}{COLUMNS[1]:>10}{COLUMNS[2]:>14}{COLUMNS[3]:>10}{COLUMNS[4]:>10}"
    print(header)
    print("-" * len(header))
    for name in times:
        held = "-" if first[name]["held"] is None else f"{first[name]['held'] / MIB:.2f}"
        print(
            f"{name:<28}{median[name] * 1e3:>10.2f}{paired_ratio(times, name, TORCH_SAC):>14.3f}"
            f"{paired_ratio(times, name, NO_CHECKPOINTING):>10.3f}{held:>10}"
        )
    if any(step["held"] is None for step in first.values()):
        print(
            "held -: track_activation_memory counts the kept outputs of the native engine's regions only "
            "(docs/engines.md), and this process runs the dispatch-mode engine"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: hidden x 43 / 16)")
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument(
        "--budget", type=float, default=0.3, help="the plan's budget, a fraction of no checkpointing's bytes"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed rounds, one step of every mode each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of every mode before the rounds")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}")
    print(f"machine: {machine()}")
    base = build_model(args)
    tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens}
    models, torch_sac_contexts = make_modes(args, base, batch)
    # apply_recompute_config hands each layer its share of the budget as a plan (`layer._sac_plan`).
    plans = [layer._sac_plan for layer in models[PLUGIN_PLAN].modules() if hasattr(layer, "_sac_plan")]
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    first = first_steps(models, optimizers, batch, torch_sac_contexts)
    differing = mismatches(first)
    print(
        "first step bitwise (loss and every gradient) across modes: "
        + ("yes" if not differing else "NO\n  " + "\n  ".join(differing))
    )

    def train_step(name):
        def run():
            models[name](**batch).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)

        return run

    times = time_interleaved({name: train_step(name) for name in models}, args.steps, 1, warmup=args.warmup)
    print_table(args, first, times, plans)
    print(f"\nwall time: {time.perf_counter() - started:.1f} s")
    if differing:
        raise SystemExit(f"{len(differing)} modes differ from no checkpointing in the first step")


if __name__ == "__main__":
    main()
