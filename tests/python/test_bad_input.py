"""Bad input to the public API: each error names the argument, what was given and the accepted
form, exactly, and leaves no state behind."""

import importlib

import pytest
import torch
from sac_plugin import (
    ConfigError,
    KeptCallables,
    KeptOps,
    Policy,
    RecomputeConfig,
    RecomputeTargetMap,
    apply_recompute_config,
    apply_selective_checkpointing,
    context_fn,
    in_recompute_unit,
    recompute_unit,
    resolve_kept_ops,
)
from sac_plugin import _observers
from sac_plugin.checkpointing import Region
from sac_plugin.models import Llama
from torch import nn

# The module, not the package's audit() function of the same name.
audit_module = importlib.import_module("sac_plugin._audit")


ERRORS = [
    (
        lambda: Policy(kept_ops=None),
        TypeError,
        "sac_plugin: kept_ops must be a collection of names such as ['aten::mm'], got None (NoneType)",
    ),
    (
        lambda: Policy(kept_ops="aten::mm"),
        TypeError,
        "sac_plugin: kept_ops must be a collection of names, not a single str: 'aten::mm'; write ['aten::mm']",
    ),
    (
        lambda: Policy(kept_ops=[3]),
        TypeError,
        "sac_plugin: kept_ops[0]: expected an op name such as 'aten::mm.default' or an op such as "
        "torch.ops.aten.mm.default, got 3 (int)",
    ),
    (
        lambda: Policy(kept_ops=["aten::mm\x00.out"]),
        ValueError,
        "sac_plugin: kept_ops[0]: an op name cannot contain a NUL character, got 'aten::mm\\x00.out'",
    ),
    (
        lambda: Policy(kept_ops=["aten::\ud800"]),
        ValueError,
        "sac_plugin: kept_ops[0]: an op name must be valid Unicode text, got 'aten::\\ud800'",
    ),
    (
        lambda: Policy(kept_ops={"aten::mm": 1}),
        TypeError,
        "sac_plugin: kept_ops must be a collection of names such as ['aten::mm'], got {'aten::mm': 1} (dict)",
    ),
    (
        lambda: Policy(kept_units=None),
        TypeError,
        "sac_plugin: kept_units must be a collection of names such as ['attn'], got None (NoneType)",
    ),
    (
        lambda: Policy(kept_units=[1]),
        TypeError,
        "sac_plugin: kept_units[0]: a recompute unit name is a str such as 'attn', got 1 (int)",
    ),
    (
        lambda: Policy(recomputed_units="attn"),
        TypeError,
        "sac_plugin: recomputed_units must be a collection of names, not a single str: 'attn'; write ['attn']",
    ),
    (
        lambda: Policy(every_nth_op=[("aten::mm", 2)]),
        TypeError,
        "sac_plugin: every_nth_op must be a mapping from op to n such as {'aten::mm': 2}, got [('aten::mm', 2)] (list)",
    ),
    (
        lambda: Policy(every_nth_op={"aten::mm": 2.0}),
        TypeError,
        "sac_plugin: every_nth_op['aten::mm'] must be an int from 1 to 2**63 - 1 (2 keeps every other call), "
        "got 2.0 (float)",
    ),
    (
        lambda: Policy(every_nth_op={3: 2}),
        TypeError,
        "sac_plugin: every_nth_op key: expected an op name such as 'aten::mm.default' or an op such as "
        "torch.ops.aten.mm.default, got 3 (int)",
    ),
    (
        lambda: Policy(every_nth_op={"aten::mm": 2, torch.ops.aten.mm: 3}),
        ValueError,
        "sac_plugin: every_nth_op names 'aten::mm' twice, with n = 2 and n = 3; give each op one n",
    ),
    (
        lambda: Policy(every_nth_op={"aten::mm": 2, "aten.mm.default": 3}),
        ValueError,
        "sac: every_nth_op: 'aten.mm.default' gives aten::mm n = 3, but another entry already gave it n = 2; "
        "give each op one n",
    ),
    (
        lambda: context_fn("attn"),
        TypeError,
        "sac_plugin: context_fn: policy must be a sac_plugin.Policy or None, got 'attn' (str)",
    ),
    (lambda: Region("attn"), TypeError, "sac_plugin: Region: policy must be a sac_plugin.Policy, got 'attn' (str)"),
    (
        lambda: apply_selective_checkpointing(None),
        TypeError,
        "sac_plugin: apply_selective_checkpointing: module must be a torch.nn.Module, got None (NoneType)",
    ),
    (
        lambda: apply_selective_checkpointing(nn.Linear(2, 2), preserve_rng_state="yes"),
        TypeError,
        "sac_plugin: apply_selective_checkpointing: preserve_rng_state must be True or False, got 'yes' (str)",
    ),
    (
        lambda: apply_selective_checkpointing(torch.jit.script(nn.Linear(2, 2))),
        TypeError,
        "sac_plugin: apply_selective_checkpointing: module is a TorchScript module (RecursiveScriptModule), whose "
        "forward cannot be checkpointed; apply sac_plugin to the eager module",
    ),
    (
        lambda: recompute_unit(None),
        TypeError,
        "sac_plugin: recompute_unit: name: a recompute unit name is a str such as 'attn', got None (NoneType)",
    ),
    (
        lambda: recompute_unit(""),
        ValueError,
        "sac_plugin: recompute_unit: name: a recompute unit needs a non-empty str name such as 'attn', got ''",
    ),
    (
        lambda: recompute_unit("at\x00tn"),
        ValueError,
        "sac_plugin: recompute_unit: name: a recompute unit name cannot contain a NUL character, got 'at\\x00tn'",
    ),
    (
        lambda: in_recompute_unit("attn", 3),
        TypeError,
        "sac_plugin: in_recompute_unit: fn must be callable, got 3 (int)",
    ),
    (
        lambda: in_recompute_unit(7),
        TypeError,
        "sac_plugin: in_recompute_unit: name: a recompute unit name is a str such as 'attn', got 7 (int)",
    ),
    (
        lambda: resolve_kept_ops(None),
        TypeError,
        "sac_plugin: resolve_kept_ops: names must be a collection of names such as ['aten::mm'], got None (NoneType)",
    ),
    (
        lambda: RecomputeConfig.from_json(None),
        TypeError,
        "recompute config: RecomputeConfig.from_json expects the file's text (str), got None (NoneType); "
        "RecomputeConfig.load(path) reads a file",
    ),
    (
        lambda: RecomputeConfig.from_json("[" * 100_000 + "]" * 100_000),
        ConfigError,
        "recompute config: not valid JSON: nested too deeply (a recompute config is a flat mapping)",
    ),
    (
        lambda: RecomputeConfig.from_yaml("[" * 100_000 + "]" * 100_000),
        ConfigError,
        "recompute config: not valid YAML: nested too deeply (a recompute config is a flat mapping)",
    ),
    (
        lambda: RecomputeConfig.load(None),
        TypeError,
        "recompute config: RecomputeConfig.load expects a path (str or os.PathLike), got None (NoneType)",
    ),
    (
        lambda: apply_recompute_config(Llama(), {"units": ["attn"]}),
        TypeError,
        "sac_plugin: apply_recompute_config: config must be a RecomputeConfig or None, got {'units': ['attn']} (dict); "
        "build one with RecomputeConfig.from_dict(...)",
    ),
    (
        lambda: apply_recompute_config(None),
        TypeError,
        "sac_plugin: apply_recompute_config: model must be a torch.nn.Module, got None (NoneType)",
    ),
    (
        lambda: apply_recompute_config(Llama(), target_map={"attn": ["x"]}),
        TypeError,
        "sac_plugin: apply_recompute_config: target_map must be a RecomputeTargetMap or None, got {'attn': ['x']} (dict)",
    ),
    (
        lambda: apply_recompute_config(Llama(), wrap_sites="layers"),
        TypeError,
        "sac_plugin: apply_recompute_config: wrap_sites must be a list of nn.Module, got 'layers' (str)",
    ),
    (
        lambda: apply_recompute_config(Llama(), wrap_sites=[3]),
        TypeError,
        "sac_plugin: apply_recompute_config: wrap_sites[0] must be an nn.Module, got 3 (int)",
    ),
    (
        lambda: KeptOps("aten::mm"),
        TypeError,
        "sac_plugin: KeptOps: ops must be a list of names such as ['aten::mm'], got 'aten::mm' (str)",
    ),
    (
        lambda: KeptCallables("feed_forward"),
        TypeError,
        "sac_plugin: KeptCallables: paths must be a list of names such as ['feed_forward'], got 'feed_forward' (str)",
    ),
    (
        lambda: RecomputeTargetMap("M", {"atn": KeptOps(["aten::mm"])}),
        ValueError,
        "sac_plugin: RecomputeTargetMap: targets key: unknown unit 'atn' (str); known units: attn, mlp, moe_gate, "
        "moe_dispatch, norm",
    ),
    (
        lambda: RecomputeTargetMap("M", {"attn": ["aten::mm"]}),
        TypeError,
        "sac_plugin: RecomputeTargetMap: targets['attn'] must be KeptOps or KeptCallables, got ['aten::mm'] (list)",
    ),
]


@pytest.mark.parametrize("call,kind,message", ERRORS, ids=[message[:60] for _, _, message in ERRORS])
def test_bad_input_is_named_with_what_was_given_and_what_is_accepted(call, kind, message):
    with pytest.raises(kind) as error:
        call()
    assert type(error.value) is kind
    assert str(error.value) == message
    # No state behind: the autouse fixture checks the key sets and units; no audit is counted.
    assert not audit_module.any_active() and not _observers.observing()
