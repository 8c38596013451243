"""Activation memory held between forward and backward, counted by unique storage.

What is counted: every tensor autograd saves outside checkpointed regions (a checkpoint's own
inputs included), plus every output a sac_plugin region keeps, plus any extra tensors a caller
adds (torch's SAC cache, for comparisons). Each storage counts once, whole, however many
tensors view it; parameters' storages are not activations and are left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from . import _native, _observers

__all__ = ["ActivationMemory", "empty_offload_pool", "offload_stats", "track_activation_memory"]

OFFLOAD_STATS = (
    "copies_to_host",
    "bytes_to_host",
    "copies_to_device",
    "bytes_to_device",
    "pool_bytes",
    "pool_bytes_in_use",
    "pool_bytes_cached",
    "pool_allocations",
    "pool_trims",
    "pool_bytes_trimmed",
    "exposed_copy_us",
)


class ActivationMemory(_observers.Observer):
    """What a `track_activation_memory` block saw; `bytes()` counts it.

    Args:
        parameters: Tensors whose storages are not activations (the model's parameters): the
            count leaves them out wherever they are saved.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._saved: list[torch.Tensor] = []
        self._regions: list = []  # sac_plugin.Region
        self._extra: list[Callable[[], Iterable[torch.Tensor]]] = []
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}

    def add_source(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Counts more tensors as activations: those another mechanism holds for the backward
        (torch's own selective-checkpointing caches, say).

        Args:
            tensors: Called by each `bytes()`; returns the tensors held at that moment.
        """
        self._extra.append(tensors)

    def _tensors(self):
        yield from self._saved
        for region in self._regions:
            yield from region.kept_tensors()
        for source in self._extra:
            yield from source()

    def bytes(self) -> int:
        """Bytes of the unique storages held for the backward, parameters left out.

        Counts the tensors autograd saved in the block, the outputs sac_plugin's regions keep on
        the device, and the added sources' tensors; a storage several of them share counts once.

        Returns:
            The byte count.
        """
        storages = {}
        for tensor in self._tensors():
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if storage.data_ptr() in self._parameter_storages:
                continue
            storages[key] = storage.nbytes()
        return sum(storages.values())

    def region_created(self, region) -> None:
        """Counts a region made inside the block: the regions report what they keep.

        Args:
            region: The `sac_plugin.Region`.
        """
        self._regions.append(region)

    def kept_by_plugin(self) -> int:
        """Device bytes the block's regions keep for the backward (part of `bytes()`).

        Returns:
            The sum of the regions' `kept_bytes`.
        """
        return sum(region.kept_bytes for region in self._regions)

    def offloaded_by_plugin(self) -> int:
        """Pinned host bytes the plugin's offloaded outputs hold (not counted by bytes()).

        Returns:
            The sum of the regions' `offloaded_bytes`.
        """
        return sum(region.offloaded_bytes for region in self._regions)


@contextlib.contextmanager
def track_activation_memory(parameters: Iterable[torch.Tensor] = ()):
    """Context manager that counts the activation memory a forward holds for its backward.

    ```python
    with track_activation_memory(model.parameters()) as memory:
        loss = model(x).sum()
    print(memory.bytes())
    ```

    Args:
        parameters: The model's parameters, which the count leaves out.

    Yields:
        The `ActivationMemory` that counts what the block saves.
    """
    memory = ActivationMemory(parameters)

    def pack(tensor):
        memory._saved.append(tensor)
        return tensor

    with _observers.observe(memory), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield memory


def offload_stats() -> dict[str, int]:
    """What offloading has done in this process (NOTE: [Offloading kept outputs]): copies to the
    host and back with their bytes (counters that only grow), the pinned pool (NOTE: [A bounded
    pinned pool]: pinned bytes it holds, of them in use by offloaded outputs and cached for reuse,
    buffers it has allocated, idle buffers it has freed and their bytes), and exposed_copy_us: how long
    the compute streams waited for copies back, summed over the serves whose copy events have
    completed (on an accelerator whose events carry times: CUDA, the test accelerator).

    Returns:
        Each counter by name: copies_to_host, bytes_to_host, copies_to_device, bytes_to_device,
            pool_bytes, pool_bytes_in_use, pool_bytes_cached, pool_allocations, pool_trims,
            pool_bytes_trimmed and exposed_copy_us.
    """
    return dict(zip(OFFLOAD_STATS, _native.C.offload_stats()))


def empty_offload_pool() -> int:
    """Frees the pinned pool's idle buffers (those no copy uses any more).

    Returns:
        The bytes freed.
    """
    return _native.C.empty_offload_pool()
