"""Trains a small model on CPU for a few steps in three modes and prints what each one costs.

    bash tools/demo.sh [--model gpt|dense|moe] [--config FILE] [--steps N] [--dim D] [--layers L] ...

Models: gpt (units opened in its code), dense (Llama-style) and moe, whose units come from their
target maps. Modes: no checkpointing; full recompute (every layer checkpointed, nothing kept);
selective: for gpt the "attn" unit kept, for dense and moe the recompute config given with
--config (a .json or .yaml RecomputeConfig; default: units ["attn"]). The loss must be identical
in every mode.
"""

from __future__ import annotations

import argparse
import copy
import time

import sac_plugin
import torch
from sac_plugin import RecomputeConfig, apply_recompute_config
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import GPT, Llama, MoEModel


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "dense", "moe"], default="gpt")
    parser.add_argument("--config", help="a RecomputeConfig file (.json, .yaml) for the selective mode")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument(
        "--report", action="store_true", help="also draw the per-layer report (printed in every run) as a PNG"
    )
    parser.add_argument("--report-png", default="sac_report.png", help="where --report draws its chart")
    return parser.parse_args()


def build(args):
    torch.manual_seed(0)
    if args.model == "gpt":
        return GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)
    model_class = Llama if args.model == "dense" else MoEModel
    return model_class(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)


def checkpointers(args):
    """mode -> function that checkpoints a model copy (or None for no checkpointing)."""
    if args.model == "gpt":
        if args.config:
            raise SystemExit("--config applies to --model dense or moe; gpt opens its units in code")

        def gpt(policy):
            def apply(model):
                for block in model.blocks:
                    sac_plugin.apply_selective_checkpointing(block, policy)

            return apply

        return {
            "no checkpointing": None,
            "full recompute": gpt(sac_plugin.Policy()),
            "selective (attn kept)": gpt(sac_plugin.Policy(kept_units=["attn"])),
        }
    config = RecomputeConfig.load(args.config) if args.config else RecomputeConfig(kept_units=["attn"])
    label = "selective (" + (", ".join(u.value for u in config.units) or "nothing") + " kept)"
    return {
        "no checkpointing": None,
        "full recompute": lambda model: apply_recompute_config(model, RecomputeConfig()),
        label: lambda model: apply_recompute_config(model, config),
    }


def draw_report(report, mode: str, path: str) -> None:
    """A bar chart per checkpointed layer: bytes held for backward (kept) and ops recomputed."""
    try:
        import matplotlib
    except ImportError:
        print(f"\n(no chart: matplotlib is not installed; pip install 'sac_plugin[plot]' to draw {path})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(report.layers.values())
    names = [layer.name for layer in layers]
    figure, (held, recomputed) = plt.subplots(1, 2, figsize=(max(8, len(names) * 1.2), 4))
    held.bar(names, [layer.kept_bytes / 2**20 for layer in layers], color="tab:blue")
    held.set_title("bytes kept for backward (MiB)")
    recomputed.bar(names, [layer.total("recompute") for layer in layers], color="tab:orange")
    recomputed.set_title("ops recomputed")
    for axes in (held, recomputed):
        axes.tick_params(axis="x", rotation=45)
    figure.suptitle(f"sac_plugin per-layer report: {mode}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"\nper-layer chart: {path}")


def main():
    args = parse_args()
    base = build(args)
    batches = [
        (torch.randint(args.vocab, (args.batch, args.seq)), torch.randint(args.vocab, (args.batch, args.seq)))
        for _ in range(args.steps)
    ]
    print(
        f"{type(base).__name__}: dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, "
        f"{sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads" + (f", config {args.config}" if args.config else "") + "\n"
    )
    results, reports = {}, {}
    for mode, checkpoint_model in checkpointers(args).items():
        model = copy.deepcopy(base)
        if checkpoint_model is not None:
            checkpoint_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, times = [], []
        for tokens, targets in batches:
            optimizer.zero_grad(set_to_none=True)
            audit = sac_plugin.audit()
            started = time.perf_counter()
            with audit, track_activation_memory(model.parameters()) as memory:
                loss = model.loss(tokens, targets)
                held = memory.bytes()
                loss.backward()
            times.append(time.perf_counter() - started)
            optimizer.step()
            losses.append(loss.item())
            recomputed = sum(row.recompute for row in audit.rows())
            served = sum(row.hits for row in audit.rows())
        results[mode] = (losses, held, sorted(times)[len(times) // 2], recomputed, served)
        if mode.startswith("selective"):
            # One more forward and backward, untimed and without an optimizer step: the report's
            # per-pass audits cost time, and its saved-tensors hook would hide the saves from
            # track_activation_memory's.
            with sac_plugin.report(model) as report:
                model.loss(*batches[-1]).backward()
            reports[mode] = report

    header = f"{'mode':<48}{'final loss':>12}{'activations held':>19}{'step (median)':>15}{'ops recomputed':>16}{'kept served':>13}"
    print(header)
    print("-" * len(header))
    for mode, (losses, held, step, recomputed, served) in results.items():
        print(
            f"{mode:<48}{losses[-1]:>12.6f}{held / 2**20:>15.1f} MiB{step * 1e3:>12.1f} ms{recomputed:>16}{served:>13}"
        )
    reference = results["no checkpointing"][0]
    identical = all(losses == reference for losses, *_ in results.values())
    print(f"\nlosses identical across modes at every step: {identical}")
    for mode, report in reports.items():
        print(f"\nper-layer report, {mode}, one more step on the last batch:\n{report.table()}")
        if args.report:
            draw_report(report, mode, args.report_png)
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
