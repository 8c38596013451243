"""Dispatch modes above the plugin see only the calls that ran (NOTE: [Modes above the key see only
what ran]).

torch's FlopCounterMode around forward and backward of a checkpointed model counts the forward, the
backward and the recompute calls that actually ran: exactly what it counts under torch's own
selective checkpointing with the same kept ops, and exactly the unmodified model's count when
every op with FLOPs is kept. The mode changes nothing else: gradients stay bitwise equal to the
unmodified model's, and the audit serves and runs the same calls as without the mode.
"""

import collections
import functools

import pytest
import sac_plugin
import torch
from sac_plugin.models import Llama
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

MM = "aten::mm"
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"
LAYERS = 2
# Per layer: q, k, v, o projections and three SwiGLU matmuls.
MM_PER_LAYER = 7


def _llama():
    torch.manual_seed(0)
    return Llama(vocab=64, dim=32, heads=2, layers=LAYERS, seq=16)


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 16), generator=generator), torch.randint(0, 64, (2, 16), generator=generator)


def _overload(name: str):
    namespace, _, op = name.partition("::")
    packet_name, _, overload = op.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload or "default")


def _with_torch_sac(model, kept: list[str]):
    """Each layer under torch's own selective checkpoint, saving the calls of `kept`."""
    saved = {_overload(name) for name in kept}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    for layer in model.layers:
        forward = layer.forward

        def checkpointed(*args, forward=forward):
            return checkpoint(
                forward,
                *args,
                use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
            )

        layer.forward = checkpointed
    return model


def _with_plugin(model, kept: list[str], early_stop: bool = True):
    for layer in model.layers:
        sac_plugin.apply_selective_checkpointing(layer, sac_plugin.Policy(kept_ops=kept), early_stop=early_stop)
    return model


def _flops_of_a_step(model) -> int:
    tokens, targets = _batch()
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, targets).backward()
    return counter.get_total_flops()


def _audited_step(model, mode=None):
    tokens, targets = _batch()
    with sac_plugin.audit() as audit:
        if mode is None:
            model.loss(tokens, targets).backward()
        else:
            with mode:
                model.loss(tokens, targets).backward()
    return _before_backward(audit)


def _before_backward(audit) -> dict:
    """{op: (forward, recompute, hits)}. Not the backward: autograd accumulates gradients out of
    place while a mode is on."""
    rows = {row.op: (row.forward, row.recompute, row.hits) for row in audit.rows()}
    return {op: counts for op, counts in rows.items() if any(counts)}


def _assert_same_gradients(model, reference):
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        assert ours.grad is not None, name
        assert torch.equal(ours.grad, theirs.grad), f"gradient of {name} differs"


def _every_op_of_a_layer() -> list[str]:
    model = _with_plugin(_llama(), [])
    tokens, _ = _batch()
    with sac_plugin.audit() as audit:
        model(tokens)
    # Uninitialised allocations (empty, empty_like) are refused by a policy: garbage until written.
    return sorted({row.op for row in audit.rows() if row.forward and not row.op.startswith("aten::empty")})


# On CPU the layers' ops with a FLOP formula are mm and, from torch 2.15, the CPU flash attention.
@pytest.mark.parametrize("kept", [[MM], [MM, ATTENTION], "everything"], ids=["mm", "mm and attention", "everything"])
def test_flop_counter_counts_what_torchs_sac_counts(kept):
    kept = _every_op_of_a_layer() if kept == "everything" else kept
    reference = _llama()
    plain = _flops_of_a_step(reference)
    ours_model = _with_plugin(_llama(), kept)
    ours = _flops_of_a_step(ours_model)
    assert ours == _flops_of_a_step(_with_torch_sac(_llama(), kept))
    if kept == [MM]:
        # From torch 2.15 the CPU flash attention has a FLOP formula too: run again, it counts.
        assert ours >= plain
    else:
        # Every op with FLOPs is kept: the recompute runs none, and the count is the unmodified model's.
        assert ours == plain
    _assert_same_gradients(ours_model, reference)


def _with_torch_sac_every_second_mm(model):
    """torch's SAC saving the mm calls 0, 2, 4, ... of each layer's forward (and so of its recompute)."""

    def contexts():
        calls = {False: 0, True: 0}

        def policy(ctx, op, *args, **kwargs):
            if op is not torch.ops.aten.mm.default:
                return CheckpointPolicy.PREFER_RECOMPUTE
            index = calls[ctx.is_recompute]
            calls[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if index % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    for layer in model.layers:
        forward = layer.forward

        def checkpointed(*args, forward=forward):
            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts)

        layer.forward = checkpointed
    return model


def test_flop_counter_counts_the_matmuls_that_ran_again():
    """Keeping every second matmul, the counter counts the recompute's other half, as under torch's
    own SAC: between the unmodified model and full recompute (which both count alike)."""
    plain = _flops_of_a_step(_llama())
    full = _flops_of_a_step(_with_plugin(_llama(), []))
    assert full == _flops_of_a_step(_with_torch_sac(_llama(), []))
    model = _llama()
    for layer in model.layers:
        sac_plugin.apply_selective_checkpointing(layer, sac_plugin.Policy(every_nth_op={MM: 2}))
    half = _flops_of_a_step(model)
    assert half == _flops_of_a_step(_with_torch_sac_every_second_mm(_llama()))
    assert plain < half < full


class _CallCounter(TorchDispatchMode):
    """Counts the calls that reach it, by op, named as audits name them ("aten::mm",
    "aten::add.Tensor")."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func._name] += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_changes_neither_what_is_served_nor_what_runs():
    """Under a mode the recompute names its calls as the forward did: the same calls are served
    (exact hits) and the same run, the mode sees the recompute calls that ran, and gradients stay
    bitwise equal."""
    kept = [MM, ATTENTION]
    reference = _llama()
    unmodified = _CallCounter()
    _audited_step(reference, unmodified)
    without = _audited_step(_with_plugin(_llama(), kept, early_stop=False))
    counter = _CallCounter()
    model = _with_plugin(_llama(), kept, early_stop=False)
    under = _audited_step(model, counter)
    assert under == without
    assert under["aten::mm"][1:] == (0, LAYERS * MM_PER_LAYER)  # every matmul of the layers served
    assert under[ATTENTION][1:] == (0, LAYERS)
    # The mode saw no recompute matmul or attention: as many as around the unmodified model.
    assert counter.calls[ATTENTION] == unmodified.calls[ATTENTION] == LAYERS
    assert counter.calls["aten::mm"] == unmodified.calls["aten::mm"]
    _assert_same_gradients(model, reference)


def _unusual_arguments(x, w):
    """Calls whose non-tensor arguments take every form the fallback's stack holds: wrapped
    numbers, ints, floats, bools, dtypes, memory formats, int lists (one empty), None, out=."""
    y = torch.mm(x, w) * 0.5 + 1
    y = y.to(torch.float64).to(torch.float32)
    y = y.clone(memory_format=torch.contiguous_format)
    y = y.pow(2).sum(dim=[1], keepdim=True) + y.sum(dim=[]) + y
    y = torch.cat([y, y.flip([0])], dim=1).narrow(1, 0, y.shape[1])
    buffer = torch.empty_like(y)
    torch.sin(y.detach(), out=buffer)
    return torch.mm(buffer * y, w).mean()


class _Unusual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(2)))

    def forward(self, x):
        return _unusual_arguments(x, self.w)


def _kept_ops_of(module, x) -> list[str]:
    with sac_plugin.audit() as audit:
        module(x)
    # Uninitialised allocations (empty, empty_like) are refused by a policy: garbage until written.
    return sorted({row.op for row in audit.rows() if row.forward and not row.op.startswith("aten::empty")})


@pytest.mark.skipif(
    sac_plugin._compat.python_handlers_run_below_the_plugin(),
    reason="torch 2.11 decomposes one of these calls differently under a dispatch mode (two more "
    "aten::empty.memory_format in the forward), so the audits with and without a mode differ by those",
)
def test_every_kind_of_argument_names_the_call_as_the_forward_did():
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    reference = _Unusual()
    unmodified = _CallCounter()
    with unmodified:
        reference(x).backward()
    kept = _kept_ops_of(_Unusual(), x)
    runs = []
    counter = _CallCounter()
    for mode in (None, counter):
        model = sac_plugin.apply_selective_checkpointing(_Unusual(), sac_plugin.Policy(kept_ops=kept), early_stop=False)
        x.grad = None
        with sac_plugin.audit() as audit:
            if mode is None:
                model(x).backward()
            else:
                with mode:
                    model(x).backward()
        runs.append(_before_backward(audit))
        _assert_same_gradients(model, reference)
    without, under = runs
    assert under == without
    # Every kept call is served (the out= sin copies its kept value into the fresh buffer); only
    # the empty_like that makes that buffer runs again, and the loss's ones_like runs once.
    assert under == {
        **{op: (without[op][0], 0, without[op][0]) for op in kept},
        "aten::empty_like": (1, 1, 0),
        "aten::ones_like": (1, 0, 0),
    }
    # The mode saw each kept op as often as around the unmodified model: none in the recompute.
    assert {op: counter.calls[op] for op in kept} == {op: unmodified.calls[op] for op in kept}
    assert all(unmodified.calls[op] for op in kept)
    assert set(kept) >= {
        "aten::mm",
        "aten::mul.Tensor",
        "aten::add.Tensor",
        "aten::_to_copy",
        "aten::clone",
        "aten::pow.Tensor_Scalar",
        "aten::sum.dim_IntList",
        "aten::cat",
        "aten::flip",
        "aten::sin.out",
    }
