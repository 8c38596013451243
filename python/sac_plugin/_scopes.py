"""Region and unit scopes through the library's C ABI (NOTE: [Scopes through a C ABI] in
csrc/bindings/c_api.h): a checkpoint call opens a region and enters and exits two scopes,
and torchbind's per-call cost there outweighed the interception of a hundred ops. ctypes calls
the same checks and state changes as the torchbind methods, for about a tenth of the cost."""

from __future__ import annotations

import ctypes

import torch

from . import _library

_ERRORS = {1: RuntimeError, 2: ValueError}
_EXPECTED_VERSION = 6


def declare(lib, signatures: dict) -> None:
    """Sets each C function's (restype, argtypes), so that ctypes converts and checks them."""
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


def _bind():
    # ctypes on the path torch.ops.load_library loaded returns that very library (dlopen
    # hands back the loaded object), so a SAC_PLUGIN_LIBRARY build serves these calls too.
    # PyDLL: the calls keep the GIL (CDLL would release and retake it around each one, which
    # cost more than the call itself); none of them calls back into Python or blocks.
    lib = ctypes.PyDLL(str(_library.library_path()))
    signatures = {
        "sac_scope_c_api_version": (ctypes.c_int32, []),
        "sac_site_new": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
        "sac_site_release": (None, [ctypes.c_void_p]),
        "sac_region_new": (ctypes.c_void_p, [ctypes.c_void_p]),
        "sac_region_release": (None, [ctypes.c_void_p]),
        "sac_region_enter": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int32]),
        "sac_region_exit": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64]),
        "sac_unit_id": (ctypes.c_int64, [ctypes.c_char_p, ctypes.c_int64]),
        "sac_unit_push": (ctypes.c_int64, [ctypes.c_int64]),
        "sac_unit_pop": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_int64]),
        "sac_scope_last_error": (ctypes.c_char_p, []),
        "sac_region_forward_position": (ctypes.c_int64, [ctypes.c_void_p]),
        "sac_region_release_unreached": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64]),
    }
    declare(lib, signatures)
    version = lib.sac_scope_c_api_version()
    if version != _EXPECTED_VERSION:
        raise ImportError(
            f"sac_plugin: {_library.library_path()} has scope C ABI version {version}, this package expects "
            f"{_EXPECTED_VERSION}; rebuild the library from the same source as the package"
        )
    return lib


_lib = _bind()
_site_new = _lib.sac_site_new
_site_release = _lib.sac_site_release
_region_new = _lib.sac_region_new
_region_release = _lib.sac_region_release
_region_enter = _lib.sac_region_enter
_region_exit = _lib.sac_region_exit
_unit_id = _lib.sac_unit_id
unit_push = _lib.sac_unit_push
_unit_pop = _lib.sac_unit_pop
_last_error = _lib.sac_scope_last_error
region_forward_position = _lib.sac_region_forward_position
_region_release_unreached = _lib.sac_region_release_unreached
_dispatch_modes_on = torch._C._len_torch_dispatch_stack


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

    `above_modes(region_address)`, for a recompute, gives the context the recompute runs under
    while dispatch modes are on, or None (NOTE: [Modes above the key see only what ran] in
    _dispatch_mode.py, a layer above, which the caller asks)."""

    __slots__ = ("_region", "_address", "_recompute", "_depth", "_above_modes", "_above_modes_for")

    def __init__(self, region: RegionReference, recompute: int, above_modes=None):
        self._region = region  # owns the handle; the address below is valid while it lives
        self._address = region.address
        self._recompute = recompute
        self._depth = 0
        self._above_modes = None
        self._above_modes_for = above_modes

    def __enter__(self):
        depth = _region_enter(self._address, self._recompute)
        if depth < 0:
            raise_last_error(-depth)
        self._depth = depth
        if self._above_modes_for is not None and _dispatch_modes_on():
            # NOTE: [Modes above the key see only what ran] (_dispatch_mode.py)
            try:
                above_modes = self._above_modes_for(self._address)
                if above_modes is not None:
                    above_modes.__enter__()
            except BaseException:
                _region_exit(self._address, self._recompute, depth)
                raise
            self._above_modes = above_modes
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        above_modes = self._above_modes
        if above_modes is None:  # every checkpoint call but those under foreign dispatch modes
            status = _region_exit(self._address, self._recompute, self._depth)
        else:
            self._above_modes = None
            try:
                above_modes.__exit__(exc_type, exc_value, traceback)
            finally:
                status = _region_exit(self._address, self._recompute, self._depth)
        if status:
            raise_last_error(status)
        return False


def enter_marker(address: int, recompute: int) -> int:
    """Enters the forward (recompute=0, left again at once) or the recompute of a marker region
    (NOTE: [Modes above the key see only what ran] in _dispatch_mode.py); returns the depth."""
    depth = _region_enter(address, recompute)
    if depth < 0:
        raise_last_error(-depth)
    if not recompute:
        exit_marker(address, 0, depth)
    return depth


def exit_marker(address: int, recompute: int, depth: int) -> None:
    status = _region_exit(address, recompute, depth)
    if status:
        raise_last_error(status)


def profiling_region_forward(profile) -> RegionScope:
    """The forward scope of a new profiling region of `profile` (a torch.classes.sac.CallProfile)."""
    return RegionScope(RegionReference.adopt(profile.new_region_address()), 0)


def new_region_scopes(site_address: int, above_modes=None) -> tuple[RegionScope, RegionScope]:
    """The forward and recompute scopes of a new region of the site at `site_address`; see
    RegionScope for `above_modes`."""
    region = RegionReference(site_address)
    return RegionScope(region, 0), RegionScope(region, 1, above_modes)


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
