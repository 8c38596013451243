"""What every benchmark here shares: the interleaved timing loop, torch's SAC run with a
sac_plugin policy (and the bytes its cache holds), and which optional comparisons can run.

The benchmarks import this module by name (`from _common import ...`): running a script puts
its own directory, benchmarks/, first on sys.path. They use sac_plugin's public API only.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import time
from typing import Callable, ContextManager

import torch
import sac_plugin
from sac_plugin import torch_policy_fn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import create_selective_checkpoint_contexts

# --- timing ------------------------------------------------------------------------------------------


def synchronizer(device) -> Callable[[], None]:
    """What waits for `device`'s queued work before a clock is read: CUDA runs kernels
    asynchronously; the CPU has nothing queued."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def rounds_to_fill(
    modes: dict[str, Callable[[], None]], seconds: float, steps_per_sample: int, *, at_least: int, device="cpu"
) -> int:
    """How many rounds of time_interleaved fill about `seconds`, and never fewer than `at_least`:
    one round of every mode, `steps_per_sample` steps each, is timed after a step of each warms
    it. A paired median resolves a difference only as well as its number of rounds allows, so a
    small block, whose rounds are short and whose differences are small, gets more of them."""
    sync = synchronizer(device)
    for run in modes.values():
        run()
    sync()
    started = time.perf_counter()
    for run in modes.values():
        for _ in range(steps_per_sample):
            run()
    sync()
    return max(at_least, math.ceil(seconds / (time.perf_counter() - started)))


def time_interleaved(
    modes: dict[str, Callable[[], None]],
    reps: int,
    steps_per_sample: int,
    *,
    warmup: int = 3,
    device="cpu",
    around: Callable[[str], ContextManager] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of every mode: `reps` samples of `steps_per_sample` steps each, in round
    order (sample r of every mode comes from round r, so samples can be paired by round).
    `around(name)` wraps each sample of a mode (an audit, say); it is not timed apart from it.

    Every mode runs on the same inputs, interleaved round by round in a shuffled order, so machine
    noise and allocator state hit all modes alike and no mode always runs first, right after a
    collection. Like timeit, the garbage collector stays off while timing, and each sample is the
    mean of a few steps, so one sample is not one timer tick or one collection."""
    sync = synchronizer(device)
    times: dict[str, list[float]] = {name: [] for name in modes}
    for run in modes.values():
        for _ in range(warmup):
            run()
    gc.collect()
    gc.disable()
    try:
        order = list(modes.items())
        shuffle = random.Random(0).shuffle
        for _ in range(reps):
            shuffle(order)
            for name, run in order:
                with around(name) if around is not None else contextlib.nullcontext():
                    sync()
                    started = time.perf_counter()
                    for _ in range(steps_per_sample):
                        run()
                    sync()
                    times[name].append((time.perf_counter() - started) / steps_per_sample)
            gc.collect()
    finally:
        gc.enable()
    return times


# --- torch's SAC beside the plugin -------------------------------------------------------------------


def torch_sac(policy, caches: list):
    """A context_fn for torch's SAC with the policy's selection (sac_plugin.checkpointing.
    torch_policy_fn), appending each region's cache to `caches` so that its bytes can be counted."""

    def contexts():
        forward, recompute = create_selective_checkpoint_contexts(torch_policy_fn(policy))
        caches.append(forward.storage)
        return forward, recompute

    return contexts


def cached_tensors(caches):
    """Tensors in torch's SAC caches: {op: {call index: outputs}} in torch 2.13, {op: [outputs]} in
    2.11; outputs are _VersionWrapper trees (or a marker for recomputed calls)."""
    for cache in caches:
        for calls in cache.values():
            for outputs in calls.values() if isinstance(calls, dict) else calls:
                for leaf in tree_leaves(outputs):
                    value = getattr(leaf, "val", leaf)
                    if isinstance(value, torch.Tensor):
                        yield value


# --- optional comparisons ----------------------------------------------------------------------------


def have_torch_remat() -> bool:
    try:
        import torch_remat  # noqa: F401
    except ImportError:
        return False
    return True


def why_trace_cannot_run() -> str | None:
    """None where sac_plugin.trace runs in this process, else the reason it gives."""
    # sac_plugin.trace checks first on entry, so a refusal leaves nothing installed.
    try:
        with sac_plugin.trace():
            pass
    except RuntimeError as error:
        return str(error)
    return None
