"""Region and unit scopes: a checkpointed region's two scopes are a Python type written in C
(NOTE: [Scopes as a C type] in csrc/bindings/python_scopes.cpp); sites, units and marker regions
go through the library's C ABI with ctypes (NOTE: [Scopes through a C ABI] in
csrc/bindings/c_api.h). Both run the same checks and state changes as the torchbind methods."""

from __future__ import annotations

from . import _native
from ._logging import logger
from ._warnings import HeldNeverServedWarning

_ERRORS = {_native.ScopeStatus.RUNTIME_ERROR: RuntimeError, _native.ScopeStatus.VALUE_ERROR: ValueError}

_site_new = _native.lib.sac_site_new
_site_release = _native.lib.sac_site_release
_site_outside_writes = _native.lib.sac_site_outside_writes
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
_site_dead_calls = _native.lib.sac_site_dead_calls
region_watch_saves = _native.lib.sac_region_watch_saves
region_note_saved = _native.lib.sac_region_note_saved


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

    def __init__(self, policy_address: int, label: str = "", *, marks_passes: bool = False):
        # A site whose regions only mark passes (a dispatch-mode engine's marker) leaves the calls
        # to another region, which finds out what they write outside it.
        self.address = _site_new(policy_address, label.encode(), 0 if marks_passes else 1)

    def outside_writes(self) -> int:
        """0 while no forward of the site has shown it, 1 when its forwards write nothing outside
        their regions, 2 when one did (NOTE: [The recompute writes nothing outside its region])."""
        return _site_outside_writes(self.address)

    def dead_calls(self) -> int:
        """0 while no watched forward of the site has ended, 1 when they found no recompute call
        to skip, 2 when one did (NOTE: [The recompute runs only what backward needs])."""
        return _site_dead_calls(self.address)

    def __del__(self, _release=_site_release):
        _release(self.address)


class MarkerRegionReference:
    """Owns one reference to the C++ handle of a marker region, which the C ABI enters and exits
    (NOTE: [Modes above the key see only what ran] in _mode_recompute.py); dropping it releases
    the handle."""

    __slots__ = ("address",)

    def __init__(self, site_address: int):
        self.address = _region_new(site_address)

    def __del__(self, _release=_region_release):
        _release(self.address)


# A checkpointed region's forward and recompute scopes: a Python type written in C (NOTE: [Scopes
# as a C type] in csrc/bindings/python_scopes.cpp). new_region_scopes(site_address) makes a new
# region of a site and returns its (forward, recompute) scopes, each owning a reference to it; a
# scope's `address` is the region handle's. A recompute scope that opens while dispatch modes are
# on calls the function set_recompute_above_modes gave it with that address.
RegionScope = _native.scope_types.RegionScope
new_region_scopes = _native.scope_types.new_region_scopes
set_recompute_above_modes = _native.scope_types.set_recompute_above_modes
# What a recompute scope warns with when its region held outputs the recompute never asked for.
_native.scope_types.set_never_served_warning(HeldNeverServedWarning)
# Where the runtime's INFO messages go (NOTE: [What the rule recomputes by design is logged, not
# warned] in csrc/ops/user_warning.h): the package's logger.
_native.scope_types.set_info_logger(logger.info)


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
    return _native.scope_types.adopt_forward_scope(profile.new_region_address())


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
