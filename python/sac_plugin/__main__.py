"""python -m sac_plugin plan --model llama|moe --budget 0.3 [--offload] [--plot plan.png] [--save plan.json]
python -m sac_plugin plan --model llama|moe --peak 8GiB --device cuda [--layers 4] [--offload] [--save step.json]

With --budget, profiles one reference decoder layer (sac_plugin.models) on CPU or --device, plans
it within the budget (keep or recompute per call; keep, offload or recompute with --offload) and
prints the plan's table and its Pareto curve. With --peak, plans a training step of a reference
decoder of --layers layers on the --device accelerator so that its measured peak stays within
the bytes given (sac_plugin.plan_step) and prints the step plan's table."""

from __future__ import annotations

import argparse
import os
import sys

from ._validation import bounded_repr


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int >= 1, got {bounded_repr(text)}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"an int >= 1, got {value}")
    return value


def _budget(text: str):
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a fraction from 0.0 to 1.0 or a byte count, got {bounded_repr(text)}"
        ) from None


def _bytes_per_second(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bytes per second, a number > 0, got {bounded_repr(text)}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"bytes per second, a number > 0, got {bounded_repr(text)}")
    return value


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _peak_bytes(text: str) -> int:
    """Bytes as an int or a number with a unit: 8GiB, 512MiB, 1.5GB, 4096."""
    number = text.rstrip("BbKkMmGgTtIi")
    unit = text[len(number) :].upper() or "B"
    accepted = "bytes, an int >= 1 or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as 8GiB"
    try:
        value = int(number) if unit == "B" else float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{accepted}, got {bounded_repr(text)}") from None
    if not (value >= 1 and value < 2**63):
        raise argparse.ArgumentTypeError(f"{accepted}, got {bounded_repr(text)}")
    return int(value)


def _byte_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a byte count, an int >= 0, got {bounded_repr(text)}")
    return int(text)


def reference_layer(model: str, dim: int, heads: int, seq: int, batch: int, device: str):
    """One reference layer and its inputs: the Llama block or the MoE block of sac_plugin.models.

    Args:
        model: "llama" (a LlamaBlock) or "moe" (a MoEBlock).
        dim: The model width.
        heads: Attention heads.
        seq: The sequence length of the inputs.
        batch: The batch size of the inputs.
        device: Where the layer and its inputs are made.

    Returns:
        `(block, (x, cos, sin))`: the layer, seeded with 0, and the inputs it is called with.
    """
    import torch
    from .models import LlamaBlock, MoEBlock, rotary_tables

    torch.manual_seed(0)
    block = (LlamaBlock if model == "llama" else MoEBlock)(dim, heads).to(device)
    cos, sin = rotary_tables(dim // heads, seq, device=device)
    x = torch.randn(batch, seq, dim, device=device, requires_grad=True)
    return block, (x, cos, sin)


def _check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Everything that can be checked before the (long) profile runs, as argparse errors."""
    import torch

    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads} (each head gets dim / heads)")
    if (args.dim // args.heads) % 2:
        parser.error(f"--dim / --heads must be even (rotary embeddings rotate pairs), got {args.dim // args.heads}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        parser.error(f"--device {bounded_repr(args.device)} is not a device (cpu, cuda, cuda:1, ...)")
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        available = getattr(module, "is_available", lambda: False)()
        if not available:
            parser.error(
                f"--device {args.device}: this torch ({torch.__version__}) has no {device.type} device available"
            )
        count = getattr(module, "device_count", lambda: 1)()
        if device.index is not None and device.index >= count:
            indices = f"{device.type}:0" + (f" to {device.type}:{count - 1}" if count > 1 else "")
            parser.error(
                f"--device {args.device}: there is no {device.type} device {device.index}; this machine has "
                f"{count} (pass {device.type} or {indices})"
            )
    for flag, path in (("--save", args.save), ("--plot", args.plot)):
        if path is not None:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                parser.error(f"{flag} {bounded_repr(path)}: the folder {folder} does not exist")
            if not os.access(folder, os.W_OK):
                parser.error(f"{flag} {bounded_repr(path)}: the folder {folder} is not writable")


def main(argv=None) -> int:
    """The command line: `python -m sac_plugin plan ...` (the module docstring says what it does).

    Args:
        argv: The arguments after the program name; None: `sys.argv[1:]`.

    Returns:
        The exit status: 0 when the plan was made.

    Raises:
        SystemExit: The arguments are refused (status 2, with argparse's message).
    """
    parser = argparse.ArgumentParser(
        prog="python -m sac_plugin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan_parser = commands.add_parser("plan", help="plan a reference layer within a memory budget")
    plan_parser.add_argument("--model", choices=["llama", "moe"], required=True)
    plan_parser.add_argument(
        "--budget",
        type=_budget,
        help="fraction of the layer's no-checkpointing activation bytes, or bytes (default 0.3)",
    )
    plan_parser.add_argument(
        "--peak",
        type=_peak_bytes,
        metavar="BYTES",
        help="plan a training step whose device peak stays within these bytes (8GiB, 512MiB, "
        "or an int), on an accelerator --device",
    )
    plan_parser.add_argument(
        "--layers", type=_positive_int, default=4, help="decoder layers of the reference model --peak plans (default 4)"
    )
    plan_parser.add_argument("--dim", type=_positive_int, default=256)
    plan_parser.add_argument("--heads", type=_positive_int, default=4)
    plan_parser.add_argument("--seq", type=_positive_int, default=256)
    plan_parser.add_argument("--batch", type=_positive_int, default=2)
    plan_parser.add_argument("--runs", type=_positive_int, default=5, help="timed forwards (medians)")
    plan_parser.add_argument("--device", default="cpu")
    plan_parser.add_argument("--plot", help="write the Pareto curve as a PNG here (needs matplotlib)")
    plan_parser.add_argument("--save", help="write the plan as JSON here (Plan.load reads it)")
    plan_parser.add_argument(
        "--offload", action="store_true", help="choose keep, offload or recompute per call (docs/offload.md)"
    )
    plan_parser.add_argument(
        "--offload-bandwidth",
        nargs=2,
        type=_bytes_per_second,
        metavar=("D2H", "H2D"),
        help="copy bandwidths in bytes/s (default: timed on the accelerator)",
    )
    plan_parser.add_argument(
        "--host-memory-limit", type=_byte_count, metavar="BYTES", help="pinned host bytes the offloaded calls may hold"
    )
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    if args.peak is not None:
        return _plan_step(parser, args)
    args.budget = 0.3 if args.budget is None else args.budget
    if not args.offload and (args.offload_bandwidth is not None or args.host_memory_limit is not None):
        parser.error("--offload-bandwidth and --host-memory-limit need --offload")
    offload = {}
    if args.offload:
        offload = {"offload": True, "host_memory_limit": args.host_memory_limit}
        if args.offload_bandwidth is not None:
            offload["offload_bandwidth"] = tuple(args.offload_bandwidth)

    from . import plan as make_plan

    block, inputs = reference_layer(args.model, args.dim, args.heads, args.seq, args.batch, args.device)
    try:
        plan = make_plan(block, *inputs, budget=args.budget, runs=args.runs, **offload)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    print(f"{args.model} layer: dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, {args.device}")
    print(plan.table())
    print()
    print("Pareto curve (budget: fraction of no-checkpointing bytes):")
    print(plan.curve())
    print()
    print("policy:", plan.policy)
    if args.save:
        print("saved", plan.save(args.save))
    if args.plot:
        print("plotted", plan.plot(args.plot, title=f"{args.model} layer, dim {args.dim}, seq {args.seq}"))
    return 0


def _plan_step(parser: argparse.ArgumentParser, args) -> int:
    """--peak: a training step of a reference decoder planned by sac_plugin.plan_step."""
    import torch
    from . import plan_step
    from .models import Llama, MoEModel

    if args.budget is not None:
        parser.error("--peak plans a whole training step and --budget one layer; give one of them")
    if args.host_memory_limit is not None:
        parser.error("--host-memory-limit applies to --budget; --peak plans without a host cap")
    if not args.offload and args.offload_bandwidth is not None:
        parser.error("--offload-bandwidth and --host-memory-limit need --offload")
    if torch.device(args.device).type == "cpu":
        parser.error(
            "--peak measures the step's peak in the accelerator's memory statistics; --device cpu has "
            "none (pass --device cuda, or another accelerator)"
        )
    torch.manual_seed(0)
    model = (Llama if args.model == "llama" else MoEModel)(
        vocab=512, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq
    ).to(args.device)
    tokens = torch.randint(512, (args.batch, args.seq), device=args.device)
    targets = torch.randint(512, (args.batch, args.seq), device=args.device)
    offload = {"offload": True} if args.offload else {}
    if args.offload_bandwidth is not None:
        offload["offload_bandwidth"] = tuple(args.offload_bandwidth)
    try:
        plan = plan_step(
            model, lambda: model.loss(tokens, targets).backward(), peak_bytes=args.peak, runs=args.runs, **offload
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    print(
        f"{args.model} model: {args.layers} layers, dim {args.dim}, heads {args.heads}, seq {args.seq}, "
        f"batch {args.batch}, {args.device}"
    )
    print(plan.table())
    if args.save:
        print("saved", plan.save(args.save))
    if args.plot:
        print(
            "plotted", plan.plot(args.plot, title=f"{args.model} model, {args.layers} layers, peak {args.peak} bytes")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
