"""Recompute units: a unit is closed on the thread that opened it, innermost first, and its name is
bounded. Unit checks: a unit a policy names but no model declares or opens (a typo) warns once,
naming the units that did open and the closest one; a kept unit that opens but keeps nothing warns
once."""

import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import Policy, RecomputeConfig, apply_recompute_config, recompute_unit
from sac_plugin.models import GPT, Llama, MoEModel
from support.thread_checks import on_another_thread
from torch.utils.checkpoint import checkpoint


# --- opening and closing units --------------------------------------------------------------------


def test_closing_units_out_of_order_is_refused_and_changes_nothing():
    attn, rope = sac_plugin._C.unit_id("attn"), sac_plugin._C.unit_id("rope")
    outer = sac_plugin._C.unit_push(attn)
    inner = sac_plugin._C.unit_push(rope)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"recompute unit 'attn' \(opened at depth 1\) closed out of order: "
            r"the innermost open unit is 'rope' at depth 2",
        ):
            sac_plugin._C.unit_pop(attn, outer)
        assert sac_plugin.open_units() == ["attn", "rope"]
    finally:
        sac_plugin._C.unit_pop(rope, inner)
        sac_plugin._C.unit_pop(attn, outer)


def test_a_refused_out_of_order_unit_close_leaves_the_unit_closable():
    attn, rope = recompute_unit("attn"), recompute_unit("rope")
    attn.__enter__()
    rope.__enter__()
    with pytest.raises(RuntimeError, match=r"recompute unit 'attn' \(opened at depth 1\) closed out of order"):
        attn.__exit__(None, None, None)
    assert sac_plugin.open_units() == ["attn", "rope"]
    rope.__exit__(None, None, None)
    attn.__exit__(None, None, None)  # the refused close left attn open: this one closes it
    assert sac_plugin.open_units() == []


def test_a_unit_exited_on_another_thread_is_refused():
    attn = recompute_unit("attn")
    with attn:
        error = on_another_thread(lambda: attn.__exit__(None, None, None))
        assert str(error) == (
            "sac_plugin: exiting recompute unit 'attn' on a thread that did not enter it (it is open on another "
            "thread); exit it on the thread that entered it; nothing was changed"
        )
        assert sac_plugin.open_units() == ["attn"]
    with pytest.raises(RuntimeError) as error:
        attn.__exit__(None, None, None)
    assert str(error.value) == (
        "sac_plugin: exiting recompute unit 'attn' on a thread that did not enter it (it is not open); exit it on "
        "the thread that entered it; nothing was changed"
    )


@pytest.mark.parametrize("length", [257, 10**7])
def test_unit_names_are_bounded(length):
    name = "u" * length
    message = (
        "a recompute unit name has at most 256 characters (names are kept for the life of the process), "
        f"got one of {length}: 'uuuuuuuuuuuuuuuuuuuuuuuuuuu...uuuuuuuuuuuuuuuuuuuuuuuuuuuu'"
    )
    with pytest.raises(ValueError) as error:
        recompute_unit(name)
    assert str(error.value) == "sac_plugin: recompute_unit: name: " + message
    with pytest.raises(ValueError) as error:
        Policy(kept_units=[name])
    assert str(error.value) == "sac_plugin: kept_units[0]: " + message
    with recompute_unit("u" * 256):
        assert sac_plugin.open_units() == ["u" * 256]


# --- unit checks: names that no model declares or opens, kept units that keep nothing -------------


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=64, dim=32, heads=4, layers=2, seq=16)


def _train_steps(model, policy, steps=2):
    for block in model.blocks:
        sac_plugin.apply_selective_checkpointing(block, policy)
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught, sac_plugin.audit() as audit:
        warnings.simplefilter("always")
        for _ in range(steps):
            model(tokens).sum().backward()
    return [str(w.message) for w in caught if "sac_plugin:" in str(w.message)], audit


def test_misspelt_kept_unit_warns_once_with_the_opened_units_and_closest_match():
    policy = Policy(kept_units=["atn"])
    messages, audit = _train_steps(_gpt(), policy)
    assert messages == [
        "sac_plugin: kept unit 'atn' is declared by no model and was not opened in the forward of a checkpointed "
        "region with Policy(kept_ops=[], kept_units=['atn']), so it keeps nothing. Units opened there: attn, mlp; "
        "closest match: 'attn' (warned once per policy)"
    ]
    assert sum(row.hits for row in audit.rows()) == 0  # what the warning says: nothing was kept


def test_misspelt_recomputed_unit_warns_once():
    policy = Policy(kept_units=["attn"], recomputed_units=["mpl"])
    messages, audit = _train_steps(_gpt(), policy)
    assert messages == [
        "sac_plugin: recomputed unit 'mpl' is declared by no model and was not opened in the forward of a "
        "checkpointed region with Policy(kept_ops=[], kept_units=['attn'], recomputed_units=['mpl']), so it "
        "recomputes nothing. Units opened there: attn, mlp; closest match: 'mlp' (warned once per policy)"
    ]
    assert audit.hits("aten::addmm") == 4  # the kept attn unit's qkv projection: 2 layers x 2 steps


def test_unit_names_that_open_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        messages, audit = _train_steps(_gpt(), Policy(kept_units=["attn", "mlp"]))
    assert messages == []
    assert audit.hits("aten::_scaled_dot_product_flash_attention_for_cpu") == 4  # 2 layers x 2 steps


def _view_only_unit(weight, x):
    h = torch.tanh(x @ weight)
    with recompute_unit("reshape"):
        h = h.transpose(0, 1).transpose(0, 1)  # views only: a kept unit never keeps a view
    return h.sin()


def test_kept_unit_that_keeps_nothing_warns_once():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    policy = Policy(kept_units=["reshape"])
    fn = sac_plugin.context_fn(policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            checkpoint(_view_only_unit, weight, x, use_reentrant=False, context_fn=fn).sum().backward()
    messages = [str(w.message) for w in caught if "sac_plugin:" in str(w.message)]
    assert messages == [
        "sac_plugin: kept unit 'reshape' was opened in the forward of a checkpointed region with "
        "Policy(kept_ops=[], kept_units=['reshape']) but kept nothing: everything run inside it was a view, an "
        "in-place write, a random call, a collective or inside a recomputed unit, which are always recomputed "
        "(warned once per policy)"
    ]


def test_each_policy_warns_once_for_itself():
    first, _ = _train_steps(_gpt(), Policy(kept_units=["atn"]))
    second, _ = _train_steps(_gpt(), Policy(kept_units=["atn"]))
    assert len(first) == len(second) == 1


def test_config_units_declared_by_a_target_map_do_not_warn():
    # The MoE target map declares moe_gate and mlp as callables it runs in units: they open.
    torch.manual_seed(0)
    model = MoEModel(vocab=64, dim=32, heads=4, layers=2, seq=16)
    apply_recompute_config(
        model, RecomputeConfig(kept_units=["attn", "moe_gate", "mlp"], force_recompute_modules=["moe.router.gate"])
    )
    tokens = torch.randint(64, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.loss(tokens, tokens).backward()


def test_a_declared_unit_that_another_layer_opens_does_not_warn():
    # One policy for a dense and a MoE layer: "moe_gate" opens only in the MoE one. A unit some
    # model declares is not a typo, even where it does not open.
    torch.manual_seed(0)
    dense, moe = Llama(vocab=64, dim=32, layers=1, seq=16), MoEModel(vocab=64, dim=32, layers=1, seq=16)
    apply_recompute_config(moe, RecomputeConfig(kept_units=["moe_gate"]))  # declares moe_gate
    policy = Policy(kept_units=["moe_gate"])
    sac_plugin.apply_selective_checkpointing(dense.layers[0], policy)
    tokens = torch.randint(64, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense.loss(tokens, tokens).backward()
