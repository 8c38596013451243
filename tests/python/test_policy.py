"""Policies: op names resolve to registered ops (with suggestions, bounds and no rescans), and the
counting rules are exact: every_nth_op keeps calls 1, n+1, ... of an op in a region; kept_calls keeps
exactly the listed calls of an op, counted the same way; a call inside a recomputed unit takes no
index (torchtitan's selective AC counts its every-second matmul that way, as does torch_policy_fn).
Gradients are bitwise equal to the function without checkpointing."""

import copy
import pickle

import pytest
import sac_plugin
import torch
from sac_plugin import (
    ConfigError,
    Policy,
    RecomputeConfig,
    _native,
    audit,
    context_fn,
    recompute_unit,
    resolve_kept_ops,
)
from torch.utils.checkpoint import checkpoint


# --- declaring a policy: op names, spellings, bounds ----------------------------------------------


def test_policy_spellings_and_copies():
    policy = Policy(kept_ops=["aten::mm.default", torch.ops.aten.tanh], kept_units=["attn"])
    assert policy.kept_ops == frozenset({"aten::mm", "aten::tanh", "aten::tanh.out"})
    assert policy.kept_units == frozenset({"attn"})
    assert copy.deepcopy(policy) is policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert torch.ops.aten.mm.default in policy.kept_overloads()


def test_unknown_op_names_the_closest_registered_ones():
    with pytest.raises(ValueError) as error:
        Policy(kept_ops=["aten::mm.defualt"])
    assert str(error.value) == (
        "sac: kept_ops: unknown op 'aten::mm.defualt' (aten::mm has no overload 'defualt'; it has: "
        "aten::mm.default aten::mm.dtype aten::mm.dtype_out aten::mm.out)"
    )
    with pytest.raises(ValueError) as error:
        Policy(kept_ops=["aten::scaled_dot_product_atention"])
    assert str(error.value).startswith(
        "sac: kept_ops: unknown op 'aten::scaled_dot_product_atention'; closest registered names: "
        "aten::scaled_dot_product_attention"
    )


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="kept_ops must be a collection of names, not a single str"):
        Policy(kept_ops="aten::mm")
    with pytest.raises(TypeError, match="expected an op name such as 'aten::mm.default'"):
        Policy(kept_ops=[3])
    with pytest.raises(ValueError, match=r"kept_units\[0\]: a recompute unit needs a non-empty str name"):
        Policy(kept_units=[""])
    with pytest.raises(ValueError, match="a recompute unit needs a non-empty str name"):
        recompute_unit("")


def test_resolve_kept_ops_skips_unregistered_spellings():
    names = ["aten::_flash_attention_forward_v3", "aten::_scaled_dot_product_flash_attention", "aten::mm"]
    assert sac_plugin.resolve_kept_ops(names) == frozenset({"aten::_scaled_dot_product_flash_attention", "aten::mm"})
    with pytest.raises(ValueError, match=r"none of the op names resolves to a registered op: \[aten::nope_v3\]"):
        sac_plugin.resolve_kept_ops(["aten::nope_v3"])


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
    before = sac_plugin._C.op_index_rebuilds()
    Policy(kept_ops=["aten::mm"] * 16_000)
    assert resolve_kept_ops(["aten::mm", "aten.tanh"] * 8_000) == frozenset({"aten::mm", "aten.tanh"})
    with audit() as a:
        pass
    for _ in range(1_000):
        a.count("aten::mm")
    assert sac_plugin._C.op_index_rebuilds() == before


def test_op_resolution_follows_ops_registered_and_removed_later():
    with pytest.raises(ValueError, match="none of the op names resolves"):
        resolve_kept_ops(["sac_policy_test::probe"])
    library = torch.library.Library("sac_policy_test", "DEF")
    try:
        library.define("probe(Tensor x) -> Tensor")
        assert resolve_kept_ops(["sac_policy_test::probe"]) == frozenset({"sac_policy_test::probe"})
    finally:
        library._destroy()
    with pytest.raises(ValueError, match="none of the op names resolves"):
        resolve_kept_ops(["sac_policy_test::probe"])


def test_a_refused_policy_leaves_nothing_behind():
    with pytest.raises(ValueError):
        Policy(kept_ops=["aten::tanh", "c10d::allreduce_"], kept_units=["attn"])
    # The thread's key sets and units are checked by the autouse fixture; an audit shows no op ran.
    with sac_plugin.audit() as audit:
        pass
    assert audit.rows() == []


# --- every_nth_op ---------------------------------------------------------------------------------


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
            f"recompute config: every_nth_op['aten::mm'] must be an int from 1 to 2**63 - 1 (2 keeps every other "
            f"call), got {n} (int)"
        )
    assert RecomputeConfig(every_nth_op={"aten::mm": 2**63 - 1}).every_nth_op == {"aten::mm": 2**63 - 1}


# --- kept_calls: exactly the listed calls of an op ------------------------------------------------


def _five_matmuls(weights, x):
    for w in weights:
        x = torch.tanh(x @ w)
    return x


def _run(policy):
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(5)]
    reference = [w.detach().clone().requires_grad_() for w in weights]
    x = torch.randn(4, 8)
    with sac_plugin.audit() as audit:
        checkpoint(
            _five_matmuls, weights, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy)
        ).sum().backward()
    _five_matmuls(reference, x).sum().backward()
    for w, r in zip(weights, reference):
        assert torch.equal(w.grad, r.grad)
    return audit


@pytest.mark.parametrize("indices", [[0], [1, 3], [0, 2, 4], [4, 3, 3], [7]])
def test_kept_calls_keep_exactly_the_listed_calls(indices):
    audit = _run(Policy(kept_calls={"aten::mm.default": indices}))
    kept = len({i for i in indices if i < 5})
    assert audit.hits("aten::mm") == kept
    assert audit.count("aten::mm", phase="forward") == 5
    assert audit.count("aten::mm", phase="recompute") == 5 - kept
    assert audit.count("aten::tanh", phase="recompute") == 5


def test_kept_calls_are_read_back_sorted_and_merged():
    policy = Policy(kept_calls={torch.ops.aten.mm.default: [5, 0, 2, 2], "aten::tanh": []})
    assert policy.kept_calls == {"aten::mm": (0, 2, 5)}
    assert not policy.keeps_nothing
    assert Policy(kept_calls={"aten::tanh": []}).keeps_nothing
    assert policy == Policy(kept_calls={"aten::mm.default": (0, 2, 5)})
    assert policy != Policy(kept_calls={"aten::mm.default": (0, 2)})
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert repr(policy) == "Policy(kept_ops=[], kept_units=[], kept_calls={'aten::mm.default': [0, 2, 5]})"


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: Policy(kept_calls=[("aten::mm", [0])]),
            TypeError,
            "sac_plugin: kept_calls must be a mapping from op to call indices such as {'aten::mm.default': [0, 2]}, got "
            "[('aten::mm', [...])] (list)",
        ),
        (
            lambda: Policy(kept_calls={"aten::mm": 0}),
            TypeError,
            "sac_plugin: kept_calls['aten::mm'] must be a collection of 0-based call indices such as [0, 2], got 0 (int)",
        ),
        (
            lambda: Policy(kept_calls={"aten::mm": [-1]}),
            ValueError,
            "sac_plugin: kept_calls['aten::mm']: a call index is an int from 0 to 2**63 - 1 (0 is the op's first call in "
            "the region), got -1 (int)",
        ),
        (
            lambda: Policy(kept_calls={"aten::mm": [1.0]}),
            TypeError,
            "sac_plugin: kept_calls['aten::mm']: a call index is an int from 0 to 2**63 - 1 (0 is the op's first call in "
            "the region), got 1.0 (float)",
        ),
        (lambda: Policy(kept_calls={"aten::not_an_op": [0]}), ValueError, "sac: kept_calls: "),
        (
            lambda: Policy(kept_calls={"aten::add_.Tensor": [0]}),
            ValueError,
            "sac: kept_calls: 'aten::add_.Tensor' names aten::add_.Tensor, which mutates an input",
        ),
        (
            lambda: Policy(kept_calls={"aten::bernoulli.default": [0]}),
            ValueError,
            "sac: kept_calls: 'aten::bernoulli.default' names aten::bernoulli, which is a random op",
        ),
        (
            lambda: Policy(kept_ops=["aten::mm"], kept_calls={"aten::mm.default": [0]}),
            ValueError,
            "sac: kept_calls: 'aten::mm.default' names aten::mm, which kept_ops already names; give each op one rule "
            "(kept_ops, every_nth_op or kept_calls)",
        ),
        (
            lambda: Policy(every_nth_op={"aten::mm": 2}, kept_calls={"aten::mm.default": [0]}),
            ValueError,
            "sac: kept_calls: 'aten::mm.default' names aten::mm, which every_nth_op already names; give each op one rule "
            "(kept_ops, every_nth_op or kept_calls)",
        ),
    ],
)
def test_bad_kept_calls_are_refused_by_name(make, error, message):
    with pytest.raises(error) as raised:
        make()
    assert str(raised.value).startswith(message), str(raised.value)


# --- a call inside a recomputed unit takes no every-nth or kept-calls index -----------------------


def _four_matmuls_around_a_gate(weights, gate_weight, x):
    h = torch.tanh(x @ weights[0])  # mm index 0: kept
    with recompute_unit("gate"):
        g = torch.tanh(h @ gate_weight)  # forced recompute: takes no index
    for w in weights[1:]:  # mm indices 1 (recomputed), 2 (kept), 3 (recomputed)
        h = torch.tanh(h @ w)
    # mul saves both operands, so the recompute runs to the end and reaches every matmul.
    return h * g


def _run_around_a_gate(policy):
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(4)]
    gate_weight = torch.randn(8, 8, requires_grad=True)
    reference = [w.detach().clone().requires_grad_() for w in [*weights, gate_weight]]
    x = torch.randn(4, 8)
    with sac_plugin.audit() as audit:
        out = checkpoint(
            _four_matmuls_around_a_gate,
            weights,
            gate_weight,
            x,
            use_reentrant=False,
            context_fn=sac_plugin.context_fn(policy),
        )
        out.sum().backward()
    _four_matmuls_around_a_gate(reference[:4], reference[4], x).sum().backward()
    for param, ref in zip([*weights, gate_weight], reference):
        assert torch.equal(param.grad, ref.grad)
    return audit


def test_every_nth_skips_calls_in_a_recomputed_unit():
    audit = _run_around_a_gate(Policy(every_nth_op={"aten::mm": 2}, recomputed_units=["gate"]))
    # Counting the gate's call too would keep indices 0, 2 and 4 of five: the 1st, 3rd and 4th
    # non-gate matmuls (3 hits, 2 recomputed).
    assert audit.hits("aten::mm") == 2
    assert audit.count("aten::mm", phase="recompute") == 3  # the gate's, the 2nd and 4th
    assert audit.count("aten::mm", phase="forward") == 5


def test_kept_calls_skip_calls_in_a_recomputed_unit():
    # Index 1 is the second matmul outside the gate; counting the gate's call would make it the gate.
    audit = _run_around_a_gate(Policy(kept_calls={"aten::mm.default": [1]}, recomputed_units=["gate"]))
    assert audit.hits("aten::mm") == 1
    assert audit.count("aten::mm", phase="recompute") == 4


def test_without_a_recomputed_unit_every_call_counts():
    audit = _run_around_a_gate(Policy(every_nth_op={"aten::mm": 2}))
    assert audit.hits("aten::mm") == 3  # indices 0, 2, 4 of five, the gate's the second
    assert audit.count("aten::mm", phase="recompute") == 2


def test_the_library_takes_a_policys_fields_by_name():
    fields = dict(
        kept_ops=["aten::mm.default"],
        kept_units=[],
        every_nth_op={"aten::tanh.default": 2},
        recomputed_units=[],
        kept_calls={"aten::relu.default": [0, 2]},
        offloaded_ops=[],
        offloaded_units=[],
        offloaded_calls={},
        offload_min_bytes=1,
        host_memory_limit=-1,
        pin_routing=True,
    )
    with pytest.raises(TypeError) as missing:
        _native.C.Policy(**fields)
    assert str(missing.value) == "sac: Policy() is missing the field 'offload_inputs' (every field is passed by name)"
    with pytest.raises(TypeError, match=r"^Policy\(\) takes no positional arguments$"):
        _native.C.Policy(*fields.values(), True)
    with pytest.raises(TypeError) as not_a_flag:
        _native.C.Policy(**fields, offload_inputs=1)
    assert str(not_a_flag.value) == "sac: offload_inputs must be True or False"
    handle = _native.C.Policy(**fields, offload_inputs=True)
    assert handle.kept_calls() == (["aten::relu"], [2], [0, 2])
    assert handle.every_nth_op() == (["aten::tanh"], [2])
    assert handle.offload_inputs() is True
