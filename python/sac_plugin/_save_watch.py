"""The forward of a checkpoint site, watched at each tensor autograd saves for backward: what the
context function wraps a forward scope in while its site still has something to learn
(checkpointing._selective_contexts)."""

from __future__ import annotations

import torch

from ._logging import logger
from ._site import Site

__all__ = ["SaveWatch"]


def _checkpoint_frame(pack):
    """The frame of torch's checkpoint whose pack hook this is (in the hook's closure), or None
    for a hook that is not torch's checkpoint's: nothing to watch."""
    for cell in getattr(pack, "__closure__", None) or ():
        try:
            frame = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(frame, "early_stop") and hasattr(frame, "weak_holders"):
            return frame
    return None


def _note_saved(region, tensor) -> None:
    """Tells the region (a _C.Region) which storage a tensor autograd saved lives in; a subclass by
    the tensors it wraps (DTensor's local shard), and one the region cannot place as such (0)."""
    if hasattr(type(tensor), "__tensor_flatten__"):
        for name in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                _note_saved(region, inner)
        return
    try:
        storage = tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        storage = 0
    region.note_saved(storage)


class SaveWatch:
    """A forward of a checkpoint site, watched at each tensor autograd saves for backward.

    torch's checkpoint pushes its saved-tensor hooks just before it enters this context, so they
    are the top hooks here. Hooks of the same pack are pushed over them for the forward: each save
    is noted, then goes to torch's pack hook unchanged. Two things are learnt:
      - on the site's first forward, where the checkpoint stops its recompute early, the region's
        position (calls decided so far) at each save: at the end of the forward the region frees
        the kept outputs after the last save, and the site remembers them (NOTE: [Kept outputs the
        recompute never reaches] in csrc/dispatch/kept_outputs.cpp);
      - on every forward of a site whose first found recompute calls to skip, the storage of each
        saved tensor, from which the region finds the calls nothing the backward needs (NOTE: [The
        recompute runs only what backward needs] in csrc/dispatch/dead_calls.cpp).
    Sites with nothing left to learn run unwatched, on the hot path."""

    __slots__ = (
        "_site",
        "_forward",
        "_position",
        "_release_unreached",
        "_region",
        "_last_saved",
        "_pushed",
        "_watches_reach",
    )

    def __init__(self, site: Site, forward, position, release_unreached, region):
        self._site, self._forward = site, forward
        self._position, self._release_unreached = position, release_unreached
        # The region (a _C.Region) where its forward may skip calls, else None.
        self._region = region
        self._last_saved, self._pushed, self._watches_reach = 0, False, False

    def __enter__(self):
        self._forward.__enter__()
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        frame = _checkpoint_frame(hooks[0]) if hooks is not None else None
        if frame is None:
            return self
        watch_reach = self._site.reach_unknown and bool(frame.early_stop)
        region = self._region if self._region is not None and self._region.watch_saves() else None
        if not (watch_reach or region is not None):
            return self
        pack, unpack = hooks
        position = self._position

        def note_save(tensor):
            if watch_reach:
                self._last_saved = position()
            if region is not None:
                _note_saved(region, tensor)
            return pack(tensor)

        torch._C._autograd._push_saved_tensors_default_hooks(note_save, unpack)
        self._pushed, self._watches_reach = True, watch_reach
        return self

    def __exit__(self, *exc_info):
        try:
            if self._pushed:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            if exc_info[0] is None:
                site = self._site
                if self._watches_reach:
                    released = self._release_unreached(self._last_saved)
                    if released:
                        logger.info(
                            "%d kept calls of %s run after the region's last tensor saved for backward; "
                            "torch's early stop never serves them, so they are not held",
                            released,
                            site.policy,
                        )
                # Settled after one completed forward, also where there was nothing to watch (a
                # checkpoint without early stop): later forwards take the hot path unless the site
                # skips dead calls.
                site.reach_unknown = False
        finally:
            suppressed = self._forward.__exit__(*exc_info)
            if exc_info[0] is None:
                self._site.watches_saves = self._site.watches_saves and self._site.finds_dead_calls()
        return suppressed
