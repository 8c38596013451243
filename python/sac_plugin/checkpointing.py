"""The seam into torch.utils.checkpoint: context functions and the module wrapper."""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import checkpoint

from . import _compat
from .audit import any_active as any_audit_active
from .policy import Policy, op_spelling, overload_of
from .units import UNIT_ANNOTATION_PREFIX


class _RegionScope:
    """One pass of a checkpointed region: enters and exits the C++ activation."""

    __slots__ = ("_enter", "_exit", "_depth")

    def __init__(self, enter, exit_):
        self._enter = enter
        self._exit = exit_
        self._depth = 0

    def __enter__(self):
        self._depth = self._enter()
        return self

    def __exit__(self, *exc_info):
        self._exit(self._depth)
        return False


class Region:
    """One call of checkpoint(fn, ...): its kept outputs, and its forward and recompute scopes."""

    __slots__ = ("handle", "forward", "recompute")

    def __init__(self, policy: Policy):
        self.handle = policy._handle.new_region()
        self.forward = _RegionScope(self.handle.enter_forward, self.handle.exit_forward)
        self.recompute = _RegionScope(self.handle.enter_recompute, self.handle.exit_recompute)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the unique storages the region holds for backward."""
        return self.handle.kept_bytes()

    @property
    def kept_calls(self) -> int:
        return self.handle.kept_calls()


# Regions created by _selective_contexts are reported here when a test or benchmark asks.
_region_observers: list = []


@functools.lru_cache(maxsize=None)
def _op_traits(op) -> tuple[bool, bool, bool, bool, bool, int]:
    """(collective, never counted, random, mutates an input, view, index of dropout_p or -1): the
    very traits the C++ fallback decides with, for the policy function torch calls."""
    return tuple(torch.ops.sac.op_traits(op_spelling(op)))


def _draws_random(random: bool, dropout_p: int, args, kwargs) -> bool:
    if not random:
        return False
    if dropout_p < 0:
        return True
    value = args[dropout_p] if dropout_p < len(args) else kwargs.get("dropout_p", 0.0)
    return not isinstance(value, (int, float)) or value != 0


def torch_policy_fn(policy: Policy):
    """The same selection as a policy function for torch's SAC, and so for torch.compile, whose
    partitioner honours MUST_SAVE. Call it once per region: every-nth rules count per region.

    Units come from node metadata (recompute_unit under torch.compile annotates nodes); eager
    torch's SAC has no such metadata, so there only kept_ops and every-nth rules apply.
    Collectives are MUST_RECOMPUTE, as the invariant says; torch's partitioner may still save
    _c10d_functional outputs on its own (force_save_collectives), which is the compiler's call.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    kept = frozenset(policy.kept_overloads())
    every_nth = {overload_of(name): n for name, n in policy.every_nth_op.items()}
    kept_units = frozenset(UNIT_ANNOTATION_PREFIX + unit for unit in policy.kept_units)
    recomputed_units = frozenset(UNIT_ANNOTATION_PREFIX + unit for unit in policy.recomputed_units)
    calls: dict = {}

    def decide(ctx, op, *args, **kwargs):
        collective, never, random, mutates, view, dropout_p = _op_traits(op)
        if collective:
            return CheckpointPolicy.MUST_RECOMPUTE
        if never:
            return CheckpointPolicy.PREFER_RECOMPUTE
        units = fx_traceback.current_meta.get("custom", {}).keys() if (kept_units or recomputed_units) else ()
        if recomputed_units and not recomputed_units.isdisjoint(units):
            return CheckpointPolicy.MUST_RECOMPUTE
        draws = _draws_random(random, dropout_p, args, kwargs)
        if op in kept:
            return CheckpointPolicy.PREFER_RECOMPUTE if draws else CheckpointPolicy.MUST_SAVE
        n = every_nth.get(op)
        if n is not None:
            key = (ctx.is_recompute, op)
            index = calls.get(key, 0)
            calls[key] = index + 1
            if index % n == 0 and not draws:
                return CheckpointPolicy.MUST_SAVE
        if kept_units and not kept_units.isdisjoint(units) and not (mutates or view or draws):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def _compiled_contexts(policy: Policy):
    # Under torch.compile the contexts must be TorchDispatchModes that tag traced nodes; the
    # partitioner honours MUST_SAVE, so kept ops are saved in the compiled graph as in eager.
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(torch_policy_fn(policy))


_NO_CONTEXTS = (contextlib.nullcontext(), contextlib.nullcontext())


def _selective_contexts(policy: Policy):
    if _compat.is_compiling():
        return _compiled_contexts(policy)
    if policy.keeps_nothing and not any_audit_active() and not _region_observers:
        # Plain full recompute: nothing to intercept, and no audit that wants its recompute
        # labelled as such, so no plugin state at all.
        return _NO_CONTEXTS
    region = Region(policy)
    for observe in _region_observers:
        observe(region)
    return region.forward, region.recompute


def context_fn(policy: Policy | None = None):
    """A `context_fn` for checkpoint(fn, ..., use_reentrant=False, context_fn=context_fn(policy))."""
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(f"sac_plugin: context_fn expects a sac_plugin.Policy, got {type(policy).__name__}")
    return functools.partial(_selective_contexts, policy)


def _checkpointed_forward(self, *args, **kwargs):
    return checkpoint(
        type(self).forward,
        self,
        *args,
        use_reentrant=False,
        context_fn=self._sac_context_fn,
        preserve_rng_state=self._sac_preserve_rng_state,
        **kwargs,
    )


def apply_selective_checkpointing(
    module: torch.nn.Module, policy: Policy | None = None, *, preserve_rng_state: bool = True
) -> torch.nn.Module:
    """Checkpoints `module`'s forward with `policy`, in place, and returns the module.

    Parameter names and state_dict keys are unchanged. With no policy (or one that keeps
    nothing) this is plain full recompute through the same mechanism, with no interception.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sac_plugin: apply_selective_checkpointing expects an nn.Module, got {type(module).__name__}")
    if "_sac_policy" in module.__dict__:
        raise ValueError(
            f"sac_plugin: {type(module).__name__} is already selectively checkpointed with {module._sac_policy}; "
            "apply_selective_checkpointing once per module"
        )
    policy = Policy() if policy is None else policy
    module._sac_policy = policy
    module._sac_context_fn = context_fn(policy)
    module._sac_preserve_rng_state = preserve_rng_state
    module.forward = types.MethodType(_checkpointed_forward, module)
    return module
