"""The seam into torch.utils.checkpoint: context functions and the module wrapper."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.fx.traceback as fx_traceback

from . import _compat, _dispatch_mode, _engine, _mode_calls, _observers, _rule, _unit_checks
from . import _mode_recompute  # noqa: F401 - sets the hook a native recompute under dispatch modes runs through
from ._site import Site
from ._call_facts import casts_a_parameter, draws_random, op_traits
from ._save_watch import SaveWatch
from ._forwards import CheckpointedForward, installed_anything, remove_installed
from ._logging import logger
from ._validation import describe_value
from .policy import Policy
from .units import annotated_units

__all__ = ["Region", "apply_selective_checkpointing", "context_fn", "remove_checkpointing", "torch_policy_fn"]


class Region:
    """One call of checkpoint(fn, ...): its kept outputs, and its forward and recompute scopes.

    Made from a policy (a checkpoint site of its own) or from the site it shares with other
    regions (NOTE: [What a site learns]).

    Args:
        policy: What the region keeps and offloads: a `Policy`, which makes a checkpoint site of
            its own, or the site the region shares with the other regions of one context function.

    Raises:
        TypeError: `policy` is neither.
    """

    __slots__ = ("_site", "forward", "recompute")

    def __init__(self, policy: Policy | Site):
        if isinstance(policy, Policy):
            policy = Site(policy)
        elif not isinstance(policy, Site):
            raise TypeError(f"sac_plugin: Region: policy must be a sac_plugin.Policy, got {describe_value(policy)}")
        self._site = policy
        self.forward, self.recompute = policy.native.new_region_scopes()

    @property
    def handle(self):
        """The region as the extension module has it (a _C.Region: kept_bytes, kept_calls, ...)."""
        return self.forward.region

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors the region holds for backward.

        Returns:
            The kept outputs held on the device (or CPU), one tensor per kept output.
        """
        return torch.ops.sac.region_kept_tensors(self.forward.region.handle)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the unique device (or CPU) storages the region holds for backward."""
        return self.handle.kept_bytes()

    @property
    def kept_calls(self) -> int:
        """Calls whose outputs the region holds, kept or offloaded."""
        return self.handle.kept_calls()

    @property
    def offloaded_bytes(self) -> int:
        """Pinned host bytes the region's offloaded outputs hold (not in kept_bytes)."""
        return self.handle.offloaded_bytes()

    @property
    def offloaded_calls(self) -> int:
        """Calls whose outputs the region holds in pinned host memory (counted in kept_calls too)."""
        return self.handle.offloaded_calls()


def torch_policy_fn(policy: Policy):
    """The same selection as a policy function for torch's SAC, and so for torch.compile, whose
    partitioner honours MUST_SAVE. Call it once per region: every-nth rules count per region.

    Each call is decided by the one C++ rule (docs/semantics.md) through sac_plugin._C, with
    the facts torch's policy function sees: the op, the pass, the units open (node metadata:
    recompute_unit under torch.compile annotates nodes; eager torch's SAC has none, so there only
    op and call rules apply), whether the call draws random numbers or casts a parameter.
    Recompute decisions the invariants force (collectives, recomputed units) are MUST_RECOMPUTE;
    torch's partitioner may still save _c10d_functional outputs on its own
    (force_save_collectives), which is the compiler's call.

    Args:
        policy: The selection to apply.

    Returns:
        A policy function `(ctx, op, *args, **kwargs) -> CheckpointPolicy`, to pass to
            `torch.utils.checkpoint.create_selective_checkpoint_contexts`.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    decider = _rule.CallDecider(policy)
    # A torch_remat region keeps or recomputes by its flag when no list names it; a full-recompute
    # policy recomputes every call in eager, regions included, so there regions are plain units.
    regions = not policy.keeps_nothing
    watches_units = regions or bool(policy.recomputed_units)
    forced = (_rule.Reason.COLLECTIVE, _rule.Reason.INSIDE_RECOMPUTED_UNIT)

    def decide(ctx, op, *args, **kwargs):
        units = ()
        if watches_units:
            units = annotated_units(fx_traceback.current_meta.get("custom", {}), regions)
        traits = op_traits(op)
        decision = decider.decide(
            op, ctx.is_recompute, units, draws_random(traits, args, kwargs), casts_a_parameter(traits, args)
        )
        if decision.outcome == _rule.Outcome.KEEP:
            return CheckpointPolicy.MUST_SAVE
        if decision.outcome == _rule.Outcome.OFFLOAD:
            return _offload_tag(args)
        return CheckpointPolicy.MUST_RECOMPUTE if decision.reason in forced else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


# NOTE: [Offloaded calls under torch.compile]
# torch's partitioner offloads a MUST_CPU_OFFLOAD output (copy to the host after the forward,
# back before the backward) only when torch._functorch.config.enable_activation_offloading is on,
# and torch's eager SAC recomputes such a call. So an offloaded call is tagged MUST_CPU_OFFLOAD
# where the compiler offloads, and MUST_SAVE (kept on the device, said once) everywhere else.
_told_offload_is_keep = False


def _offload_tag(args):
    from torch._guards import detect_fake_mode
    from torch.utils.checkpoint import CheckpointPolicy

    global _told_offload_is_keep
    # The partitioner's policy calls trace fake tensors (torch 2.11 does not report that as
    # compiling there); torch's eager checkpoint passes real ones.
    compiling = torch.compiler.is_compiling() or detect_fake_mode(args) is not None
    import torch._functorch.config as functorch_config

    if compiling and getattr(functorch_config, "enable_activation_offloading", False):
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    if not _told_offload_is_keep:
        _told_offload_is_keep = True
        where = (
            "torch.compile offloads only with torch._functorch.config.enable_activation_offloading = True"
            if compiling
            else "torch's eager checkpoint does not offload"
        )
        logger.warning("sac_plugin: offloaded calls are kept on the device here (MUST_SAVE): %s", where)
    return CheckpointPolicy.MUST_SAVE


def _compiled_contexts(policy: Policy):
    # Under torch.compile the contexts must be TorchDispatchModes that tag traced nodes; the
    # partitioner honours MUST_SAVE, so kept ops are saved in the compiled graph as in eager.
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(torch_policy_fn(policy))


_NO_CONTEXTS = (contextlib.nullcontext(), contextlib.nullcontext())
_dispatch_modes_on = torch._C._len_torch_dispatch_stack
# A region that keeps nothing intercepts nothing: in the dispatch-mode engine it only labels the
# forward and the recompute for audits and re-opens the units around the forward.
_PHASE_MARKER_SITE = Site(Policy(), marks_passes=True)


# NOTE: [A value is served from the level it was kept at]
# The native engine keeps a call's outputs below every TorchDispatchMode (its key sits under
# `Python`), the dispatch-mode engine above the modes that are on. A mode that changes values (fake
# quantization, a cast, rounding) makes the two differ: below it, the kept value is the kernel's;
# above it, the value the model saw. A kept value must be served where it was kept, or the mode
# sees different values in the recompute than in the forward and the gradients are silently wrong.
# So a region whose forward begins while another dispatch mode is on (not only the plugin's own
# per-op trace) runs, for that step, in the dispatch-mode engine: its calls are kept above the
# modes, and its recompute is served above them, whatever modes the backward runs under. A forward
# with no other mode on keeps below (the native hot path); if modes are on by the recompute (a mode
# entered for the backward only), the recompute runs above them (NOTE: [Modes above the key see
# only what ran] in _mode_recompute.py), serving values no mode changed in the forward.
def _selective_contexts(site: Site):
    # The hot path, tested cheapest first: a native region with no dispatch mode on, nothing
    # observing and nothing left to watch at its site is the branch marked "the hot path" below,
    # reached without the other tests. No dispatch mode on means no compilation either: Dynamo
    # never calls a context_fn, and AOTAutograd and export call it under their PROXY or fake mode
    # (NOTE: [context_fn under AOTAutograd on torch 2.11] in _compat.py). The observers and the
    # engine are read as module globals (why: _observers.py).
    if (
        not site.reach_unknown
        and not site.watches_saves
        and not site.unchecked_units
        and not site.keeps_nothing
        and not _dispatch_modes_on()
        and not _observers.registered
        and _engine.chosen == "native"
    ):
        return site.native.new_region_scopes()
    policy = site.policy
    if _compat.is_compiling():
        return _compiled_contexts(policy)
    observing = _observers.observing()
    if (
        policy.keeps_nothing
        and not policy.offload_inputs
        and not observing
        and (_dispatch_modes_on() or not site.outside_writes_possible())
    ):
        # Plain full recompute: nothing to intercept, nothing observing (an audit that wants its
        # recompute labelled as such, a report), no inputs to hold and nothing written outside the
        # region (NOTE: [The recompute writes nothing outside its region] in
        # csrc/dispatch/outside_writes.cpp), or a forward under a dispatch mode (compilation's
        # tracing, a user's mode), which does not find that out: no plugin state at all.
        return _NO_CONTEXTS
    if _engine.engine() == "dispatch_mode" or _mode_calls.foreign_modes_on():
        region = Region(_PHASE_MARKER_SITE)
        plan: dict = {}
        forward, recompute, mode_region = _dispatch_mode.dispatch_mode_contexts(site, region, plan)
        position, release_unreached = mode_region.forward_position, mode_region.release_unreached
        # The dispatch-mode engine runs every recompute call (docs/limits.md).
        watched_region = None

        def kept_calls():
            return sum(sum(kept) for kept in plan.values())
    elif not (observing or site.unchecked_units or site.reach_unknown or site.watches_saves):
        # The hot path: one C call makes the region, the scopes enter and exit it through C calls
        # (NOTE: [Scopes as a C type]).
        return site.native.new_region_scopes()
    else:
        region = Region(site)
        for observer in _observers.observers():
            observer.region_created(region)
        forward, recompute = region.forward, region.recompute
        watched_region = region.forward.region
        position, release_unreached = watched_region.forward_position, watched_region.release_unreached

        def kept_calls():
            return region.kept_calls

    if site.reach_unknown or (site.watches_saves and watched_region is not None):
        forward = SaveWatch(site, forward, position, release_unreached, watched_region)
    if site.unchecked_units:
        forward = _unit_checks.WatchedForward(site, forward, kept_calls)
    for observer in _observers.observers():
        forward, recompute = observer.wrap_passes(region, policy, forward, recompute, kept_calls)
    return forward, recompute


def context_fn(policy: Policy | None = None, *, name: str = ""):
    """A `context_fn` for checkpoint(fn, ..., use_reentrant=False, context_fn=context_fn(policy)).

    Each one is a checkpoint site of its own: the regions it makes learn together what the
    recompute reaches, so give each layer its own (apply_selective_checkpointing does). `name`
    is what error messages call the checkpointed code (the layer, "LlamaDecoderLayer"); without
    one they say "a checkpointed region".

    Args:
        policy: What the regions keep and offload; None keeps nothing (full recompute).
        name: What error messages call the checkpointed code.

    Returns:
        A function of no arguments that returns the forward and recompute contexts of one
            region, as `torch.utils.checkpoint.checkpoint`'s `context_fn` expects.

    Raises:
        TypeError: `policy` is not a Policy or None, or `name` is not a str.
    """
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            f"sac_plugin: context_fn: policy must be a sac_plugin.Policy or None, got {describe_value(policy)}"
        )
    if not isinstance(name, str):
        raise TypeError(f"sac_plugin: context_fn: name must be a str, got {describe_value(name)}")
    policy = Policy() if policy is None else policy
    # One checkpoint site per context function (NOTE: [What a site learns]).
    return functools.partial(_selective_contexts, Site(policy, name))


def apply_selective_checkpointing(
    module: torch.nn.Module, policy: Policy | None = None, *, preserve_rng_state: bool = True, early_stop: bool = True
) -> torch.nn.Module:
    """Checkpoints `module`'s forward with `policy`, in place, and returns the module.

    Parameter names and state_dict keys are unchanged. With no policy (or one that keeps
    nothing) this is plain full recompute through the same mechanism, with no interception.
    The module stays checkpointed through pickle, torch.save/torch.load and copy.deepcopy.
    preserve_rng_state and early_stop are torch.utils.checkpoint's: early_stop=False runs the
    whole recompute rather than stopping once the last tensor saved for backward is recomputed.

    Args:
        module: The module whose forward is checkpointed.
        policy: What the forward keeps and offloads; None keeps nothing (full recompute).
        preserve_rng_state: Whether the recompute replays the forward's random number state.
        early_stop: Whether the recompute stops once it has recomputed the last tensor the
            backward needs.

    Returns:
        `module`, checkpointed.

    Raises:
        TypeError: `module` is not an eager `torch.nn.Module`, or an argument has the wrong type.
        ValueError: `module` is already selectively checkpointed, or checkpointing it would
            checkpoint a module twice: it holds a checkpointed module (sac_plugin's, or torch's
            CheckpointWrapper), is a CheckpointWrapper, or is inside a module sac_plugin checkpoints.
    """
    # Everything is checked before the module is touched: a refused call leaves it as it was,
    # so a corrected retry works.
    check_checkpointable(module, "apply_selective_checkpointing: module")
    check_not_nested(module)
    if policy is not None and not isinstance(policy, Policy):
        hint = f"; for a unit write Policy(kept_units=[{policy!r}])" if isinstance(policy, str) and policy else ""
        raise TypeError(
            "sac_plugin: apply_selective_checkpointing: policy must be a sac_plugin.Policy or None, got "
            f"{describe_value(policy)}{hint}"
        )
    for name, value in (("preserve_rng_state", preserve_rng_state), ("early_stop", early_stop)):
        if not isinstance(value, bool):
            raise TypeError(
                f"sac_plugin: apply_selective_checkpointing: {name} must be True or False, got {describe_value(value)}"
            )
    policy = Policy() if policy is None else policy
    context = context_fn(policy, name=type(module).__name__)
    logger.debug(
        "checkpointing %s with %s", type(module).__name__, "full recompute" if policy.keeps_nothing else policy
    )
    module._sac_policy = policy
    module._sac_context_fn = context
    mark_descendants(module)
    module._sac_preserve_rng_state = preserve_rng_state
    if not early_stop:
        module._sac_early_stop = False
    CheckpointedForward.install(module)
    return module


def check_checkpointable(module, where: str) -> None:
    """Raises unless apply_selective_checkpointing can checkpoint `module`; changes nothing."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sac_plugin: {where} must be a torch.nn.Module, got {describe_value(module)}")
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"sac_plugin: {where} is a TorchScript module ({type(module).__name__}), whose forward cannot be "
            "checkpointed; apply sac_plugin to the eager module"
        )
    if "_sac_policy" in module.__dict__:
        raise ValueError(
            f"sac_plugin: {type(module).__name__} is already selectively checkpointed with {module._sac_policy}; "
            "apply_selective_checkpointing once per module"
        )


# NOTE: [A module is checkpointed once]
# A module inside a checkpointed module (or around one) would be checkpointed twice: the outer
# recompute runs the inner checkpoint's forward again, and the inner region holds what it keeps
# for a backward the outer's recompute serves anew, so its bytes are held with no hits. So
# sac_plugin refuses to checkpoint a module that has a checkpointed descendant (sac_plugin's, or
# torch's CheckpointWrapper), that is a CheckpointWrapper itself, or that lies inside a module
# sac_plugin checkpointed. A module cannot name its parents, so checkpointing one marks each
# descendant with a weak reference to it (`_sac_inside_checkpointed`); a marker counts only while
# that ancestor is still checkpointed and still holds the module at the marked path, so a marker
# left by a removed or replaced ancestor, or copied with a lone submodule, refuses nothing.
# torch's checkpoint (or checkpoint_wrapper) called around a checkpointed module at run time is
# nesting torch supports, and sac_plugin serves both regions there (docs/semantics.md).
_INSIDE = "_sac_inside_checkpointed"


class _InsideCheckpointed:
    """The marker on a descendant of a checkpointed module: that module (weakly, as the forwards
    refer to theirs) and the descendant's path in it."""

    __slots__ = ("_ancestor", "path")

    def __init__(self, ancestor: torch.nn.Module | None = None, path: str = ""):
        self._ancestor = None if ancestor is None else weakref.ref(ancestor)
        self.path = path

    def ancestor_of(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The checkpointed ancestor, if it still is one and still holds `module` at the path."""
        ancestor = None if self._ancestor is None else self._ancestor()
        if ancestor is None or "_sac_policy" not in ancestor.__dict__:
            return None
        try:
            found = ancestor.get_submodule(self.path)
        except AttributeError:
            return None
        return ancestor if found is module else None

    def __reduce__(self):
        ancestor = None if self._ancestor is None else self._ancestor()
        return (_InsideCheckpointed, (ancestor, self.path))

    def __deepcopy__(self, memo):
        # The copy refers to the ancestor's copy when the ancestor is copied too; a submodule
        # copied alone keeps the original, which does not hold the copy, so it refuses nothing.
        ancestor = None if self._ancestor is None else self._ancestor()
        return _InsideCheckpointed(memo.get(id(ancestor), ancestor) if ancestor is not None else None, self.path)


def mark_descendants(module: torch.nn.Module) -> None:
    """Marks each descendant of `module` as inside it (NOTE: [A module is checkpointed once]). The
    marks count once `module` is checkpointed (has `_sac_policy`), so an integration that
    checkpoints a layer its own way marks it first."""
    for path, submodule in module.named_modules():
        if submodule is not module:
            submodule.__dict__[_INSIDE] = _InsideCheckpointed(module, path)


def _is_torch_checkpoint_wrapper(module: torch.nn.Module) -> bool:
    # By name, not isinstance: importing torch.distributed to check is not worth its time, and
    # torch's OffloadWrapper (the same base class) offloads without checkpointing.
    return type(module).__name__ == "CheckpointWrapper" and "_checkpoint_wrapped_module" in module._modules


def _named(module: torch.nn.Module, name: str | None) -> str:
    return f"{type(module).__name__} '{name}'" if name else type(module).__name__


def check_not_nested(module: torch.nn.Module, names: dict | None = None) -> None:
    """Raises a ValueError unless checkpointing `module` checkpoints nothing twice (NOTE: [A module
    is checkpointed once]); changes nothing. `names`: id(module) -> its qualified name in the model,
    where a model is known (for the message)."""
    names = names or {}
    what = _named(module, names.get(id(module)))
    fix = "checkpoint either the outer module or the layers inside it, not both"
    if _is_torch_checkpoint_wrapper(module):
        raise ValueError(
            f"sac_plugin: {what} is torch's CheckpointWrapper, which already checkpoints "
            f"{type(module._checkpoint_wrapped_module).__name__}; to checkpoint it with sac_plugin, pass "
            "context_fn=sac_plugin.context_fn(policy) to checkpoint_wrapper instead, or apply sac_plugin to the "
            "unwrapped module"
        )
    for path, submodule in module.named_modules():
        if submodule is module:
            continue
        inner = _named(submodule, names.get(id(submodule)) or path)
        if "_sac_policy" in submodule.__dict__:
            raise ValueError(
                f"sac_plugin: cannot checkpoint {what}: its submodule {inner} is already checkpointed by sac_plugin "
                f"(with {submodule._sac_policy}); {fix} (sac_plugin.remove_checkpointing(submodule) first to move "
                "the checkpoint out)"
            )
        if _is_torch_checkpoint_wrapper(submodule):
            raise ValueError(
                f"sac_plugin: cannot checkpoint {what}: its submodule {inner} is torch's CheckpointWrapper, which "
                f"already checkpoints {type(submodule._checkpoint_wrapped_module).__name__}; {fix} (to use "
                "sac_plugin's policy there, pass context_fn=sac_plugin.context_fn(policy) to checkpoint_wrapper)"
            )
    marker = module.__dict__.get(_INSIDE)
    ancestor = marker.ancestor_of(module) if isinstance(marker, _InsideCheckpointed) else None
    if ancestor is not None:
        outer = _named(ancestor, names.get(id(ancestor)))
        raise ValueError(
            f"sac_plugin: cannot checkpoint {what}: it is '{marker.path}' inside {outer}, which sac_plugin already "
            f"checkpoints (with {ancestor._sac_policy}); {fix} (sac_plugin.remove_checkpointing(outer module) "
            "first to checkpoint the inner one)"
        )


def remove_checkpointing(module: torch.nn.Module) -> torch.nn.Module:
    """Undoes everything sac_plugin installed on `module` and its submodules, and returns it.

    Checkpointed forwards, forwards and methods that a target map runs inside recompute units,
    and pending budget plans are removed; each module runs its class's own forward again. State
    dict keys never changed, so nothing else needs restoring. A module sac_plugin never touched
    is refused, so that a wrong object is noticed rather than silently accepted.

    Args:
        module: A module that sac_plugin checkpointed, or one with such submodules.

    Returns:
        `module`, as its classes define it.

    Raises:
        TypeError: `module` is not a `torch.nn.Module`.
        ValueError: sac_plugin installed nothing on `module` or its submodules.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"sac_plugin: remove_checkpointing: module must be a torch.nn.Module, got {describe_value(module)}"
        )
    if not installed_anything(module):
        raise ValueError(
            f"sac_plugin: remove_checkpointing: sac_plugin installed nothing on {type(module).__name__} or its "
            "submodules; there is nothing to remove"
        )
    changed = remove_installed(module)
    # Markers of an ancestor no longer checkpointed go too; those of one still checkpointed stay.
    for submodule in module.modules():
        marker = submodule.__dict__.get(_INSIDE)
        if isinstance(marker, _InsideCheckpointed) and marker.ancestor_of(submodule) is None:
            del submodule.__dict__[_INSIDE]
    logger.debug("removed sac_plugin from %d modules of %s", changed, type(module).__name__)
    return module
