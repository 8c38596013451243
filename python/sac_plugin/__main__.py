"""python -m sac_plugin plan --model llama|moe --budget 0.3 [--offload] [--plot plan.png] [--save plan.json]
python -m sac_plugin plan --hf-config config.json --budget 512MiB [--dim 1024 --layers 2]
python -m sac_plugin plan --hf-model-type mistral --budget 0.3
python -m sac_plugin plan --model mypackage.layers:make_layer --budget 64KiB
python -m sac_plugin plan --model llama|moe --peak 8GiB --device cuda [--layers 4] [--offload] [--save step.json]

With --budget, profiles one layer on CPU or --device, plans it within the budget (keep or
recompute per call; keep, offload or recompute with --offload) and prints the plan's table and
its Pareto curve. The layer is a reference decoder layer (--model llama|moe, sac_plugin.models),
the first decoder layer of a transformers model built with random weights from a config
(--hf-config, --hf-model-type; nothing is downloaded), or the layer a factory of yours returns
(--model package.module:function). A budget is a fraction of the layer's no-checkpointing
activation bytes (0.3, 1.0) or bytes with a unit (512MiB, 8GiB, 1000000B). With --peak, plans a
training step of a reference decoder of --layers layers on the --device accelerator so that its
measured peak stays within the bytes given (sac_plugin.plan_step) and prints the step plan's table.
Progress goes to stderr."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ._validation import bounded_repr

REFERENCE_MODELS = ("llama", "moe")
_ONE_LAYER = "(default: none; give one of --model, --hf-config, --hf-model-type)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int >= 1, got {bounded_repr(text)}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"an int >= 1, got {value}")
    return value


def _budget(text: str):
    """A fraction ("0.3", "1.0") or bytes with a unit ("512MiB", "1000000B"), checked as
    sac_plugin.plan checks a budget (a bare "1" reads two ways and is refused there)."""
    from .planner._cost import check_budget

    budget = text
    if text.isdigit():
        budget = int(text)
    elif text.replace(".", "", 1).isdigit():
        budget = float(text)
    try:
        return check_budget(budget, "--budget")
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("sac_plugin: ")) from None


def _bytes_per_second(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bytes per second, a number > 0, got {bounded_repr(text)}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"bytes per second, a number > 0, got {bounded_repr(text)}")
    return value


def _peak_bytes(text: str) -> int:
    """Bytes as an int or a number with a unit: 8GiB, 512MiB, 1.5GB, 4096."""
    from .planner._cost import bytes_from_text

    try:
        return bytes_from_text(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"bytes, {error}") from None


def _byte_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a byte count, an int >= 0, got {bounded_repr(text)}")
    return int(text)


def _model(text: str) -> str:
    if text in REFERENCE_MODELS or (":" in text and all(text.partition(":")[::2])):
        return text
    raise argparse.ArgumentTypeError(
        f"llama, moe or package.module:function (a factory of yours), got {bounded_repr(text)}"
    )


def _imports(name: str) -> bool:
    """Whether an optional dependency imports (it is imported for the work anyway)."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Everything that can be checked before the (long) profile runs, as argparse errors."""
    import torch

    given = [
        flag
        for flag, value in (
            ("--model", args.model),
            ("--hf-config", args.hf_config),
            ("--hf-model-type", args.hf_model_type),
        )
        if value is not None
    ]
    if len(given) != 1:
        parser.error(
            f"give one of --model, --hf-config, --hf-model-type (the layer to plan), got {len(given) or 'none'}"
            + (f": {', '.join(given)}" if given else "")
        )
    if args.model in REFERENCE_MODELS:
        from ._cli_models import REFERENCE_SIZES

        for name, default in REFERENCE_SIZES.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        if args.dim % args.heads:
            parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads} (each head gets dim / heads)")
        if (args.dim // args.heads) % 2:
            parser.error(f"--dim / --heads must be even (rotary embeddings rotate pairs), got {args.dim // args.heads}")
    elif args.peak is not None:
        parser.error("--peak plans a reference model's training step: pass --model llama or --model moe")
    elif args.model is not None:
        sized = [flag for flag in ("--dim", "--heads", "--layers") if getattr(args, flag[2:]) is not None]
        if sized:
            parser.error(f"{', '.join(sized)}: a factory's layer comes sized (--model {args.model}); drop them")
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
    if args.plot is not None and not _imports("matplotlib"):
        parser.error("--plot needs matplotlib, which is not installed: pip install sac_plugin[plot]")
    if (args.hf_config or args.hf_model_type) and not _imports("transformers"):
        parser.error(
            "--hf-config and --hf-model-type need transformers, which is not installed: pip install sac_plugin[huggingface]"
        )


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every option with its help and default."""
    from ._cli_models import FACTORY_CONTRACT

    parser = argparse.ArgumentParser(
        prog="python -m sac_plugin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan_parser = commands.add_parser(
        "plan",
        help="plan a layer within a memory budget",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    add = plan_parser.add_argument
    add(
        "--model",
        type=_model,
        help=f"the layer to plan: llama or moe (a reference layer of sac_plugin.models), or {FACTORY_CONTRACT} "
        f"{_ONE_LAYER}",
    )
    add(
        "--hf-config",
        metavar="PATH",
        help="plan the first decoder layer of a transformers model built with "
        "random weights from this config.json (or a folder holding one) " + _ONE_LAYER,
    )
    add(
        "--hf-model-type",
        metavar="TYPE",
        help="plan the first decoder layer of a transformers model of this "
        "model_type (llama, mistral, qwen2, gpt2, ...), built from its default config with small sizes: --dim "
        "256, --heads 4, --layers 2 and a 512-token vocabulary unless given " + _ONE_LAYER,
    )
    add(
        "--budget",
        type=_budget,
        help="what the layer may hold: a fraction of its no-checkpointing activation "
        "bytes (a float from 0.0 to 1.0: 0.3) or bytes with a unit (512MiB, 8GiB, 1000000B); a bare 0 or 1 reads "
        "two ways and is refused (default: 0.3)",
    )
    add(
        "--peak",
        type=_peak_bytes,
        metavar="BYTES",
        help="plan a training step whose device peak stays within "
        "these bytes (8GiB, 512MiB, or an int), on an accelerator --device; --model llama or moe only "
        "(default: none, plan one layer with --budget)",
    )
    add(
        "--layers",
        type=_positive_int,
        help="decoder layers of the model (default: 4 for --model llama|moe; the "
        "config's for --hf-config; 2 for --hf-model-type)",
    )
    add("--dim", type=_positive_int, help="model width (default: 256; the config's hidden_size for --hf-config)")
    add("--heads", type=_positive_int, help="attention heads (default: 4; the config's for --hf-config)")
    add("--seq", type=_positive_int, default=256, help="sequence length of the example inputs")
    add("--batch", type=_positive_int, default=2, help="batch size of the example inputs")
    add("--runs", type=_positive_int, default=5, help="timed forwards the profile takes the median of")
    add("--device", default="cpu", help="where the layer and its inputs are made and profiled")
    add(
        "--plot",
        metavar="PNG",
        help="write the Pareto curve as a PNG here (needs matplotlib: pip install sac_plugin[plot]) (default: no plot)",
    )
    add("--save", metavar="JSON", help="write the plan as JSON here, which Plan.load reads (default: not saved)")
    add("--offload", action="store_true", help="choose keep, offload or recompute per call (docs/offload.md)")
    add(
        "--offload-bandwidth",
        nargs=2,
        type=_bytes_per_second,
        metavar=("D2H", "H2D"),
        help="copy bandwidths in bytes/s (default: timed on the accelerator)",
    )
    add(
        "--host-memory-limit",
        type=_byte_count,
        metavar="BYTES",
        help="pinned host bytes the offloaded calls may hold (default: no cap)",
    )
    return parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and "(default: ...)" after every option that has a default and
    does not say it already."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if "(default" in help_text or action.default in (None, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action)


def main(argv=None) -> int:
    """The command line: `python -m sac_plugin plan ...` (the module docstring says what it does).

    Args:
        argv: The arguments after the program name; None: `sys.argv[1:]`.

    Returns:
        The exit status: 0 when the plan was made.

    Raises:
        SystemExit: The arguments are refused (status 2, with argparse's message).
    """
    parser = build_parser()
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

    from . import _cli_models as models
    from . import plan as make_plan

    try:
        if args.model in REFERENCE_MODELS:
            layer, inputs = models.reference_layer(args.model, args.dim, args.heads, args.seq, args.batch, args.device)
            kwargs, name = {}, f"{args.model} layer"
            described = f"{name}: dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, {args.device}"
        elif args.model is not None:
            models.progress(f"building the layer {args.model} returns...")
            layer, inputs, kwargs, name = models.factory_layer(args.model)
            described = name
        else:
            models.progress("building the transformers model from its config (random weights)...")
            config = models.hf_config(args.hf_config, args.hf_model_type, args.dim, args.heads, args.layers)
            layer, inputs, kwargs, name = models.hf_layer(config, args.seq, args.batch, args.device)
            described = f"{name}: seq {args.seq}, batch {args.batch}, {args.device}"
    except models.ModelError as error:
        parser.error(str(error))
    taken = sorted(set(kwargs) & models.PLAN_PARAMETERS)
    if taken:
        parser.error(f"{name}: keyword inputs named {', '.join(taken)} are sac_plugin.plan's own arguments")
    clock = models.ForwardClock(layer, name, args.runs)
    try:
        plan = make_plan(layer, *inputs, budget=args.budget, runs=args.runs, **offload, **kwargs)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    finally:
        clock.close()
    print(described)
    print(models.plan_table(plan))
    noisy = models.noise_line(plan, clock.relative_spread())
    if noisy:
        print()
        print(noisy)
    print()
    print("Pareto curve (budget: fraction of no-checkpointing bytes):")
    print(plan.curve())
    print()
    print("policy:", plan.policy)
    if args.save:
        print("saved", plan.save(args.save))
    if args.plot:
        print("plotted", plan.plot(args.plot, title=f"{name}, within {args.budget}"))
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
