"""Unit checks: a unit a policy names but no model declares or opens (a typo) warns once, naming
the units that did open and the closest one; a kept unit that opens but keeps nothing warns once."""

import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import Policy, RecomputeConfig, apply_recompute_config, recompute_unit
from sac_plugin.models import GPT, Llama, MoEModel
from torch.utils.checkpoint import checkpoint


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
    apply_recompute_config(model, RecomputeConfig(units=["attn", "moe_gate", "mlp"],
                                                  force_recompute_modules=["moe.router.gate"]))
    tokens = torch.randint(64, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.loss(tokens, tokens).backward()


def test_a_declared_unit_that_another_layer_opens_does_not_warn():
    # One policy for a dense and a MoE layer: "moe_gate" opens only in the MoE one. A unit some
    # model declares is not a typo, even where it does not open.
    torch.manual_seed(0)
    dense, moe = Llama(vocab=64, dim=32, layers=1, seq=16), MoEModel(vocab=64, dim=32, layers=1, seq=16)
    apply_recompute_config(moe, RecomputeConfig(units=["moe_gate"]))  # declares moe_gate
    policy = Policy(kept_units=["moe_gate"])
    sac_plugin.apply_selective_checkpointing(dense.layers[0], policy)
    tokens = torch.randint(64, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense.loss(tokens, tokens).backward()


def test_config_still_refuses_a_unit_the_target_map_does_not_declare():
    with pytest.raises(sac_plugin.ConfigError, match=r"^recompute config: units\[0\]: Llama declares no unit 'moe_gate'"):
        apply_recompute_config(Llama(vocab=64, dim=32, layers=1, seq=16), RecomputeConfig(units=["moe_gate"]))
