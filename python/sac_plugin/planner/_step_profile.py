"""Profiling a training step for its peak model: one run of the step with hooks on its layers
that close a window (_step_peaks.Window) at each layer's forward end and each layer's output
gradient, count each layer's calls, and keep host copies of the inputs of the first layer of each
kind; each run starts from the state plan_step was called in and may not change the parameters.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from .._forwards import _offloadable_input as offloadable_input
from ._apply import layer_signature
from ._profile import leaves_no_trace
from ._step_peaks import BACKWARD, FORWARD, HEAD, Window


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def copy_to(value, device):
    """A copy of each tensor argument on `device`, detached, with its requires_grad."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True).requires_grad_(value.requires_grad)
    return value


class StepWatch:
    """The hooks of the profiling step: they close a window (read the device's peak since the
    last one and reset it) at each layer's forward end and each layer's output gradient, count
    each layer's calls, and keep a host copy of the inputs of the first layer of each kind."""

    def __init__(self, layers, device, capture: bool = True):
        self.capture = capture
        self.layers = layers
        self.device = device
        self.order: list[int] = []  # indices into layers, in the order the forward called them
        self.calls = [0] * len(layers)
        self.grads: list[int] = []  # positions (in forward order) in the order their gradients came
        self.windows: list[Window] = []
        self.inputs: dict = {}  # signature -> host copies of (args, kwargs)
        self.signatures: list = [None] * len(layers)
        self.input_bytes = [0] * len(layers)
        self._handles = []

    def close(self, kind: str, layer: int | None) -> None:
        self.windows.append(Window(kind, layer, torch.accelerator.max_memory_allocated(self.device.index)))
        torch.accelerator.reset_peak_memory_stats(self.device.index)

    def __enter__(self):
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._before(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._after(index)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return False

    def _before(self, index):
        def hook(module, args, kwargs):
            self.calls[index] += 1
            if self.calls[index] > 1 or not self.capture:
                return None
            signature = layer_signature(module, args, kwargs)
            self.signatures[index] = signature
            if signature not in self.inputs:
                self.inputs[signature] = (
                    tuple(copy_to(a, "cpu") for a in args),
                    {k: copy_to(v, "cpu") for k, v in kwargs.items()},
                )
            # What Policy(offload_inputs=True) takes off the device: the positional inputs the
            # runtime offloads (the activation through the stack), each storage once.
            seen = set()
            for t in args:
                if offloadable_input(t) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    self.input_bytes[index] += t.untyped_storage().nbytes()
            return None

        return hook

    def _after(self, index):
        def hook(module, args, output):
            if self.calls[index] > 1:
                return None
            position = len(self.order)
            self.order.append(index)
            self.close(FORWARD, position)
            grads = [t for t in _tensors(output) if t.requires_grad]
            if grads:
                grads[0].register_hook(lambda grad: self._gradient(position))
            return None

        return hook

    def _gradient(self, position: int) -> None:
        if self.grads:
            self.close(BACKWARD, self.grads[-1])
        else:
            self.close(HEAD, None)
        self.grads.append(position)

    def finish(self, names) -> None:
        """Closes the last window and checks that the step is a stack the model describes."""
        if self.grads:
            self.close(BACKWARD, self.grads[-1])
        for index, calls in enumerate(self.calls):
            if calls != 1:
                raise ValueError(
                    f"sac_plugin: plan_step: the step called layer {names[index]!r} {calls} times; "
                    "plan_step plans a step that calls each layer once"
                )
        count = len(self.order)
        if self.grads != list(range(count - 1, -1, -1)):
            missing = [names[self.order[p]] for p in range(count) if p not in self.grads]
            if missing:
                raise ValueError(
                    f"sac_plugin: plan_step: the step's backward never reached the output of layer "
                    f"{missing[0]!r}; plan_step plans a step whose loss depends on every layer"
                )
            raise ValueError(
                "sac_plugin: plan_step: the step's backward did not run the layers in the reverse of "
                "their forward order, which the peak model assumes"
            )


def _no_trace(model: torch.nn.Module, device: torch.device):
    """Every run of the step starts from the state plan_step was called in: parameter gradients,
    buffers (kept on the host meanwhile: no device bytes) and the RNG streams are restored."""
    return leaves_no_trace(model, [device.index or 0] if device.type == "cuda" else [], buffers_on_host=True)


# Why a step may not change the parameters, as both refusals below say it.
_SAME_STATE = (
    "plan_step runs the step several times from the same state, so the step must run forward, loss and backward only"
)


def _parameters_named(names: list[str]) -> str:
    """The parameters as a message names them: 1 parameter (a), 5 parameters (a, b, c and 2 more)."""
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''} ({listed})"


@contextlib.contextmanager
def _parameters_unchanged(model: torch.nn.Module):
    """The step runs several times from the same state, so it must not change the parameters: an
    optimizer's step on this thread is refused before it changes anything (the parameters and the
    optimizer's state stay as they were), and any other in-place change of a parameter (its
    version counter moved) is refused by name after the step."""
    names = {id(p): name for name, p in model.named_parameters()}
    versions = [(name, p, p._version) for name, p in model.named_parameters()]
    thread = threading.get_ident()

    def refuse(optimizer, args, kwargs):
        if threading.get_ident() != thread:
            return None
        ours = [names[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in names]
        if not ours:
            return None
        raise ValueError(
            f"sac_plugin: plan_step: the step calls {type(optimizer).__name__}.step(), which would change "
            f"{_parameters_named(ours)} and the optimizer's state; {_SAME_STATE}: call the optimizer after "
            "plan_step (refused before it ran: nothing was changed)"
        )

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()
    changed = [name for name, p, version in versions if p._version != version]
    if changed:
        raise ValueError(
            f"sac_plugin: plan_step: the step changed {_parameters_named(changed)} in place; {_SAME_STATE}, "
            "without changing the parameters (this change stays: plan_step keeps no copy of the parameters "
            "to undo it)"
        )


def run_step(step: Callable[[], object], model, layers, names, device, *, capture: bool) -> StepWatch:
    """One run of the step, window by window (the hooks allocate nothing on the device, so the
    largest window's peak is the step's)."""
    watch = StepWatch(layers, device, capture)
    with watch, _no_trace(model, device), _parameters_unchanged(model):
        torch.accelerator.synchronize(device)
        torch.accelerator.reset_peak_memory_stats(device.index)
        step()
        torch.accelerator.synchronize(device)
        watch.finish(names)
    return watch


__all__ = ["copy_to", "run_step"]
