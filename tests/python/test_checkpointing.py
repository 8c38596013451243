"""Checkpointing a module or a function: apply_selective_checkpointing refuses bad input and a
second application before changing anything; a checkpointed module survives torch.save, pickle and
deepcopy, and TorchScript says what to do instead; a Region's forward is entered once, on one
thread, and restores the key set when dropped; torch_policy_fn, the policy function for torch's
SAC (and so torch.compile), makes the fallback's decisions."""

import copy
import dataclasses
import gc
import io
import pickle
import weakref

import pytest
import sac_plugin
import torch
from sac_plugin import Policy, apply_selective_checkpointing, audit
from sac_plugin.checkpointing import Region, torch_policy_fn
from sac_plugin.models import Llama
from support.thread_checks import on_another_thread, sac_key_included
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy
from support.toy_models import assert_same_gradients, make_pair, run_step


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


def _checkpointed_model(how):
    if how == "apply_selective_checkpointing":
        model, _ = make_pair(policy=Policy(kept_units=["attn"]))
        run_step(model, torch.randn(4, 16))
        return model
    torch.manual_seed(0)
    model = Llama(vocab=32, dim=16, heads=2, layers=2, seq=8)
    sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(kept_units=["attn", "mlp"]))
    tokens = torch.randint(32, (2, 8))
    model.loss(tokens, tokens).backward()
    return model


@pytest.mark.parametrize("how", ["apply_selective_checkpointing", "apply_recompute_config"])
def test_a_checkpointed_model_is_freed_with_its_last_reference_without_the_garbage_collector(how):
    model = _checkpointed_model(how)
    modules = [weakref.ref(m) for m in model.modules()]
    gc.disable()
    try:
        del model
        assert [type(r()).__name__ for r in modules if r() is not None] == []
    finally:
        gc.enable()


def test_a_forward_taken_from_a_freed_module_says_so():
    layer = apply_selective_checkpointing(nn.Linear(4, 4))
    forward = layer.forward
    del layer
    gc.collect()
    with pytest.raises(ReferenceError) as raised:
        forward(torch.randn(2, 4))
    assert str(raised.value) == (
        "sac_plugin: this CheckpointedForward belongs to a module that no longer exists; call the module itself, "
        "not a forward taken from it"
    )


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
        assert decisions == [
            CheckpointPolicy.PREFER_RECOMPUTE,
            CheckpointPolicy.MUST_SAVE,
            CheckpointPolicy.PREFER_RECOMPUTE,
            CheckpointPolicy.MUST_SAVE,
            CheckpointPolicy.PREFER_RECOMPUTE,
        ]
    assert decide(_Ctx(False), torch.ops.aten.tanh.default, x) == CheckpointPolicy.PREFER_RECOMPUTE


# --- every keyword reaches the module ---------------------------------------------------------


class _KeywordLayer(nn.Module):
    """Takes, as its own keywords, every name torch.utils.checkpoint.checkpoint also takes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(
        self,
        x,
        *,
        early_stop=False,
        determinism_check="none",
        debug=False,
        context_fn=None,
        use_reentrant=None,
        preserve_rng_state=None,
        scale=1.0,
    ):
        y = torch.tanh(self.linear(x)) * scale
        if early_stop:
            y = y * 2
        if determinism_check != "none":
            y = y + 1
        if debug:
            y = y - 3
        if context_fn is not None:
            y = context_fn(y)
        if use_reentrant is not None or preserve_rng_state is not None:
            y = y.sin()
        return y


@pytest.mark.parametrize(
    "keywords",
    [
        {"early_stop": True},
        {"determinism_check": "default"},
        {"debug": True},
        {"context_fn": torch.cos},
        {"use_reentrant": True},
        {"preserve_rng_state": False},
        {"scale": 0.5, "early_stop": True},
    ],
    ids=lambda k: ",".join(k),
)
def test_every_keyword_reaches_the_checkpointed_module(keywords):
    torch.manual_seed(0)
    layer = _KeywordLayer()
    reference = copy.deepcopy(layer)
    sac_plugin.apply_selective_checkpointing(layer, Policy(kept_ops=["aten::addmm"]))
    x = torch.randn(4, 8, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    out = layer(x, **keywords)
    expected = reference(x_reference, **keywords)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(x.grad, x_reference.grad)
    assert torch.equal(layer.linear.weight.grad, reference.linear.weight.grad)


# --- remove_checkpointing --------------------------------------------------------------------


def test_remove_checkpointing_restores_the_class_forward_and_keeps_state_dict_keys():
    model, reference = make_pair(policy=Policy(kept_units=["attn"]))
    keys = list(model.state_dict())
    assert sac_plugin.remove_checkpointing(model) is model
    assert keys == list(model.state_dict()) == list(reference.state_dict())
    for layer in model.layers:
        assert "forward" not in vars(layer) and "_sac_policy" not in vars(layer)
    x = torch.randn(4, 16)
    with sac_plugin.audit() as audit:
        run_step(model, x)
    run_step(reference, x)
    assert audit.count("aten::tanh", phase="recompute") == 0
    assert audit.hits("aten::tanh") == 0
    assert_same_gradients(model, reference)
    sac_plugin.apply_selective_checkpointing(model.layers[0], Policy())  # checkpointable again


def test_remove_checkpointing_undoes_a_config_with_units_installed_on_submodules():
    from sac_plugin.models import Llama

    torch.manual_seed(0)
    model = Llama(layers=2)
    sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(kept_units=["mlp", "norm"]))
    assert "forward" in vars(model.layers[0].feed_forward)
    sac_plugin.remove_checkpointing(model)
    assert not any("forward" in vars(m) or any(k.startswith("_sac") for k in vars(m)) for m in model.modules())
    sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(kept_units=["mlp"]))


def test_remove_checkpointing_of_an_untouched_module_says_so():
    with pytest.raises(
        ValueError,
        match=r"^sac_plugin: remove_checkpointing: sac_plugin installed nothing on "
        r"Linear or its submodules; there is nothing to remove$",
    ):
        sac_plugin.remove_checkpointing(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module, got 3 \(int\)"):
        sac_plugin.remove_checkpointing(3)


@pytest.mark.parametrize("early_stop, sin_recomputed", [(True, 0), (False, 1)])
def test_early_stop_is_torch_s_and_can_be_turned_off(early_stop, sin_recomputed):
    from support.toy_models import AttnLayer

    torch.manual_seed(0)
    layer = AttnLayer()
    reference = copy.deepcopy(layer)
    sac_plugin.apply_selective_checkpointing(layer, Policy(kept_units=["attn"]), early_stop=early_stop)
    x = torch.randn(4, 16)
    with audit() as counted:
        run_step(layer, x)
    run_step(reference, x)
    # The final sin runs after the last tensor saved for backward: an early stop never reaches it.
    assert counted.count("aten::sin", phase="recompute") == sin_recomputed
    assert counted.hits("aten::tanh") == 1
    assert_same_gradients(layer, reference)


def test_a_region_lives_while_either_of_its_scopes_does():
    regions_before = sac_plugin._C.live_regions()
    region = Region(Policy(kept_ops=["aten::tanh"]))
    forward, recompute = region.forward, region.recompute
    del region
    assert forward.region.handle == recompute.region.handle
    assert sac_plugin._C.live_regions() == regions_before + 1
    del forward
    gc.collect()
    assert sac_plugin._C.live_regions() == regions_before + 1
    with recompute:
        assert sac_key_included()
    del recompute
    gc.collect()
    assert sac_plugin._C.live_regions() == regions_before


def test_region_scopes_are_made_only_by_the_library():
    scope_type = type(Region(Policy(kept_ops=["aten::tanh"])).forward)
    with pytest.raises(TypeError, match="cannot create 'sac_plugin._C.RegionScope' instances"):
        scope_type()


def test_a_recompute_exited_before_it_was_entered_is_refused_and_changes_nothing():
    region = Region(Policy(kept_ops=["aten::tanh"]))
    with pytest.raises(RuntimeError) as error:
        region.recompute.__exit__(None, None, None)
    assert str(error.value) == "sac: exiting this region's recompute that is not open; nothing was changed"
    with region.recompute:
        assert sac_key_included()
    assert not sac_key_included()


# --- a module is checkpointed once -----------------------------------------------------------------


def _unchecked_toy():
    model, _ = make_pair(checkpoint=False)
    return model


def test_checkpointing_a_parent_of_a_checkpointed_layer_is_refused_naming_both():
    model = _unchecked_toy()
    apply_selective_checkpointing(model.layers[1], Policy(kept_ops=["aten::addmm"]))
    with pytest.raises(ValueError) as error:
        apply_selective_checkpointing(model, Policy())
    assert str(error.value) == (
        "sac_plugin: cannot checkpoint ToyModel: its submodule AttnLayer 'layers.1' is already checkpointed by "
        "sac_plugin (with Policy(kept_ops=['aten::addmm'], kept_units=[])); checkpoint either the outer module or the layers "
        "inside it, not both (sac_plugin.remove_checkpointing(submodule) first to move the checkpoint out)"
    )
    assert "_sac_policy" not in vars(model) and "forward" not in vars(model)
    assert not any("_sac_inside_checkpointed" in vars(module) for module in model.layers[0].modules())


def test_checkpointing_a_layer_inside_a_checkpointed_parent_is_refused_naming_both():
    model = _unchecked_toy()
    apply_selective_checkpointing(model, Policy(kept_ops=["aten::tanh"]))
    with pytest.raises(ValueError) as error:
        apply_selective_checkpointing(model.layers[0].q)
    assert str(error.value) == (
        "sac_plugin: cannot checkpoint Linear: it is 'layers.0.q' inside ToyModel, which sac_plugin already "
        "checkpoints (with Policy(kept_ops=['aten::tanh'], kept_units=[])); checkpoint either the outer module or the layers "
        "inside it, not both (sac_plugin.remove_checkpointing(outer module) first to checkpoint the inner one)"
    )
    assert "_sac_policy" not in vars(model.layers[0].q)
    # Once the parent's checkpoint is removed, its layers are checkpointed as usual.
    sac_plugin.remove_checkpointing(model)
    reference = copy.deepcopy(model)
    for layer in model.layers:
        apply_selective_checkpointing(layer, Policy(kept_ops=["aten::tanh"]))
    x = torch.randn(4, 16)
    with audit() as a:
        run_step(model, x)
    run_step(reference, x)
    assert_same_gradients(model, reference)
    assert a.hits("aten::tanh") == 2


def test_a_copy_of_a_checkpointed_parent_refuses_its_own_layers_and_a_lone_copied_layer_is_free():
    model = _unchecked_toy()
    apply_selective_checkpointing(model, Policy())
    for _, copied in _round_trips(model):
        with pytest.raises(ValueError, match=r"it is 'layers.1' inside ToyModel, which sac_plugin already"):
            apply_selective_checkpointing(copied.layers[1])
    lone = copy.deepcopy(model.layers[1])
    apply_selective_checkpointing(lone, Policy(kept_ops=["aten::tanh"]))
    with audit() as a:
        lone(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert a.hits("aten::tanh") == 1


def test_a_config_over_nested_wrap_sites_is_refused_and_changes_nothing():
    model = Llama(layers=2)
    config = sac_plugin.RecomputeConfig(kept_units=["mlp"])
    with pytest.raises(ValueError) as error:
        sac_plugin.apply_recompute_config(model, config, wrap_sites=[model.layers[0], model.layers[0].feed_forward])
    assert str(error.value) == (
        "sac_plugin: apply_recompute_config: wrap site 0 (LlamaBlock 'layers.0') holds wrap site 1 (SwiGLU "
        "'layers.0.feed_forward'), so that one would be checkpointed twice; list either the outer module or the "
        "layers inside it in wrap_sites, not both"
    )
    assert not any({"_sac_policy", "forward"} & set(vars(module)) for module in model.modules())
    # every_nth_layer's selection, then the same config on the other layers: disjoint, accepted.
    sac_plugin.apply_recompute_config(model, dataclasses.replace(config, every_nth_layer=2))
    sac_plugin.apply_recompute_config(model, config, wrap_sites=[model.layers[1]])
    with pytest.raises(ValueError) as error:
        sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(), wrap_sites=[model.layers[0].attention])
    assert str(error.value).startswith(
        "sac_plugin: cannot checkpoint LlamaAttention 'layers.0.attention': it is 'attention' inside LlamaBlock "
        "'layers.0', which sac_plugin already checkpoints"
    )


def test_torchs_checkpoint_wrapper_and_the_plugin_on_one_layer_are_refused():
    wrappers = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    model = _unchecked_toy()
    model.layers[0] = wrappers.checkpoint_wrapper(model.layers[0])
    with pytest.raises(ValueError) as error:
        apply_selective_checkpointing(model.layers[0])
    assert str(error.value) == (
        "sac_plugin: CheckpointWrapper is torch's CheckpointWrapper, which already checkpoints AttnLayer; to "
        "checkpoint it with sac_plugin, pass context_fn=sac_plugin.context_fn(policy) to checkpoint_wrapper "
        "instead, or apply sac_plugin to the unwrapped module"
    )
    with pytest.raises(ValueError, match=r"its submodule CheckpointWrapper 'layers.0' is torch's CheckpointWrapper"):
        apply_selective_checkpointing(model)
    assert not any("_sac_policy" in vars(module) for module in model.modules())
