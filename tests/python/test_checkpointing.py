"""Checkpointing a module or a function: apply_selective_checkpointing refuses bad input and a
second application before changing anything; a checkpointed module survives torch.save, pickle and
deepcopy, and TorchScript says what to do instead; a Region's forward is entered once, on one
thread, and restores the key set when dropped; torch_policy_fn, the policy function for torch's
SAC (and so torch.compile), makes the fallback's decisions."""

import copy
import gc
import io
import pickle

import pytest
import sac_plugin
import torch
from sac_plugin import Policy, apply_selective_checkpointing, audit
from sac_plugin.checkpointing import Region, torch_policy_fn
from thread_checks import on_another_thread, sac_key_included
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy
from toy_models import assert_same_gradients, make_pair, run_step


def test_applying_twice_is_refused():
    model, _ = make_pair(policy=Policy(kept_units=["attn"]))
    with pytest.raises(ValueError, match="already selectively checkpointed"):
        sac_plugin.apply_selective_checkpointing(model.layers[0], Policy())


def test_a_refused_apply_leaves_the_module_untouched_and_a_retry_works():
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # tanh saves its output: addmm is recomputed
    with pytest.raises(TypeError) as error:
        apply_selective_checkpointing(layer, "attn")
    assert str(error.value) == (
        "sac_plugin: apply_selective_checkpointing: policy must be a sac_plugin.Policy or None, got 'attn' (str); "
        "for a unit write Policy(kept_units=['attn'])"
    )
    with pytest.raises(TypeError):
        apply_selective_checkpointing(layer, preserve_rng_state=1)
    assert not {"_sac_policy", "_sac_context_fn", "forward"} & set(layer.__dict__)
    apply_selective_checkpointing(layer, Policy(kept_ops=["aten::addmm"]))
    with audit() as a:
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert a.hits("aten::addmm") == 1


def _round_trips(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    yield "torch.save", torch.load(buffer, weights_only=False)
    yield "pickle", pickle.loads(pickle.dumps(model))
    yield "deepcopy", copy.deepcopy(model)


@pytest.mark.parametrize("way", ["torch.save", "pickle", "deepcopy"])
def test_a_checkpointed_module_round_trips_and_stays_checkpointed(way):
    model, reference = make_pair(policy=Policy(kept_units=["attn"]))
    loaded = dict(_round_trips(model))[way]
    assert all(layer.forward.module is layer for layer in loaded.layers)
    x = torch.randn(4, 16)
    with audit() as a:
        loss = run_step(loaded, x)
    assert torch.equal(loss, run_step(reference, x))
    assert_same_gradients(loaded, reference)
    assert a.hits("aten::tanh") == 2  # still checkpointed, still keeping the attn unit


def test_torch_jit_script_of_a_checkpointed_module_says_what_to_do():
    layer = apply_selective_checkpointing(nn.Linear(4, 4))
    message = (
        "sac_plugin: torch.jit.script cannot compile Linear: its forward is checkpointed "
        "(apply_selective_checkpointing runs it through torch.utils.checkpoint), which TorchScript does not "
        "support. Script the model before applying sac_plugin, or use torch.compile, which honours the same policy"
    )
    with pytest.raises(TypeError) as error:
        torch.jit.script(layer)
    assert str(error.value) == message
    with pytest.raises(TypeError) as error:  # also as a submodule
        torch.jit.script(nn.Sequential(nn.ReLU(), layer))
    assert str(error.value) == message


def test_a_region_forward_entered_twice_is_refused():
    region = Region(Policy(kept_ops=["aten::tanh"]))
    with region.forward:
        with pytest.raises(RuntimeError) as error:
            region.forward.__enter__()
        assert str(error.value).startswith(
            "sac: this region's forward was already entered; a region serves one checkpoint call, so make a new one "
            "per call (the function context_fn(policy) returns does)"
        )
    assert not sac_key_included()
    with pytest.raises(RuntimeError, match="this region's forward was already entered"):
        region.forward.__enter__()
    assert not sac_key_included()


def test_a_region_forward_exited_on_another_thread_is_refused():
    region = Region(Policy(kept_ops=["aten::tanh"]))
    region.forward.__enter__()
    try:
        error = on_another_thread(lambda: region.forward.__exit__(None, None, None))
        assert str(error).startswith(
            "sac: exiting this region's forward on a thread that did not enter it; exit it on the thread that entered "
            "it (it is still open there, and nothing was changed)"
        )
        assert sac_key_included()
    finally:
        region.forward.__exit__(None, None, None)
    assert not sac_key_included()


def test_a_region_dropped_while_its_forward_is_open_restores_the_key_set():
    region = Region(Policy(kept_ops=["aten::tanh"]))
    region.forward.__enter__()
    assert sac_key_included()
    del region
    gc.collect()
    assert not sac_key_included()


class _Ctx:
    def __init__(self, is_recompute):
        self.is_recompute = is_recompute


def test_torch_policy_fn_keeps_the_same_calls():
    """The compile path's policy function counts calls per op and pass as the fallback does."""
    decide = torch_policy_fn(Policy(kept_calls={"aten::mm.default": [1, 3]}))
    x = torch.randn(2, 2)
    for recompute in (False, True):
        decisions = [decide(_Ctx(recompute), torch.ops.aten.mm.default, x, x) for _ in range(5)]
        assert decisions == [CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE,
                             CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE,
                             CheckpointPolicy.PREFER_RECOMPUTE]
    assert decide(_Ctx(False), torch.ops.aten.tanh.default, x) == CheckpointPolicy.PREFER_RECOMPUTE
