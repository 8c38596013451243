"""Timing modes side by side, the one loop every benchmark in tools/ uses.

Every mode runs on the same inputs, interleaved round by round in a shuffled order, so machine
noise and allocator state hit all modes alike and no mode always runs first, right after a
collection. Like timeit, the garbage collector stays off while timing, and each sample is the
mean of a few steps, so one sample is not one timer tick or one collection.
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from typing import Callable, ContextManager

import torch


def time_interleaved(modes: dict[str, Callable[[], None]], reps: int, steps_per_sample: int, *, warmup: int = 3,
                     device="cpu", around: Callable[[str], ContextManager] | None = None) -> dict[str, list[float]]:
    """Seconds per step of every mode: `reps` samples of `steps_per_sample` steps each, in round
    order (sample r of every mode comes from round r, so samples can be paired by round).
    `around(name)` wraps each sample of a mode (an audit, say); it is not timed apart from it."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
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
