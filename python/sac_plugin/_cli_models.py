"""The layers `python -m sac_plugin plan` plans, and how it reports on them: a reference layer
(sac_plugin.models), the first decoder layer of a transformers model built from its config with
random weights, or the layer a user's factory returns; the plan's table with names that fit its
columns; and whether the profile's timings can tell the chosen plan from the next best."""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time

import torch

from ._validation import bounded_repr

REFERENCE_SIZES = {"dim": 256, "heads": 4, "layers": 4}
# --hf-model-type builds a model from transformers' defaults for the type (often billions of
# parameters): these sizes keep it small unless --dim/--heads/--layers say otherwise.
HF_TYPE_SIZES = {"dim": 256, "heads": 4, "layers": 2, "vocab": 512}


class ModelError(ValueError):
    """A model the command cannot build; the message says why and what to pass instead."""


def progress(message: str) -> None:
    """A line on stderr before a phase that may take more than a second."""
    print(message, file=sys.stderr, flush=True)


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
    from .models import LlamaBlock, MoEBlock, rotary_tables

    torch.manual_seed(0)
    block = (LlamaBlock if model == "llama" else MoEBlock)(dim, heads).to(device)
    cos, sin = rotary_tables(dim // heads, seq, device=device)
    x = torch.randn(batch, seq, dim, device=device, requires_grad=True)
    return block, (x, cos, sin)


def hf_config(path: str | None, model_type: str | None, dim, heads, layers):
    """The transformers config --hf-config or --hf-model-type names, with --dim/--heads/--layers
    applied where given (for --hf-model-type, small sizes where not: HF_TYPE_SIZES)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ModelError(
            "--hf-config and --hf-model-type need transformers: pip install sac_plugin[huggingface]"
        ) from None
    if path is not None:
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ModelError(f"--hf-config {bounded_repr(path)}: no such file (a config.json, or a folder holding one)")
        try:
            config = AutoConfig.from_pretrained(file, local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise ModelError(f"--hf-config {bounded_repr(path)}: transformers cannot read it: {error}") from None
    else:
        try:
            config = AutoConfig.for_model(model_type)
        except ValueError as error:
            raise ModelError(f"--hf-model-type {bounded_repr(model_type)}: {str(error).splitlines()[0]}") from None
        dim, heads = dim or HF_TYPE_SIZES["dim"], heads or HF_TYPE_SIZES["heads"]
        layers = layers or HF_TYPE_SIZES["layers"]
        config.vocab_size = HF_TYPE_SIZES["vocab"]
        if hasattr(config, "intermediate_size"):
            config.intermediate_size = 4 * dim
    if dim is not None:
        config.hidden_size = dim
    if heads is not None:
        config.num_attention_heads = heads
        if getattr(config, "num_key_value_heads", None) is not None:
            config.num_key_value_heads = heads
    if dim is not None or heads is not None:
        if config.hidden_size % config.num_attention_heads:
            raise ModelError(
                f"the hidden size {config.hidden_size} must be a multiple of the {config.num_attention_heads} "
                "attention heads (--dim, --heads)"
            )
        if getattr(config, "head_dim", None) is not None:
            config.head_dim = config.hidden_size // config.num_attention_heads
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def hf_layer(config, seq: int, batch: int, device: str):
    """The first decoder layer of a causal LM built from `config` (random weights, seeded with 0)
    and the inputs it gets in one forward of the model on random token ids: `(layer, args,
    kwargs, name)`."""
    from transformers import AutoModelForCausalLM

    from .integrations._huggingface_prepare import _CACHE_ARGUMENTS
    from .integrations.huggingface import decoder_layers
    from .planner._apply import _capture_inputs

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config).to(device)
    except (ValueError, KeyError) as error:
        raise ModelError(f"transformers cannot build a causal LM from this config: {error}") from None
    layer = decoder_layers(model)[0]
    name = next(n for n, m in model.named_modules() if m is layer)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ModelError(f"--seq {seq} is over the model's max_position_embeddings {limit}")
    tokens = torch.randint(config.vocab_size, (batch, seq), device=device)
    progress(f"running {type(model).__name__} once to capture {name}'s inputs...")
    [(args, kwargs)] = _capture_inputs(model, [layer], ((), {"input_ids": tokens, "use_cache": False}))
    # As the transformers integration plans a layer: no cache is kept or read while profiling.
    kwargs = {k: (False if k == "use_cache" else None if k in _CACHE_ARGUMENTS else v) for k, v in kwargs.items()}
    return layer, args, kwargs, f"{type(layer).__name__} ({name} of {config.model_type})"


FACTORY_CONTRACT = (
    "package.module:function, a function taking no arguments that returns (layer, args) or (layer, args, "
    "kwargs): an nn.Module, the tuple of positional inputs it is planned on (tensors that need gradients "
    "marked requires_grad), and a dict of keyword inputs"
)


def factory_layer(spec: str):
    """The layer a --model package.module:function factory returns: `(layer, args, kwargs, name)`."""
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except ImportError as error:
        raise ModelError(f"--model {bounded_repr(spec)}: cannot import {module_name}: {error}") from None
    except AttributeError:
        raise ModelError(f"--model {bounded_repr(spec)}: {module_name} has no {function_name}") from None
    made = function()
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise ModelError(f"--model {bounded_repr(spec)} returned {bounded_repr(made)}; expected {FACTORY_CONTRACT}")
    layer, args, kwargs = made if len(made) == 3 else (*made, {})
    if not isinstance(layer, torch.nn.Module) or not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise ModelError(
            f"--model {bounded_repr(spec)} returned ({type(layer).__name__}, {type(args).__name__}, "
            f"{type(kwargs).__name__}); expected {FACTORY_CONTRACT}"
        )
    return layer, args, kwargs, f"{type(layer).__name__} (from {spec})"


# sac_plugin.plan's own parameters: a layer's keyword inputs cannot share these names.
PLAN_PARAMETERS = frozenset(
    ("module", "budget", "runs", "warmup", "offload", "offload_bandwidth", "host_memory_limit", "offload_min_bytes")
)


class ForwardClock:
    """Wall time of each forward of a layer, by hooks: the last `runs` are the profile's timed runs
    (profile_layer runs the warmup and the two byte counts first). Also says which run starts."""

    def __init__(self, layer: torch.nn.Module, name: str, runs: int):
        self.seconds: list[float] = []
        self._started = 0.0
        self._calls = 0
        self._name, self._runs = name, runs
        self._handles = [layer.register_forward_pre_hook(self._before), layer.register_forward_hook(self._after)]

    def _before(self, module, args):
        self._calls += 1
        # sac_plugin.plan's forwards of the layer: 1 warmup, 3 counting bytes (without checkpointing,
        # and with it: forward and recompute), then the timed runs.
        total = self._runs + 4
        phase = "warmup" if self._calls == 1 else "counting bytes" if self._calls <= 4 else "timed"
        progress(f"profiling {self._name} (run {min(self._calls, total)} of {total}: {phase})...")
        self._started = time.perf_counter()

    def _after(self, module, args, output):
        self.seconds.append(time.perf_counter() - self._started)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def relative_spread(self) -> float | None:
        """(max - min) / median of the timed runs' forward times; None with fewer than 2 runs."""
        timed = self.seconds[-self._runs :]
        if len(timed) < 2 or statistics.median(timed) <= 0:
            return None
        return (max(timed) - min(timed)) / statistics.median(timed)


def noise_line(plan, spread: float | None) -> str | None:
    """A line saying the timings cannot tell the chosen plan from the next best, else None.

    The next best is the nearest plan within the budget: the chosen one with one kept call
    recomputed instead, or swapped for one it recomputes. Their predicted recompute times differ by
    the calls' median times; when that difference is under `spread` (the run-to-run relative
    spread of the layer's forward) times the larger of the two, the runs cannot tell them apart.
    """
    if spread is None:
        return None
    from .planner._cost import call_key

    calls = [c for c in plan.profile.calls if c.keepable and call_key(c) not in plan.offloaded]
    kept = [c for c in calls if call_key(c) in plan.kept]
    others = [c for c in calls if call_key(c) not in plan.kept and c.bytes > 0]
    room = plan.budget_bytes - plan.held_bytes
    # (difference in recompute seconds, what the next best does instead, the larger call time)
    rivals = [(k.seconds, f"recomputing {k.op} #{k.index}", k.seconds) for k in kept]
    rivals += [
        (k.seconds - u.seconds, f"keeping {u.op} #{u.index} instead of {k.op} #{k.index}", max(k.seconds, u.seconds))
        for k in kept
        for u in others
        if u.bytes - k.bytes <= room and u.seconds <= k.seconds
    ]
    if not rivals:
        return None
    gap, instead, largest = min(rivals)
    if gap >= spread * largest:
        return None
    return (
        f"timings too noisy to separate this plan from the next best ({instead}): their predicted recompute "
        f"times differ by {gap * 1e3:.3f} ms, under the {spread:.0%} run-to-run spread of the layer's forward "
        "(more --runs, or a quieter machine, may separate them)"
    )


def _fit(text: str, width: int) -> str:
    """`text` in `width` characters: a longer one keeps its start and end around "~"."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "~" + text[len(text) - (width - 1 - head) :]


def plan_table(plan) -> str:
    """Plan.table's rows with each op and unit cut to its column (long names would push the
    numbers out of line); the per-call offload rows follow as Plan.table prints them."""
    mib = 2**20
    lines = [
        repr(plan),
        f"{'op':<48}{'unit':<14}{'calls':>6}{'kept':>6}{'MiB':>9}{'kept MiB':>10}{'ms':>9}{'saved ms':>10}  not keepable",
    ]
    for r in plan.rows():
        lines.append(
            f"{_fit(r['op'], 47):<48}{_fit(r['unit'] or '-', 13):<14}{r['calls']:>6}{r['kept']:>6}"
            f"{r['bytes'] / mib:>9.3f}{r['kept_bytes'] / mib:>10.3f}{r['seconds'] * 1e3:>9.3f}"
            f"{r['saved_seconds'] * 1e3:>10.3f}  {r['not_keepable']}"
        )
    if plan.offload is not None:
        full = plan.table().splitlines()
        lines += full[full.index("") :]
    return "\n".join(lines)


__all__ = [
    "FACTORY_CONTRACT",
    "ForwardClock",
    "ModelError",
    "PLAN_PARAMETERS",
    "factory_layer",
    "hf_config",
    "hf_layer",
    "noise_line",
    "plan_table",
    "progress",
    "reference_layer",
]
