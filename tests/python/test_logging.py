"""Logging: one INFO line per checkpointed model on the "sac_plugin" logger, DEBUG for decisions."""

import logging

import sac_plugin
import torch
from sac_plugin import RecomputeConfig, apply_recompute_config
from sac_plugin.models import Llama


def test_one_info_line_per_model(caplog):
    model = Llama(vocab=64, dim=32, heads=4, layers=4, seq=16)
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        apply_recompute_config(model, RecomputeConfig(kept_units=["mlp"], every_nth_layer=2))
    records = [r for r in caplog.records if r.name == "sac_plugin"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        (
            "INFO",
            "Llama: checkpointed 2 of 4 (0, 2) wrap sites (every_nth_layer=2, first_layer=0) with "
            "Policy(kept_ops=[], kept_units=['mlp']); units: mlp -> feed_forward",
        )
    ]


def test_full_recompute_is_said_so(caplog):
    with caplog.at_level(logging.INFO, logger="sac_plugin"):
        apply_recompute_config(Llama(vocab=64, dim=32, heads=4, layers=2, seq=16))
    assert [r.getMessage() for r in caplog.records if r.name == "sac_plugin"] == [
        "Llama: checkpointed 2 of 2 (0, 1) wrap sites (every_nth_layer=1, first_layer=0) with full recompute"
    ]


def test_debug_lines_give_the_decisions(caplog):
    model = Llama(vocab=64, dim=32, heads=4, layers=2, seq=16)
    with caplog.at_level(logging.DEBUG, logger="sac_plugin"):
        apply_recompute_config(model, RecomputeConfig(kept_units=["mlp"], every_nth_layer=2))
    debug = [r.getMessage() for r in caplog.records if r.name == "sac_plugin" and r.levelname == "DEBUG"]
    assert debug == [
        "layers.0 (wrap site 0): layers.0.feed_forward runs in unit 'mlp'",
        "checkpointing LlamaBlock with Policy(kept_ops=[], kept_units=['mlp'])",
        "Llama: wrap sites [1] are not checkpointed (the layer selection leaves them out)",
    ]


def test_nothing_is_logged_per_step(caplog):
    model = Llama(vocab=64, dim=32, heads=4, layers=2, seq=16)
    apply_recompute_config(model, RecomputeConfig(kept_units=["attn"]))
    tokens = torch.randint(64, (2, 16))
    model.loss(tokens, tokens).backward()  # the first step settles the policy's unit checks
    with caplog.at_level(logging.DEBUG, logger="sac_plugin"):
        model.loss(tokens, tokens).backward()
    assert [r for r in caplog.records if r.name == "sac_plugin"] == []
    assert sac_plugin.engine() in ("native", "dispatch_mode")
