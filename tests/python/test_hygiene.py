"""Issue 12, items 3-8 and 10: bounds, validation before state, scopes that can always be undone,
checkpointed modules that survive pickling, and errors that say what was wrong. Each test here
failed on the code before the fix (801711d)."""

import copy
import gc
import importlib
import io
import os
import pickle
import subprocess
import threading
from pathlib import Path

import pytest
import sac_plugin
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
    audit,
    context_fn,
    in_recompute_unit,
    recompute_unit,
    resolve_kept_ops,
)
from sac_plugin.checkpointing import Region
from sac_plugin.models import Llama
from torch import nn
from torch.utils.checkpoint import checkpoint
from toy_models import assert_same_gradients, make_pair, run_step

ROOT = Path(__file__).resolve().parents[2]
# The module, not the package's audit() function of the same name.
audit_module = importlib.import_module("sac_plugin.audit")


def sac_key_included() -> bool:
    return "Fake" in repr(torch._C._dispatch_tls_local_include_set())


def on_another_thread(fn):
    """Runs fn on a new thread; returns the exception it raised (or None)."""
    raised = []

    def run():
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - handed back to the test
            raised.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


# --- item 3: every_nth_op values beyond 32 bits ---------------------------------------------------


def _three_matmuls(w, x):
    # The last tanh saves its output, so the recompute runs through all three matmuls.
    return torch.tanh(torch.tanh(torch.tanh(x @ w) @ w) @ w)


@pytest.mark.parametrize("n,hits", [(2**32, 1), (2**32 + 1, 1), (2**63 - 1, 1), (2, 2), (1, 3)])
def test_every_nth_op_is_honoured_exactly_beyond_32_bits(n, hits):
    # Calls 1, n+1, ... are kept: with three calls per region and n > 3 only the first. The
    # 32-bit cut made 2**32 keep nothing and 2**32 + 1 keep every call.
    policy = Policy(every_nth_op={"aten::mm.default": n})
    assert policy.every_nth_op == {"aten::mm": n}
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with audit() as a:
        checkpoint(_three_matmuls, w, x, use_reentrant=False, context_fn=context_fn(policy)).sum().backward()
    assert a.hits("aten::mm") == hits


def test_every_nth_op_beyond_int64_is_refused_by_policy_and_config():
    with pytest.raises(ValueError) as error:
        Policy(every_nth_op={"aten::mm": 2**64})
    assert str(error.value) == (
        "sac_plugin: every_nth_op['aten::mm'] must be an int from 1 to 2**63 - 1 (2 keeps every other call), "
        "got 18446744073709551616 (int)"
    )
    for n in (2**63, 2**64):
        with pytest.raises(ConfigError) as error:
            RecomputeConfig(every_nth_op={"aten::mm": n})
        assert str(error.value) == (
            f"recompute config: every_nth_op['aten::mm']: n must be an int from 1 to 2**63 - 1, got {n}"
        )
    assert RecomputeConfig(every_nth_op={"aten::mm": 2**63 - 1}).every_nth_op == {"aten::mm": 2**63 - 1}


# --- item 4: a refused apply leaves nothing behind -----------------------------------------------


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


def test_a_refused_config_leaves_every_layer_untouched():
    model = Llama()
    sites = model.recompute_wrap_sites()
    apply_selective_checkpointing(sites[1])
    with pytest.raises(ValueError, match="already selectively checkpointed"):
        apply_recompute_config(model, RecomputeConfig(units=["mlp"]))
    # Layer 0 was not checkpointed, and its feed-forward was not put in the unit either.
    assert "forward" not in sites[0].__dict__
    assert "forward" not in sites[0].feed_forward.__dict__
    with pytest.raises(ValueError) as error:
        apply_recompute_config(model, RecomputeConfig(), wrap_sites=[sites[0], sites[0]])
    assert str(error.value) == "sac_plugin: apply_recompute_config: wrap_sites lists one LlamaBlock twice (at 0 and 1)"
    assert "forward" not in sites[0].__dict__


# --- item 5: pickle, torch.save, deepcopy; TorchScript -------------------------------------------


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


def test_a_config_applied_model_round_trips_with_its_units():
    torch.manual_seed(0)
    model = apply_recompute_config(Llama(), RecomputeConfig(units=["mlp"]))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randint(0, 64, (2, 8))
    with audit() as a:
        loaded(x).float().pow(2).mean().backward()
    assert a.hits("aten::mm") > 0  # the feed-forward still runs in the kept "mlp" unit


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


# --- item 6: no state that nothing can undo -------------------------------------------------------


def test_an_audit_exited_on_another_thread_is_refused_and_still_closes_on_its_own():
    a = audit()
    a.__enter__()
    try:
        error = on_another_thread(lambda: a.__exit__(None, None, None))
        assert isinstance(error, RuntimeError)
        assert str(error) == (
            "sac_plugin: exiting an audit on a thread that did not enter it; exit it on the thread that entered it "
            "(it is still running there, and nothing was changed)"
        )
        assert sac_key_included() and audit_module.any_active()
    finally:
        a.__exit__(None, None, None)
    assert not sac_key_included() and not audit_module.any_active()


def test_the_c_plus_plus_audit_refuses_a_stop_from_another_thread():
    handle = torch.classes.sac.Audit()
    handle.start()
    error = on_another_thread(handle.stop)
    assert isinstance(error, RuntimeError)
    assert str(error).startswith(
        "sac: exiting an audit on a thread that did not enter it; exit it on the thread that entered it (it is "
        "still open there, and nothing was changed)"
    )
    assert handle.running()
    handle.stop()
    assert not handle.running() and not sac_key_included()


def test_a_stray_audit_exit_is_refused_and_the_count_never_goes_negative():
    with pytest.raises(RuntimeError) as error:
        audit().__exit__(None, None, None)
    assert str(error.value) == (
        "sac_plugin: exiting an audit that is not running (never entered, or already exited); nothing was changed"
    )
    with audit() as a:
        with pytest.raises(RuntimeError):  # a second exit of a running one is still one exit
            b = audit()
            b.__exit__(None, None, None)
        model, _ = make_pair(policy=Policy())  # keeps nothing: regions exist only for audits
        run_step(model, torch.randn(4, 16))
    assert audit_module._active_audits == 0
    # Full-recompute ops are reported as recompute, not as backward.
    assert a.count("aten::tanh", phase="recompute") == 2
    with pytest.raises(RuntimeError):
        a.__exit__(None, None, None)
    assert audit_module._active_audits == 0


def test_an_audit_dropped_while_running_restores_the_key_set_and_the_count():
    a = audit()
    a.__enter__()
    assert sac_key_included()
    del a
    gc.collect()
    assert not sac_key_included()
    assert audit_module._active_audits == 0


def test_a_refused_out_of_order_unit_close_leaves_the_unit_closable():
    attn, rope = recompute_unit("attn"), recompute_unit("rope")
    attn.__enter__()
    rope.__enter__()
    with pytest.raises(RuntimeError, match=r"recompute unit 'attn' \(opened at depth 1\) closed out of order"):
        attn.__exit__(None, None, None)
    assert sac_plugin.open_units() == ["attn", "rope"]
    rope.__exit__(None, None, None)
    attn.__exit__(None, None, None)  # was IndexError: pop from empty list
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


# --- item 7: errors that name the argument, what was given and the accepted form -------------------

ERRORS = [
    (lambda: Policy(kept_ops=None), TypeError,
     "sac_plugin: kept_ops must be a collection of names such as ['aten::mm'], got None (NoneType)"),
    (lambda: Policy(kept_ops="aten::mm"), TypeError,
     "sac_plugin: kept_ops must be a collection of names, not a single str: 'aten::mm'; write ['aten::mm']"),
    (lambda: Policy(kept_ops=[3]), TypeError,
     "sac_plugin: kept_ops[0]: expected an op name such as 'aten::mm.default' or an op such as "
     "torch.ops.aten.mm.default, got 3 (int)"),
    (lambda: Policy(kept_ops=["aten::mm\x00.out"]), ValueError,
     "sac_plugin: kept_ops[0]: an op name cannot contain a NUL character, got 'aten::mm\\x00.out'"),
    (lambda: Policy(kept_ops=["aten::\ud800"]), ValueError,
     "sac_plugin: kept_ops[0]: an op name must be valid Unicode text, got 'aten::\\ud800'"),
    (lambda: Policy(kept_ops={"aten::mm": 1}), TypeError,
     "sac_plugin: kept_ops must be a collection of names such as ['aten::mm'], got {'aten::mm': 1} (dict)"),
    (lambda: Policy(kept_units=None), TypeError,
     "sac_plugin: kept_units must be a collection of names such as ['attn'], got None (NoneType)"),
    (lambda: Policy(kept_units=[1]), TypeError,
     "sac_plugin: kept_units[0]: a recompute unit name is a str such as 'attn', got 1 (int)"),
    (lambda: Policy(recomputed_units="attn"), TypeError,
     "sac_plugin: recomputed_units must be a collection of names, not a single str: 'attn'; write ['attn']"),
    (lambda: Policy(every_nth_op=[("aten::mm", 2)]), TypeError,
     "sac_plugin: every_nth_op must be a mapping from op to n such as {'aten::mm': 2}, got [('aten::mm', 2)] (list)"),
    (lambda: Policy(every_nth_op={"aten::mm": 2.0}), TypeError,
     "sac_plugin: every_nth_op['aten::mm'] must be an int from 1 to 2**63 - 1 (2 keeps every other call), "
     "got 2.0 (float)"),
    (lambda: Policy(every_nth_op={3: 2}), TypeError,
     "sac_plugin: every_nth_op key: expected an op name such as 'aten::mm.default' or an op such as "
     "torch.ops.aten.mm.default, got 3 (int)"),
    (lambda: Policy(every_nth_op={"aten::mm": 2, torch.ops.aten.mm: 3}), ValueError,
     "sac_plugin: every_nth_op names 'aten::mm' twice, with n = 2 and n = 3; give each op one n"),
    (lambda: Policy(every_nth_op={"aten::mm": 2, "aten.mm.default": 3}), ValueError,
     "sac: every_nth_op: 'aten.mm.default' gives aten::mm n = 3, but another entry already gave it n = 2; "
     "give each op one n"),
    (lambda: context_fn("attn"), TypeError,
     "sac_plugin: context_fn: policy must be a sac_plugin.Policy or None, got 'attn' (str)"),
    (lambda: Region("attn"), TypeError, "sac_plugin: Region: policy must be a sac_plugin.Policy, got 'attn' (str)"),
    (lambda: apply_selective_checkpointing(None), TypeError,
     "sac_plugin: apply_selective_checkpointing: module must be a torch.nn.Module, got None (NoneType)"),
    (lambda: apply_selective_checkpointing(nn.Linear(2, 2), preserve_rng_state="yes"), TypeError,
     "sac_plugin: apply_selective_checkpointing: preserve_rng_state must be True or False, got 'yes' (str)"),
    (lambda: apply_selective_checkpointing(torch.jit.script(nn.Linear(2, 2))), TypeError,
     "sac_plugin: apply_selective_checkpointing: module is a TorchScript module (RecursiveScriptModule), whose "
     "forward cannot be checkpointed; apply sac_plugin to the eager module"),
    (lambda: recompute_unit(None), TypeError,
     "sac_plugin: recompute_unit: name: a recompute unit name is a str such as 'attn', got None (NoneType)"),
    (lambda: recompute_unit(""), ValueError,
     "sac_plugin: recompute_unit: name: a recompute unit needs a non-empty str name such as 'attn', got ''"),
    (lambda: recompute_unit("at\x00tn"), ValueError,
     "sac_plugin: recompute_unit: name: a recompute unit name cannot contain a NUL character, got 'at\\x00tn'"),
    (lambda: in_recompute_unit("attn", 3), TypeError, "sac_plugin: in_recompute_unit: fn must be callable, got 3 (int)"),
    (lambda: in_recompute_unit(7), TypeError,
     "sac_plugin: in_recompute_unit: name: a recompute unit name is a str such as 'attn', got 7 (int)"),
    (lambda: resolve_kept_ops(None), TypeError,
     "sac_plugin: resolve_kept_ops: names must be a collection of names such as ['aten::mm'], got None (NoneType)"),
    (lambda: RecomputeConfig.from_json(None), TypeError,
     "recompute config: RecomputeConfig.from_json expects the file's text (str), got None (NoneType); "
     "RecomputeConfig.load(path) reads a file"),
    (lambda: RecomputeConfig.from_json("[" * 100_000 + "]" * 100_000), ConfigError,
     "recompute config: not valid JSON: nested too deeply (a recompute config is a flat mapping)"),
    (lambda: RecomputeConfig.from_yaml("[" * 100_000 + "]" * 100_000), ConfigError,
     "recompute config: not valid YAML: nested too deeply (a recompute config is a flat mapping)"),
    (lambda: RecomputeConfig.load(None), TypeError,
     "recompute config: RecomputeConfig.load expects a path (str or os.PathLike), got None (NoneType)"),
    (lambda: apply_recompute_config(Llama(), {"units": ["attn"]}), TypeError,
     "sac_plugin: apply_recompute_config: config must be a RecomputeConfig or None, got {'units': ['attn']} (dict); "
     "build one with RecomputeConfig.from_dict(...)"),
    (lambda: apply_recompute_config(None), TypeError,
     "sac_plugin: apply_recompute_config: model must be a torch.nn.Module, got None (NoneType)"),
    (lambda: apply_recompute_config(Llama(), target_map={"attn": ["x"]}), TypeError,
     "sac_plugin: apply_recompute_config: target_map must be a RecomputeTargetMap or None, got {'attn': ['x']} (dict)"),
    (lambda: apply_recompute_config(Llama(), wrap_sites="layers"), TypeError,
     "sac_plugin: apply_recompute_config: wrap_sites must be a list of nn.Module, got 'layers' (str)"),
    (lambda: apply_recompute_config(Llama(), wrap_sites=[3]), TypeError,
     "sac_plugin: apply_recompute_config: wrap_sites[0] must be an nn.Module, got 3 (int)"),
    (lambda: KeptOps("aten::mm"), TypeError,
     "sac_plugin: KeptOps: ops must be a list of names such as ['aten::mm'], got 'aten::mm' (str)"),
    (lambda: KeptCallables("feed_forward"), TypeError,
     "sac_plugin: KeptCallables: paths must be a list of names such as ['feed_forward'], got 'feed_forward' (str)"),
    (lambda: RecomputeTargetMap("M", {"atn": KeptOps(["aten::mm"])}), ValueError,
     "sac_plugin: RecomputeTargetMap: targets key: unknown unit 'atn' (str); known units: attn, mlp, moe_gate, "
     "moe_dispatch, norm"),
    (lambda: RecomputeTargetMap("M", {"attn": ["aten::mm"]}), TypeError,
     "sac_plugin: RecomputeTargetMap: targets['attn'] must be KeptOps or KeptCallables, got ['aten::mm'] (list)"),
]


@pytest.mark.parametrize("call,kind,message", ERRORS, ids=[message[:60] for _, _, message in ERRORS])
def test_bad_input_is_named_with_what_was_given_and_what_is_accepted(call, kind, message):
    with pytest.raises(kind) as error:
        call()
    assert type(error.value) is kind
    assert str(error.value) == message
    # No state behind: the autouse fixture checks the key sets and units; no audit is counted.
    assert audit_module._active_audits == 0


def test_audit_queries_name_the_op_argument():
    with audit() as a:
        pass
    with pytest.raises(TypeError) as error:
        a.count(3)
    assert str(error.value) == (
        "sac_plugin: audit: op: expected an op name such as 'aten::mm.default' or an op such as "
        "torch.ops.aten.mm.default, got 3 (int)"
    )
    with pytest.raises(ValueError) as error:
        a.hits("aten::mm\x00")
    assert str(error.value) == "sac_plugin: audit: op: an op name cannot contain a NUL character, got 'aten::mm\\x00'"
    with pytest.raises(ValueError) as error:
        a.count("aten::mm", phase=1)
    assert str(error.value) == (
        "sac_plugin: phase must be one of ('forward', 'recompute', 'backward') or None, got 1 (int)"
    )


def test_config_files_that_are_not_utf8_or_missing_are_config_errors(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("units: [attn]  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.load(latin)
    assert str(error.value) == (
        f"recompute config: {latin}: not UTF-8 text (byte 0xe9 at offset 20); save the file as UTF-8"
    )
    with pytest.raises(ConfigError) as error:
        RecomputeConfig.load(tmp_path / "missing.json")
    assert str(error.value) == f"recompute config: {tmp_path / 'missing.json'}: cannot read it: No such file or directory"
    deep = tmp_path / "deep.yaml"
    deep.write_text("units:\n" + "".join(" " * i + "- \n" for i in range(1, 3000)))
    with pytest.raises(ConfigError, match="nested too deeply"):
        RecomputeConfig.load(deep)


def test_a_target_map_answers_in_for_any_key():
    targets = RecomputeTargetMap("M", {"attn": KeptOps(["aten::mm"])})
    assert "attn" in targets and "mlp" not in targets and "nonsense" not in targets


# --- item 8: slow paths, bounded ------------------------------------------------------------------


def test_absurd_op_name_lengths_are_refused_before_any_search():
    with pytest.raises(ValueError) as error:
        Policy(kept_ops=["aten::" + "x" * 160_000])
    assert str(error.value) == (
        "sac_plugin: kept_ops[0]: an op name has at most 1024 characters, got one of 160006: "
        "'aten::xxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx'"
    )
    # Within the bound, an unknown name far from every registered one gets no suggestion work
    # (tests/cpp/test_op_resolution.cpp counts it) and says so.
    with pytest.raises(ValueError) as error:
        Policy(kept_ops=["aten::" + "q" * 1000])
    assert str(error.value) == (
        "sac: kept_ops: unknown op 'aten::" + "q" * 74 + "... (1006 characters)'; no registered op has a similar name"
    )


def test_repeated_spellings_do_not_rescan_the_dispatcher():
    resolve_kept_ops(["aten::mm"])
    before = torch.ops.sac.op_index_rebuilds()
    Policy(kept_ops=["aten::mm"] * 16_000)
    assert resolve_kept_ops(["aten::mm", "aten.tanh"] * 8_000) == frozenset({"aten::mm", "aten.tanh"})
    with audit() as a:
        pass
    for _ in range(1_000):
        a.count("aten::mm")
    assert torch.ops.sac.op_index_rebuilds() == before


def test_op_resolution_follows_ops_registered_and_removed_later():
    with pytest.raises(ValueError, match="none of the op names resolves"):
        resolve_kept_ops(["sac_hygiene_test::probe"])
    library = torch.library.Library("sac_hygiene_test", "DEF")
    try:
        library.define("probe(Tensor x) -> Tensor")
        assert resolve_kept_ops(["sac_hygiene_test::probe"]) == frozenset({"sac_hygiene_test::probe"})
    finally:
        library._destroy()
    with pytest.raises(ValueError, match="none of the op names resolves"):
        resolve_kept_ops(["sac_hygiene_test::probe"])


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


# --- item 10: the GoogleTest binary as one process -------------------------------------------------


def test_the_cpp_tests_pass_as_one_process_in_any_order():
    build = os.environ.get("SAC_TEST_BUILD_DIR")
    if not build or not (Path(build) / "sac_cpp_tests").exists():
        pytest.skip("needs SAC_TEST_BUILD_DIR, the build tree with sac_cpp_tests (tools/test.sh sets it)")
    binary = Path(build) / "sac_cpp_tests"
    # --gtest_repeat=2: the second round runs every test after the fallback was installed.
    result = subprocess.run([str(binary), "--gtest_repeat=2", "--gtest_shuffle", "--gtest_brief=1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
