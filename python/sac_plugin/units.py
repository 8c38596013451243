"""Recompute units: named parts of a model that a policy can keep as a whole."""

from __future__ import annotations

import enum
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading

import torch

from . import _native, _observers, _rule, _scopes, _unit_checks
from ._validation import check_unit_name, describe_value

__all__ = [
    "RecomputeUnit",
    "in_recompute_unit",
    "install_remat_regions",
    "open_units",
    "recompute_unit",
    "uninstall_remat_regions",
]


class RecomputeUnit(enum.StrEnum):
    """Named units a config can keep. Values are what config files spell."""

    ATTN = "attn"
    MLP = "mlp"
    MOE_GATE = "moe_gate"
    MOE_DISPATCH = "moe_dispatch"
    NORM = "norm"


_unit_checks.add_vocabulary(unit.value for unit in RecomputeUnit)


# Under torch.compile a unit is carried as node metadata: torch.fx.traceback.annotate writes
# node.meta["custom"], and the policy function that tags nodes for the partitioner reads it back
# from fx_traceback.current_meta while AOTAutograd traces the checkpointed region (see
# checkpointing.torch_policy_fn, through annotated_units). One key per unit, so nested units
# accumulate; the value says what opened it: True for recompute_unit, or a torch_remat region's
# flag, so that the rule follows the flag there as in eager.
UNIT_ANNOTATION_PREFIX = "sac_unit:"
_REGION_KEEPS = "torch_remat.region(recompute=False)"
_REGION_RECOMPUTES = "torch_remat.region(recompute=True)"


def annotated_units(custom: dict, regions: bool) -> tuple:
    """The units open around a traced node, outermost first, as the rule takes them, from its
    node.meta["custom"]: names, and with `regions`, a RegionOpening for each torch_remat region."""
    units = []
    for key, value in custom.items():
        if not key.startswith(UNIT_ANNOTATION_PREFIX):
            continue
        name = key[len(UNIT_ANNOTATION_PREFIX) :]
        if regions and value in (_REGION_KEEPS, _REGION_RECOMPUTES):
            units.append(_rule.RegionOpening(name, value == _REGION_RECOMPUTES))
        else:
            units.append(name)
    return tuple(units)


class _UnitScope:
    """Eager: opens the unit on this thread's C++ unit stack (units nest).

    One scope object may be entered more than once (recursion, or on several threads), so it
    remembers each opening as (thread, depth, observer tokens). An exit is checked before anything changes: from
    a thread that did not enter it, or out of order, it is refused and the opening stays, so
    the unit can still be closed correctly afterwards.
    """

    __slots__ = ("_name", "_id", "_openings")

    def __init__(self, name: str, unit_id: int | None = None):
        self._name = name
        self._id = _unit_id(name) if unit_id is None else unit_id
        self._openings: list[tuple[int, int]] = []

    def __enter__(self):
        depth = _scopes.unit_push(self._id)
        # Diagnostics that watch units (reports, the unit checks) see each opening.
        watching = _observers.observers()
        tokens = tuple((o, o.unit_entered(self._name)) for o in watching) if watching else ()
        self._openings.append((threading.get_ident(), depth, tokens))
        return self

    def __exit__(self, *exc_info):
        thread = threading.get_ident()
        index = next((i for i in range(len(self._openings) - 1, -1, -1) if self._openings[i][0] == thread), None)
        if index is None:
            where = "it is open on another thread" if self._openings else "it is not open"
            raise RuntimeError(
                f"sac_plugin: exiting recompute unit {self._name!r} on a thread that did not enter it ({where}); "
                "exit it on the thread that entered it; nothing was changed"
            )
        _, depth, tokens = self._openings[index]
        _scopes.unit_pop(self._id, depth)  # refuses misnesting, changing nothing
        del self._openings[index]
        for observer, token in tokens:
            observer.unit_exited(self._name, token)
        return False


@functools.lru_cache(maxsize=4096)
def _unit_id(name: str) -> int:
    # Interned in C++ once per name (units are a small vocabulary, capped there); a scope then
    # opens and closes its unit by id through sac_plugin._C (NOTE: [One extension module]).
    return _scopes.unit_id(name)


def recompute_unit(name: str):
    """Context manager: ops run inside are part of unit `name` (units nest).

    ```python
    with recompute_unit("attn"):
        out = attention(q, k, v)
    ```

    Eager code opens the unit in C++; inside torch.compile the unit becomes node metadata that
    the compiled region's selection honours.

    Args:
        name: The unit, as policies name it ("attn", or any non-empty name).

    Returns:
        A context manager that opens the unit on entry and closes it on exit.

    Raises:
        TypeError: `name` is not a str.
        ValueError: `name` is empty or not a valid unit name.
    """
    check_unit_name(name, "recompute_unit: name")
    if torch.compiler.is_compiling():
        return torch.fx.traceback.annotate({UNIT_ANNOTATION_PREFIX + name: True})
    return _UnitScope(name)


def in_recompute_unit(name: str, fn=None):
    """Runs a callable inside unit `name`: a decorator, or `in_recompute_unit(name, fn)`.

    Args:
        name: The unit, as policies name it.
        fn: The callable to wrap; None returns a decorator instead.

    Returns:
        `fn` wrapped so that each call runs inside the unit, or, without `fn`, a decorator that
            wraps its function so.

    Raises:
        TypeError: `name` is not a str, or what is wrapped is not callable.
        ValueError: `name` is empty or not a valid unit name.
    """
    check_unit_name(name, "in_recompute_unit: name")
    _unit_checks.declare(name)

    def decorate(function):
        if not callable(function):
            raise TypeError(f"sac_plugin: in_recompute_unit: fn must be callable, got {describe_value(function)}")

        @functools.wraps(function)
        def run_in_unit(*args, **kwargs):
            with recompute_unit(name):
                return function(*args, **kwargs)

        run_in_unit.__sac_unit__ = name
        return run_in_unit

    return decorate if fn is None else decorate(fn)


def open_units() -> list[str]:
    """The units open on this thread, outermost first.

    Returns:
        The names of the open units.
    """
    return list(_native.C.open_units())


# NOTE: [torch_remat regions are recompute units]
# torch_remat annotates model code with `torch_remat.region(fn, name, recompute=...)`. Inside its
# own checkpoint a region is handled by torch_remat; outside one, its wrapper just calls `fn`, and
# torch_remat offers no hook there (its phase state is None, nothing is traced or named). So
# sac_plugin replaces `region` on the torch_remat module (and on torch_remat._api, where the
# package's own code finds it) with a function that asks torch_remat for its wrapper first (the
# same validation) and, when no torch_remat checkpoint is active, runs the call inside a unit named
# as torch_remat names the region (with its name_scope prefixes); under torch.compile, outside
# torch_remat's compiled checkpoint, the unit is node metadata carrying the flag
# (_compiled_region_call), decided by the same rule.
# The unit is a region opening (NOTE: [Region openings carry their flag] in
# csrc/policy/unit_stack.h): a policy that names it decides, otherwise its recompute= flag does
# (csrc/policy/policy.h, innermostSelectingUnit). Installed once both this module and torch_remat
# are imported (at once if torch_remat already was, else when it is); uninstall_remat_regions()
# puts torch_remat's function back. Model code that bound `region` itself (`from torch_remat
# import region`) before sac_plugin was imported keeps torch_remat's function.
_remat_original = None
_remat_local = threading.local()


def _remat_modules():
    import torch_remat
    import torch_remat._api

    return (torch_remat, torch_remat._api)


def _region_flags() -> list:
    flags = getattr(_remat_local, "flags", None)
    if flags is None:
        flags = _remat_local.flags = []
    return flags


def _open_region(name: str, recompute: bool, call):
    from torch_remat._region import _qualified_name

    qualified = _qualified_name(name)
    flags = _region_flags()
    # torch_remat's nesting rule: a recompute=False region skips its whole body in the replay, so
    # a recompute=True region inside it cannot be honoured. Raised as torch_remat raises it, so an
    # annotated model fails the same way under either checkpoint.
    if recompute and flags and not flags[-1]:
        raise RuntimeError(
            f"remat.region {qualified!r} was called with recompute=True while nested inside a recompute=False "
            "(SAVE) region. The enclosing SAVE region is never recomputed, so the inner recompute cannot be "
            "honored. Set the inner region to recompute=False, or make the enclosing region recompute=True."
        )
    check_unit_name(qualified, "torch_remat.region: name")
    opening = _rule.region_opening(_unit_id(qualified), recompute)
    flags.append(recompute)
    try:
        with _UnitScope(qualified, opening):
            return call()
    finally:
        flags.pop()


def _compiled_region_call(function, name, recompute, wrapper, args, kwargs):
    # Under torch.compile a region outside torch_remat's own compiled checkpoint is a unit carried
    # as node metadata with its flag, as recompute_unit carries one, so that the checkpointed
    # layer's policy function decides it as eager does. torch_remat ignores name_scope under
    # compile, so the unit is the region's own name.
    from torch_remat._compile import in_compiled_checkpoint

    if in_compiled_checkpoint():
        return wrapper(*args, **kwargs)  # torch_remat's own compiled checkpoint tags it
    flag = _REGION_RECOMPUTES if recompute else _REGION_KEEPS
    with torch.fx.traceback.annotate({UNIT_ANNOTATION_PREFIX + name: flag}):
        return function(*args, **kwargs)


def _sac_region(function, name, *, recompute):
    wrapper = _remat_original(function, name, recompute=recompute)
    if torch.compiler.is_compiling():

        def run_compiled(*args, **kwargs):
            return _compiled_region_call(function, name, recompute, wrapper, args, kwargs)

        return run_compiled
    from torch_remat._region import _state

    @functools.wraps(function)
    def run_in_region(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _compiled_region_call(function, name, recompute, wrapper, args, kwargs)
        if _state.get() is not None:
            return wrapper(*args, **kwargs)  # torch_remat's own checkpoint handles it
        return _open_region(name, recompute, lambda: function(*args, **kwargs))

    return run_in_region


def install_remat_regions() -> bool:
    """Makes torch_remat.region open a recompute unit (NOTE: [torch_remat regions are recompute
    units]); importing sac_plugin does this, and installing twice changes nothing.

    Returns:
        Whether torch_remat is installed and could be hooked.
    """
    global _remat_original
    if importlib.util.find_spec("torch_remat") is None:
        return False
    try:
        modules = _remat_modules()
    except ImportError:  # a torch_remat that cannot load with this torch: nothing to hook
        return False
    if _remat_original is None:
        _remat_original = modules[1].region
        for module in modules:
            module.region = _sac_region
    return True


def uninstall_remat_regions() -> None:
    """Puts torch_remat's own region function back."""
    global _remat_original
    if _remat_original is None:
        return
    for module in _remat_modules():
        if module.region is _sac_region:
            module.region = _remat_original
    _remat_original = None


# Importing torch_remat costs a second (it imports torch.distributed.tensor and sympy): it is
# hooked when it is imported, or now where it already was, never imported for the hook.
class _HookWhenImported(importlib.abc.MetaPathFinder):
    """Installs the hook once torch_remat has been imported (by the model code, or anyone)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch_remat":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _InstallingLoader(spec.loader)
        return spec


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _HookWhenImported)]
        install_remat_regions()


if "torch_remat" in sys.modules:
    install_remat_regions()
elif importlib.util.find_spec("torch_remat") is not None:
    sys.meta_path.insert(0, _HookWhenImported())
