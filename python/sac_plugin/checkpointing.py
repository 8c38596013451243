"""The seam into torch.utils.checkpoint: context functions and the module wrapper."""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch.utils.checkpoint import checkpoint

from .audit import any_active as any_audit_active
from .policy import Policy, overload_of


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


def torch_policy_fn(policy: Policy):
    """The same selection as a policy function for torch's SAC (and so for torch.compile, whose
    partitioner honours MUST_SAVE). Call it once per region: every-nth rules count per region."""
    from torch.utils.checkpoint import CheckpointPolicy

    if policy.kept_units or policy.recomputed_units:
        units = sorted(policy.kept_units | policy.recomputed_units)
        raise RuntimeError(
            f"sac_plugin: units {units} cannot be expressed as a torch policy function (inside torch.compile "
            "they are not carried yet); keep their ops by name with Policy(kept_ops=...) instead"
        )
    kept = frozenset(policy.kept_overloads())
    every_nth = {overload_of(name): n for name, n in policy.every_nth_op.items()}
    calls: dict = {}

    def decide(ctx, op, *args, **kwargs):
        if op in kept:
            return CheckpointPolicy.MUST_SAVE
        n = every_nth.get(op)
        if n is not None:
            key = (ctx.is_recompute, op)
            index = calls.get(key, 0)
            calls[key] = index + 1
            if index % n == 0:
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
    if torch.compiler.is_compiling():
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
