"""The offload model a plan made with offload=True prices its copies with (planner/_cost.py's
OffloadModel): `plan`'s offload arguments checked, and the bandwidths given or timed on the
layer's accelerator."""

from __future__ import annotations

import logging

import torch

from .._validation import bounded_repr, describe_value
from ._cost import OFFLOAD_MIN_BYTES, OffloadModel, is_byte_count, is_rate
from ._profile import accelerator_device, measure_offload_bandwidth

__all__ = ["check_offload_arguments", "offload_model"]

log = logging.getLogger("sac_plugin")
_warned_offload_unavailable: set[str] = set()


def check_offload_arguments(
    *, offload=False, offload_bandwidth=None, host_memory_limit=None, offload_min_bytes=None
) -> None:
    """`plan`'s offload arguments, each checked, and none but offload without offload=True."""
    if not isinstance(offload, bool):
        raise TypeError(f"sac_plugin: plan: offload must be True or False, got {describe_value(offload)}")
    named = (
        ("offload_bandwidth", offload_bandwidth),
        ("host_memory_limit", host_memory_limit),
        ("offload_min_bytes", offload_min_bytes),
    )
    given = [name for name, value in named if value is not None]
    if given and not offload:
        raise ValueError(f"sac_plugin: plan: {', '.join(given)} only apply with offload=True")
    pair = isinstance(offload_bandwidth, (tuple, list)) and len(offload_bandwidth) == 2
    if offload_bandwidth is not None and not (pair and all(map(is_rate, offload_bandwidth))):
        raise ValueError(
            "sac_plugin: plan: offload_bandwidth must be (device_to_host, host_to_device) bytes per "
            f"second, two finite numbers > 0, got {bounded_repr(offload_bandwidth)}"
        )
    if host_memory_limit is not None and not is_byte_count(host_memory_limit):
        raise ValueError(
            "sac_plugin: plan: host_memory_limit must be None (no cap) or an int from 0 to 2**63 - 1 "
            f"(bytes), got {bounded_repr(host_memory_limit)}"
        )
    if offload_min_bytes is not None and not is_byte_count(offload_min_bytes):
        raise ValueError(
            f"sac_plugin: plan: offload_min_bytes must be an int from 0 to 2**63 - 1 (bytes), got "
            f"{bounded_repr(offload_min_bytes)}"
        )


def offload_model(
    module, args, kwargs, *, offload=False, offload_bandwidth=None, host_memory_limit=None, offload_min_bytes=None
) -> OffloadModel | None:
    """The offload model for a plan with offload=True (`plan`'s arguments, checked): the given
    bandwidths, else the ones timed on the layer's accelerator; None (with one logged warning per
    reason) where there is neither, and without offload=True."""
    if not offload:
        return None
    if offload_bandwidth is None:
        device = accelerator_device(module, args, kwargs)
        if device is None:
            if not torch.accelerator.is_available():
                reason = "no accelerator is available"
            else:
                reason = f"the layer's parameters and inputs are not on the {torch.accelerator.current_accelerator()}"
            if reason not in _warned_offload_unavailable:
                _warned_offload_unavailable.add(reason)
                log.warning(
                    "sac_plugin: plan: offload=True, but %s and no offload_bandwidth was given: the plan "
                    "keeps or recomputes each call (pass offload_bandwidth=(device_to_host, host_to_device) "
                    "bytes per second to plan offload for another machine)",
                    reason,
                )
            return None
        offload_bandwidth = measure_offload_bandwidth(device)
        log.info(
            "sac_plugin: plan: copies between %s and pinned host memory: %.3f GB/s to the host, %.3f GB/s back",
            device,
            offload_bandwidth[0] / 1e9,
            offload_bandwidth[1] / 1e9,
        )
    return OffloadModel(
        float(offload_bandwidth[0]),
        float(offload_bandwidth[1]),
        OFFLOAD_MIN_BYTES if offload_min_bytes is None else offload_min_bytes,
        host_memory_limit,
    )
