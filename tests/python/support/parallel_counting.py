"""Collectives counted per phase (forward, recompute, backward), and one training run of a
parallelized model under each way of checkpointing it, for the parallelism tests
(test_parallelism.py).

NOTE: [Collectives counted per phase]
The counter reads the plugin's audit, which counts every op by the dispatcher's name whatever
checkpoints the code (the plugin's, torch's selective one, plain full recompute, or none): so the
same counter serves all four runs without a TorchDispatchMode of its own, which would move the
plugin onto its dispatch-mode engine. The audit's own phase columns know the plugin's recomputes
only (torch's recompute is "backward" to it), so the phases are taken here instead: the run says
when its forward and its backward start, and the function handed to checkpoint says when it runs
inside a backward, which is its recompute. Each phase is charged the audit's growth while it was
the current one.
"""

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import sac_plugin
from sac_plugin import Policy

__all__ = ["KEPT_OPS", "VARIANTS", "Checkpointer", "PhaseCounter", "phase", "train"]

# What the two selective variants keep: every matmul and the residual add.
KEPT_OPS = ("aten::mm", "aten::add")
_TORCH_KEPT_OPS = [torch.ops.aten.mm.default, torch.ops.aten.add.Tensor]

# The runs each case makes: the unmodified model (the reference), the plugin's selective
# checkpointing, torch's selective checkpointing with the same kept ops, and full recompute.
VARIANTS = ("reference", "plugin", "torch_sac", "full")

_COLLECTIVE_NAMESPACES = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::")
# Waiting on a functional collective's result, or wrapping it for autograd, moves no data.
_NOT_COUNTED = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")


class PhaseCounter:
    """Collective executions per phase, over one audit (NOTE: [Collectives counted per phase])."""

    def __init__(self, audit):
        self._audit = audit
        self._phase = None
        self._last = self._totals()
        self.counts = {"forward": {}, "recompute": {}, "backward": {}}

    def _totals(self):
        return {
            row.op: row.forward + row.recompute + row.backward
            for row in self._audit.rows()
            if row.op.startswith(_COLLECTIVE_NAMESPACES) and row.op not in _NOT_COUNTED
        }

    def switch(self, phase):
        """Charges the collectives since the last switch to the current phase; `phase` is next."""
        totals = self._totals()
        if self._phase is not None:
            charged = self.counts[self._phase]
            for op, total in totals.items():
                grown = total - self._last.get(op, 0)
                if grown:
                    charged[op] = charged.get(op, 0) + grown
        self._last, self._phase = totals, phase

    @property
    def phase(self):
        return self._phase

    def marked(self, function):
        """`function`, charging what it runs inside a backward (torch's recompute) to "recompute"."""

        @functools.wraps(function)
        def run(*args, **kwargs):
            if torch._C._current_graph_task_id() == -1:
                return function(*args, **kwargs)
            outer = self._phase
            self.switch("recompute")
            try:  # torch's early stop leaves the function by an exception
                return function(*args, **kwargs)
            finally:
                self.switch(outer)

        return run


class Checkpointer:
    """Checkpoints one block's function as the run's variant says; one checkpoint site per block."""

    def __init__(self, variant, counter):
        self.variant, self.counter = variant, counter

    def site(self, name):
        """A callable that runs a function checkpointed as site `name` (its own plugin site)."""
        if self.variant == "reference":
            return lambda function, *args: function(*args)
        if self.variant == "plugin":
            context = sac_plugin.context_fn(Policy(kept_ops=list(KEPT_OPS)), name=name)
        elif self.variant == "torch_sac":
            context = functools.partial(create_selective_checkpoint_contexts, _TORCH_KEPT_OPS)
        else:
            context = None
        options = {} if context is None else {"context_fn": context}
        counter = self.counter

        def run(function, *args):
            return checkpoint(counter.marked(function), *args, use_reentrant=False, **options)

        return run


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train(case, variant, steps=2):
    """Trains `case` (an object with build(checkpointer) -> model and step(model, step, counter) ->
    loss or None) for `steps` SGD steps; returns losses, local gradients, counts and plugin hits."""
    with sac_plugin.audit() as audit:
        counter = PhaseCounter(audit)
        torch.manual_seed(0)
        model = case.build(Checkpointer(variant, counter))
        parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(parameters, lr=0.1)
        losses, grads = [], []
        for step in range(steps):
            if step == steps - 1:  # the counts are the last step's: no first-step initialisation in them
                counter.counts = {name: {} for name in counter.counts}
            optimizer.zero_grad()
            loss = case.step(model, step, counter)
            counter.switch(None)
            if loss is not None:
                losses.append(loss.detach().clone())
            grads.append([_local(p.grad).clone() if p.grad is not None else None for p in parameters])
            optimizer.step()
    hits = sum(row.hits for row in audit.rows())
    return losses, grads, counter.counts, hits


@contextlib.contextmanager
def phase(counter, name):
    """Charges what runs inside to phase `name`."""
    counter.switch(name)
    try:
        yield
    finally:
        counter.switch(None)
