"""Per-op overhead of torchtitan's own selective AC against the plugin's, side by side.

On torchtitan's debug model (SDPA attention, CPU): step time (forward + backward) with no
checkpointing, torchtitan's SelectiveAC (torch's SAC + its policy function) and the plugin
(sac_plugin.integrations.torchtitan.apply_ac), modes interleaved in shuffled order, medians.
Overhead per intercepted op = (mode - no checkpointing) / ops intercepted (forward + recompute,
as the plugin's audit counts them). Usage:
    python benchmarks/bench_torchtitan.py [--model llama3|deepseek_v3] [--layers 2] [--seq 64] [--samples 15]
"""

import argparse
import copy
import statistics
import warnings

import sac_plugin
import torch
from sac_plugin.integrations import torchtitan as titan_sac
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from _common import time_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3", choices=["llama3", "deepseek_v3"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    base = titan_sac.cpu_debug_model(args.model, n_layers=args.layers)
    models = {"none": base, "torchtitan SAC": copy.deepcopy(base), "sac_plugin": copy.deepcopy(base)}
    SelectiveAC.Config().build().apply(models["torchtitan SAC"])
    titan_sac.apply_ac(models["sac_plugin"], SelectiveAC.Config())
    tokens = torch.randint(2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def step(model):
        model(tokens).float().pow(2).mean().backward()

    with sac_plugin.audit() as audit:
        step(models["sac_plugin"])
    ops = sum(row.forward + row.recompute for row in audit.rows())
    runs = {name: (lambda model=model: step(model)) for name, model in models.items()}
    times = time_interleaved(runs, args.samples, 1, warmup=1)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{args.model}, {args.layers} blocks, batch {args.batch}, seq {args.seq}, {args.threads} thread(s), "
        f"{args.samples} interleaved samples; {ops} ops intercepted per step (forward + recompute)"
    )
    for name, m in median.items():
        print(f"  {name:15s} median step {m * 1e3:8.2f} ms (min {min(times[name]) * 1e3:8.2f})")
    over = {name: (median[name] - median["none"]) / ops * 1e6 for name in ("torchtitan SAC", "sac_plugin")}
    print(
        f"  overhead per op: torchtitan SAC {over['torchtitan SAC']:.1f} us, sac_plugin {over['sac_plugin']:.1f} us; "
        f"step ratio sac_plugin / torchtitan SAC {median['sac_plugin'] / median['torchtitan SAC']:.3f}"
    )


if __name__ == "__main__":
    main()
