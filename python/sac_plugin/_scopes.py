"""Region and unit scopes through the library's C ABI (NOTE: [Scopes through a C ABI] in
csrc/bindings/c_api.h): a checkpoint call opens a region and enters and exits two scopes,
and torchbind's per-call cost there outweighed the interception of a hundred ops. ctypes calls
the same checks and state changes as the torchbind methods, for about a tenth of the cost."""

from __future__ import annotations

import torch

from . import _native

_ERRORS = {_native.ScopeStatus.RUNTIME_ERROR: RuntimeError, _native.ScopeStatus.VALUE_ERROR: ValueError}

_site_new = _native.lib.sac_site_new
_site_release = _native.lib.sac_site_release
_region_new = _native.lib.sac_region_new
_region_release = _native.lib.sac_region_release
_region_enter = _native.lib.sac_region_enter
region_exit = _native.lib.sac_region_exit
_unit_id = _native.lib.sac_unit_id
unit_push = _native.lib.sac_unit_push
_unit_pop = _native.lib.sac_unit_pop
_last_error = _native.lib.sac_scope_last_error
region_forward_position = _native.lib.sac_region_forward_position
_region_release_unreached = _native.lib.sac_region_release_unreached


def release_unreached(address: int, last_saved_position: int) -> int:
    """NOTE: [Kept outputs the recompute never reaches]: frees what the early stop never serves."""
    released = _region_release_unreached(address, last_saved_position)
    if released < 0:
        raise_last_error(-released)
    return released


def raise_last_error(status: int):
    raise _ERRORS.get(status, RuntimeError)(_last_error().decode("utf-8", "replace"))


class SiteReference:
    """Owns one reference to a C++ checkpoint site (NOTE: [What a site learns] in
    csrc/dispatch/site.h): one policy applied at one place; the regions made from it share it."""

    __slots__ = ("address",)

    def __init__(self, policy_address: int, label: str = ""):
        self.address = _site_new(policy_address, label.encode())

    def __del__(self, _release=_site_release):
        _release(self.address)


class RegionReference:
    """Owns one reference to a C++ region handle; dropping the last Python reference releases it.

    The scopes and the Region wrapper each point here, and nothing here points back, so a
    region is freed by reference counting as soon as torch's checkpoint drops its contexts,
    never left to the cycle collector.
    """

    __slots__ = ("address",)

    def __init__(self, site_address: int):
        self.address = _region_new(site_address)

    @classmethod
    def adopt(cls, address: int) -> RegionReference:
        """Owns a region handle the library made elsewhere (a profiling region)."""
        reference = cls.__new__(cls)
        reference.address = address
        return reference

    def __del__(self, _release=_region_release):
        _release(self.address)

    def torchbind(self):
        """The same region as a torch.classes.sac.Region (shares ownership)."""
        return torch.ops.sac.region_at(self.address)


class RegionScope:
    """The forward (recompute=0) or the recompute (1) of one region, as a context manager.

    The native engine's recompute is a RecomputeScope (_mode_recompute.py), which also runs the
    recompute above any dispatch modes that are on."""

    __slots__ = ("_region", "_address", "_recompute", "_depth")

    def __init__(self, region: RegionReference, recompute: int):
        self._region = region  # owns the handle; the address below is valid while it lives
        self._address = region.address
        self._recompute = recompute
        self._depth = 0

    def __enter__(self):
        depth = _region_enter(self._address, self._recompute)
        if depth < 0:
            raise_last_error(-depth)
        self._depth = depth
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        status = region_exit(self._address, self._recompute, self._depth)
        if status:
            raise_last_error(status)
        return False


def enter_marker(address: int, recompute: int) -> int:
    """Enters the forward (recompute=0, left again at once) or the recompute of a marker region
    (NOTE: [Modes above the key see only what ran] in _mode_recompute.py); returns the depth."""
    depth = _region_enter(address, recompute)
    if depth < 0:
        raise_last_error(-depth)
    if not recompute:
        exit_marker(address, 0, depth)
    return depth


def exit_marker(address: int, recompute: int, depth: int) -> None:
    status = region_exit(address, recompute, depth)
    if status:
        raise_last_error(status)


def profiling_region_forward(profile) -> RegionScope:
    """The forward scope of a new profiling region of `profile` (a torch.classes.sac.CallProfile)."""
    return RegionScope(RegionReference.adopt(profile.new_region_address()), 0)


def unit_id(name: str) -> int:
    """The unit's interned id + 1 (what unit_push and unit_pop take); raises for a bad name."""
    encoded = name.encode("utf-8")
    id_plus_one = _unit_id(encoded, len(encoded))
    if id_plus_one < 0:
        raise_last_error(-id_plus_one)
    return id_plus_one


def unit_pop(id_plus_one: int, depth: int) -> None:
    status = _unit_pop(id_plus_one, depth)
    if status:
        raise_last_error(status)
