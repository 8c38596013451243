"""Sites, region scopes and units, as the extension module has them (NOTE: [One extension module]
in csrc/bindings/python_module.cpp): a checkpointed region's two scopes are a Python type written
in C (NOTE: [Scopes as a C type] in csrc/bindings/python_scopes.cpp); marker regions are entered
and exited through their Region."""

from __future__ import annotations

from . import _native
from ._logging import logger
from ._warnings import HeldNeverServedWarning

_C = _native.C

# A checkpointed region's forward and recompute scopes (NOTE: [Scopes as a C type]).
# Site.new_region_scopes() makes a new region of a site and returns its (forward, recompute)
# scopes, each owning a reference to it; a scope's `region` is that region. A recompute scope that
# opens while dispatch modes are on calls the function set_recompute_above_modes gave it with its
# region.
RegionScope = _C.RegionScope
Region = _C.Region
set_recompute_above_modes = _C.set_recompute_above_modes
# What a recompute scope warns with when its region held outputs the recompute never asked for.
_C.set_never_served_warning(HeldNeverServedWarning)
# Where the runtime's INFO messages go (NOTE: [What the rule recomputes by design is logged, not
# warned] in csrc/ops/user_warning.h): the package's logger.
_C.set_info_logger(logger.info)

unit_id = _C.unit_id
unit_push = _C.unit_push
unit_pop = _C.unit_pop


def new_site(policy, label: str = "", *, marks_passes: bool = False):
    """A C++ checkpoint site (NOTE: [What a site learns] in csrc/dispatch/site.h) for a
    sac_plugin.Policy: one policy applied at one place; the regions made from it share it. A site
    whose regions only mark passes (a dispatch-mode engine's marker) leaves the calls to another
    region, which finds out what they write outside it.

    Its outside_writes() is 0 while no forward of the site has shown it, 1 when its forwards write
    nothing outside their regions, 2 when one did (NOTE: [The recompute writes nothing outside its
    region]); its dead_calls() 0 while no watched forward of the site has ended, 1 when they found
    no recompute call to skip, 2 when one did (NOTE: [The recompute runs only what backward needs])."""
    return _C.Site(policy._handle, label, not marks_passes)


def enter_marker(region, recompute: bool) -> int:
    """Enters the forward (left again at once) or the recompute of a marker region (NOTE: [Modes
    above the key see only what ran] in _mode_recompute.py); returns the depth."""
    depth = region.enter(recompute)
    if not recompute:
        region.exit(False, depth)
    return depth


def profiling_region_forward(profile) -> RegionScope:
    """The forward scope of a new profiling region of `profile` (a _C.CallProfile)."""
    return profile.new_region_forward()
