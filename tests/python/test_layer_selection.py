"""Which layers a config checkpoints: every_nth_layer from layer 0 by default, first_layer for the
other convention (Modalities' ac_freq), layer_ratio spread from layer 0."""

import pytest
import sac_plugin
import torch
from sac_plugin import ConfigError, RecomputeConfig, apply_recompute_config
from sac_plugin.models import Llama


def modalities_selected(count: int, ac_freq: int) -> list[int]:
    # Modalities' selective layer AC checkpoints a layer when (layer_id + 1) % ac_freq == 0: for
    # ac_freq=2 of 4 layers, layers 1 and 3.
    return [layer_id for layer_id in range(count) if (layer_id + 1) % ac_freq == 0]


def test_every_nth_layer_counts_from_layer_zero():
    assert RecomputeConfig(every_nth_layer=2).selected_layers(4) == [0, 2]
    assert RecomputeConfig(every_nth_layer=3).selected_layers(7) == [0, 3, 6]
    assert RecomputeConfig(layer_ratio=0.5).selected_layers(4) == [0, 2]
    assert RecomputeConfig(layer_ratio=0.25).selected_layers(4) == [0]


def test_first_layer_is_modalities_convention():
    assert RecomputeConfig(every_nth_layer=2, first_layer=1).selected_layers(4) == [1, 3] == modalities_selected(4, 2)
    for count in range(1, 9):
        for ac_freq in range(1, count + 1):
            config = RecomputeConfig(every_nth_layer=ac_freq, first_layer=ac_freq - 1)
            assert config.selected_layers(count) == modalities_selected(count, ac_freq), (count, ac_freq)


def test_first_layer_checkpoints_those_layers_of_a_model():
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, heads=4, layers=4, seq=16)
    reference = Llama(vocab=64, dim=32, heads=4, layers=4, seq=16)
    reference.load_state_dict(model.state_dict())
    apply_recompute_config(model, RecomputeConfig(units=["attn"], every_nth_layer=2, first_layer=1))
    assert ["_sac_policy" in layer.__dict__ for layer in model.layers] == [False, True, False, True]
    tokens = torch.randint(64, (2, 16))
    with sac_plugin.audit() as audit:
        loss = model.loss(tokens, tokens)
        loss.backward()
    expected = reference.loss(tokens, tokens)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert audit.hits("aten::_scaled_dot_product_flash_attention_for_cpu") == 2


def test_first_layer_round_trips_and_is_checked():
    config = RecomputeConfig(every_nth_layer=2, first_layer=1)
    assert RecomputeConfig.from_json(config.to_json()) == config
    assert config.to_dict()["first_layer"] == 1
    with pytest.raises(ConfigError) as error:
        RecomputeConfig(first_layer=-1)
    assert str(error.value) == ("recompute config: first_layer must be an int >= 0 (the index of the first "
                                "checkpointed layer), got -1")
    with pytest.raises(ConfigError) as error:
        RecomputeConfig(layer_ratio=0.5, first_layer=1)
    assert str(error.value) == ("recompute config: first_layer applies to every_nth_layer; layer_ratio spreads its "
                                "layers from layer 0. Set every_nth_layer and first_layer, or layer_ratio alone")
    with pytest.raises(ConfigError) as error:
        apply_recompute_config(Llama(vocab=64, dim=32, layers=2, seq=16), RecomputeConfig(first_layer=2))
    assert str(error.value) == ("recompute config: first_layer is 2, but the model has 2 wrap sites (layers 0 to 1); "
                                "first_layer must be one of them")
