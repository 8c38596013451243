"""The invariants no policy overrides: collectives, random ops, mutation, and the exact errors."""

import copy
import logging
import warnings

import pytest
import sac_plugin
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from sac_plugin import Policy, _compat, recompute_unit
from torch import nn
from torch.utils.checkpoint import checkpoint
from support.toy_models import observed_regions, assert_same_gradients, make_pair

COLLECTIVE_REFUSAL = (
    "sac: kept_ops: '{spelling}' names {name}, which is a collective; collectives are never kept, "
    "because the recompute must run them again on every rank"
)


@pytest.mark.parametrize(
    "spelling,name",
    [
        ("c10d::allreduce_", "c10d::allreduce_"),
        ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce"),
        ("_c10d_functional_autograd::all_to_all_single", "_c10d_functional_autograd::all_to_all_single"),
    ],
)
def test_keeping_a_collective_is_refused_at_declaration(spelling, name):
    with pytest.raises(ValueError) as error:
        Policy(kept_ops=[spelling])
    assert str(error.value) == COLLECTIVE_REFUSAL.format(spelling=spelling, name=name)


def test_random_and_mutating_ops_are_refused_at_declaration():
    with pytest.raises(ValueError, match=r"names aten::bernoulli_\.float, which is a random op"):
        Policy(kept_ops=["aten::bernoulli_.float"])
    with pytest.raises(ValueError, match=r"names aten::mul_\.Tensor, which mutates an input"):
        Policy(kept_ops=[torch.ops.aten.mul_.Tensor])


# --- mutation ---------------------------------------------------------------------------


def _layer_mutating_in_unit(weight, x):
    with recompute_unit("attn"):
        h = x @ weight
        h.mul_(2)  # mm saves its inputs, not its output: autograd allows this write
        h = torch.tanh(h)
    return h.sin()


def test_mutating_op_in_kept_unit_is_said_once_at_info_and_is_recomputed(caplog):
    # Recomputed by design (NOTE: [What the rule recomputes by design is logged, not warned]):
    # nothing the user can act on, so no warning.
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    weight_ref = weight.detach().clone().requires_grad_()
    x = torch.randn(4, 8)
    fn = sac_plugin.context_fn(Policy(kept_units=["attn"]))
    caplog.set_level(logging.INFO, logger="sac_plugin")
    with warnings.catch_warnings(record=True) as caught, sac_plugin.audit() as audit:
        warnings.simplefilter("always")
        h = x
        for _ in range(2):
            h = checkpoint(_layer_mutating_in_unit, weight, h, use_reentrant=False, context_fn=fn)
        h.sum().backward()
    assert [str(w.message) for w in caught if "sac:" in str(w.message)] == []
    assert [record.getMessage() for record in caplog.records if "mutates" in record.getMessage()] == [
        "sac: aten::mul_.Tensor mutates an input inside kept unit 'attn'; it is recomputed rather than kept "
        "(said once per checkpoint site)"
    ]
    h_ref = x
    for _ in range(2):
        h_ref = _layer_mutating_in_unit(weight_ref, h_ref)
    h_ref.sum().backward()
    assert torch.equal(weight.grad, weight_ref.grad)
    # mm's output, kept, is written by mul_: the region holds its value from before the write and
    # serves it, and the recompute runs mul_ on it again.
    assert audit.count("aten::mul_.Tensor", phase="recompute") == 2
    assert audit.count("aten::mm", phase="recompute") == 0
    assert audit.hits("aten::mm") == 2
    assert audit.hits("aten::tanh") == 2


def test_a_second_policy_says_it_again(caplog):
    x = torch.randn(4, 8)
    caplog.set_level(logging.INFO, logger="sac_plugin")
    for _ in range(2):
        weight = torch.randn(8, 8, requires_grad=True)
        fn = sac_plugin.context_fn(Policy(kept_units=["attn"]))
        caplog.clear()
        checkpoint(_layer_mutating_in_unit, weight, x, use_reentrant=False, context_fn=fn).sum().backward()
        assert sum("aten::mul_.Tensor mutates" in record.getMessage() for record in caplog.records) == 1


def test_kept_tensor_mutated_after_the_forward_is_an_error_naming_the_op():
    weight = torch.randn(8, 8, requires_grad=True)

    def attention(x):
        with recompute_unit("attn"):
            a = torch.tanh(x @ weight)
        return a.sin(), a

    out, kept = checkpoint(
        attention, torch.randn(4, 8), use_reentrant=False, context_fn=sac_plugin.context_fn(Policy(kept_units=["attn"]))
    )
    with torch.no_grad():
        kept.add_(1)
    with pytest.raises(RuntimeError) as error:
        out.sum().backward()
    assert (
        "sac: a tensor kept for backward was mutated after it was saved: the output of aten::tanh (kept in unit "
        "'attn'), call 1 of this region, changed version from 0 to 1. The recompute would read the mutated value; "
        "clone it before mutating in place, or do not keep aten::tanh"
    ) in str(error.value)


def _writes_in_kept_unit(weight, x):
    h = (x @ weight) * 2  # made outside the unit: not kept, so the write below preserves nothing
    with recompute_unit("write"):
        h.add_(1)
        h = h.sin()
    return h.cos()


# Said as a sentence for the user: no "(Triggered internally at <build path>...)" tail.
def test_the_mutating_op_message_is_exactly_its_sentence(caplog):
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    fn = sac_plugin.context_fn(Policy(kept_units=["write"]))
    caplog.set_level(logging.INFO, logger="sac_plugin")
    for _ in range(2):
        checkpoint(_writes_in_kept_unit, weight, x, use_reentrant=False, context_fn=fn).sum().backward()
    assert [(record.name, record.levelno, record.getMessage()) for record in caplog.records] == [
        (
            "sac_plugin",
            logging.INFO,
            "sac: aten::add_.Tensor mutates an input inside kept unit 'write'; it is recomputed rather than kept "
            "(said once per checkpoint site)",
        )
    ]
    reference = weight.detach().clone().requires_grad_()
    _writes_in_kept_unit(reference, x).sum().backward()
    assert torch.equal(weight.grad, 2 * reference.grad)


# --- collectives inside a kept unit (gloo, one rank) -------------------------------------


@pytest.fixture
def gloo_one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _layer_with_collectives(weight, x, group):
    with recompute_unit("attn"):
        h = torch.tanh(x @ weight)
        scale = h.detach().abs().mean()
        dist.all_reduce(scale, group=group)  # in place: c10d::allreduce_
        total = funcol.all_reduce(h.detach().sum(), "sum", group)  # _c10d_functional::all_reduce
        h = h * scale + total
    return h.sin()


def test_collectives_inside_a_kept_unit_are_never_served(gloo_one_rank):
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    weight_ref = weight.detach().clone().requires_grad_()
    x = torch.randn(4, 8)
    fn = sac_plugin.context_fn(Policy(kept_units=["attn"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # allreduce_ mutates its input: warned, tested above
        with sac_plugin.audit() as audit:
            checkpoint(
                _layer_with_collectives, weight, x, gloo_one_rank, use_reentrant=False, context_fn=fn
            ).sum().backward()
    _layer_with_collectives(weight_ref, x, gloo_one_rank).sum().backward()
    assert torch.equal(weight.grad, weight_ref.grad)
    # The wait runs inside AsyncCollectiveTensor's handler, unseen where that is below the plugin.
    waits = () if _compat.python_handlers_run_below_the_plugin() else ("_c10d_functional::wait_tensor",)
    for collective in ("c10d::allreduce_", "_c10d_functional::all_reduce", *waits):
        assert audit.count(collective, phase="forward") == 1, collective
        assert audit.hits(collective) == 0, collective
    # The in-place all-reduce writes what the kept mul reads: it runs again. The functional one's
    # result only feeds the kept add, which is served: nothing the backward needs reads it, so the
    # recompute skips it (NOTE: [The recompute runs only what backward needs]), where the engine
    # sees it.
    assert audit.count("c10d::allreduce_", phase="recompute") == 1
    functional = ("_c10d_functional::all_reduce", *waits)
    skips = sac_plugin.engine() == "native" and not _compat.python_handlers_run_below_the_plugin()
    for collective in functional:
        assert (audit.count(collective, phase="recompute"), audit.skipped(collective)) == (
            (0, 1) if skips else (1, 0)
        ), collective
    assert audit.hits("aten::tanh") == 1


# --- thread-local state ------------------------------------------------------------------


def _include_set():
    return repr(torch._C._dispatch_tls_local_include_set())


@pytest.mark.native_engine("the dispatch key and the C++ regions are the native engine's mechanism")
def test_key_is_included_only_inside_the_region():
    seen = []

    def layer(x):
        seen.append(_include_set())
        return torch.tanh(x)

    before = _include_set()
    checkpoint(
        layer,
        torch.randn(3, requires_grad=True),
        use_reentrant=False,
        context_fn=sac_plugin.context_fn(Policy(kept_ops=["aten::tanh"])),
    ).sum().backward()
    assert "Fake" not in before
    assert all("Fake" in s for s in seen) and len(seen) == 2  # forward and recompute
    assert _include_set() == before


@pytest.mark.native_engine("the dispatch-mode engine intercepts through its mode, never the key")
def test_nothing_kept_installs_no_interception_once_the_layer_is_seen_to_write_nothing_outside_itself():
    """The first step of a full-recompute site is intercepted, to find out whether the layer writes
    outside state (NOTE: [The recompute writes nothing outside its region]); later ones are not."""
    seen = []

    def layer(x):
        seen.append("Fake" in _include_set())
        return torch.tanh(x)

    context_fn = sac_plugin.context_fn(Policy())
    for _ in range(2):
        checkpoint(
            layer, torch.randn(3, requires_grad=True), use_reentrant=False, context_fn=context_fn
        ).sum().backward()
    assert seen == [True, True, False, False]


def test_state_is_restored_after_an_exception_inside_a_unit_inside_a_region():
    before = (_include_set(), sac_plugin.open_units())

    def layer(x):
        with recompute_unit("attn"):
            torch.tanh(x)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        checkpoint(
            layer,
            torch.randn(3, requires_grad=True),
            use_reentrant=False,
            context_fn=sac_plugin.context_fn(Policy(kept_units=["attn"])),
        )
    assert (_include_set(), sac_plugin.open_units()) == before


def test_other_threads_are_untouched_while_a_region_is_active(other_thread_state):
    outside = other_thread_state()
    inside = []

    def layer(x):
        inside.append(other_thread_state())
        return torch.tanh(x)

    checkpoint(
        layer,
        torch.randn(3, requires_grad=True),
        use_reentrant=False,
        context_fn=sac_plugin.context_fn(Policy(kept_ops=["aten::tanh"])),
    )
    assert inside == [outside]


def test_recompute_on_another_thread():
    # The recompute may run on an autograd worker thread (CUDA); emulate it with a thread that
    # runs the backward of a forward made here.
    import threading

    model, reference = make_pair(policy=Policy(kept_units=["attn"]))
    x = torch.randn(4, 16)
    loss = model(x).pow(2).mean()
    thread = threading.Thread(target=loss.backward)
    thread.start()
    thread.join()
    reference(x).pow(2).mean().backward()
    assert_same_gradients(model, reference)


# --- attention: tagged random for its dropout --------------------------------------------


def _attention(w, x, dropout_p):
    with recompute_unit("attn"):
        q = (x @ w).view(2, 1, 8, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True)
    return y.sin()


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_attention_is_kept_only_without_dropout(dropout_p):
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    x = torch.randn(2, 8, 4)
    fn = sac_plugin.context_fn(Policy(kept_units=["attn"]))
    with warnings.catch_warnings(record=True) as caught, sac_plugin.audit() as audit:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        checkpoint(_attention, w, x, dropout_p, use_reentrant=False, context_fn=fn).sum().backward()
    torch.manual_seed(1)
    _attention(w_ref, x, dropout_p).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)
    attention = "aten::_scaled_dot_product_flash_attention_for_cpu"
    if dropout_p == 0.0:
        assert audit.hits(attention) == 1 and audit.count(attention, phase="recompute") == 0
        assert not [w for w in caught if "sac:" in str(w.message)]
    else:
        # With dropout, CPU attention decomposes above autograd into math ops and draws its
        # mask with bernoulli_: drawn again in the recompute, never served.
        assert audit.count("aten::bernoulli_", phase="recompute") == 1
        assert audit.hits("aten::bernoulli_") == 0
        assert audit.count(attention) == 0


@pytest.mark.native_engine("the dispatch key and the C++ regions are the native engine's mechanism")
def test_kept_outputs_are_freed_by_the_backward_and_regions_are_collected():
    import gc

    from sac_plugin import checkpointing

    model, _ = make_pair(policy=Policy(kept_units=["attn"]))
    with observed_regions() as regions:
        out = model(torch.randn(4, 16))
        held = [region.kept_bytes for region in regions]
        out.pow(2).mean().backward()
    assert len(regions) == 2 and all(bytes_ > 0 for bytes_ in held)
    assert [region.kept_calls for region in regions] == [0, 0]
    assert [region.kept_bytes for region in regions] == [0, 0]
    del regions, out
    gc.collect()
    assert not any(isinstance(o, checkpointing.Region) for o in gc.get_objects())


@pytest.mark.native_engine("C++ regions are the native engine's mechanism")
def test_checkpointed_steps_free_their_regions_without_the_cycle_collector():
    # The hot path makes a region through a C call (NOTE: [Scopes as a C type]); the
    # Python objects that own it form no cycle, so it is freed as soon as the backward drops
    # torch's checkpoint frame, with the garbage collector off.
    import gc

    model, _ = make_pair(policy=Policy(kept_units=["attn"]))
    before = sac_plugin._C.live_regions()
    gc.disable()
    try:
        for _ in range(3):
            out = model(torch.randn(4, 16))
            assert sac_plugin._C.live_regions() == before + 2  # one per checkpointed layer, alive until backward
            out.pow(2).mean().backward()
            del out
            assert sac_plugin._C.live_regions() == before
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "write",
    [
        lambda y: torch.add(y, 1, out=y),
        lambda y: torch.sin(y, out=y),
        lambda y: y.add_(1),
        lambda y: y.copy_(y * 3),
    ],
    ids=["add out=", "sin out=", "add_", "copy_"],
)
def test_a_kept_output_written_in_the_forward_is_served_as_the_call_made_it(write):
    # NOTE: [Kept outputs written in the forward]: an out= argument is written as surely as an
    # in-place op's self, so the region holds a copy from before either write and serves it.
    torch.manual_seed(0)
    mask_source = torch.randn(8, 8)  # needs no grad: its matmul, kept, is written in the forward
    x = torch.randn(4, 8, requires_grad=True)

    def layer(inputs):
        y = torch.mm(mask_source, mask_source)
        write(y)
        return (inputs @ y).sin()

    expected = torch.autograd.grad(layer(x).sum(), x)[0]
    context_fn = sac_plugin.context_fn(Policy(kept_ops=["aten::mm"]))
    with sac_plugin.audit() as audit:
        out = checkpoint(layer, x, use_reentrant=False, context_fn=context_fn)
        got = torch.autograd.grad(out.sum(), x)[0]
    assert torch.equal(got, expected)
    assert audit.count("aten::mm", phase="recompute") == 0
    assert audit.hits("aten::mm") == 2  # the written one, from its copy, and inputs @ y
    # A backward that keeps its graph is served a copy of the copy: the recompute writes it again.
    out = checkpoint(layer, x, use_reentrant=False, context_fn=context_fn)
    first = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    assert torch.equal(first, expected) and torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)


@pytest.mark.native_engine("the native engine's regions learn which kept outputs the recompute never reaches")
def test_a_kept_output_the_recompute_never_reaches_is_released_and_then_not_kept():
    # NOTE: [Kept outputs the recompute never reaches]: the block's last Linear runs after the
    # region's last tensor saved for backward (its input, saved before it runs), so torch's early
    # stop ends the recompute before it: its kept output would be held for nothing.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    reference = copy.deepcopy(block)
    sac_plugin.apply_selective_checkpointing(block, Policy(kept_ops=["aten::addmm"]))
    held, hits = [], []
    for _ in range(3):
        x = torch.randn(4, 16, requires_grad=True)
        with observed_regions() as regions, sac_plugin.audit() as audit:
            out = block(x)
            held.append([(region.kept_calls, region.kept_bytes) for region in regions])
            out.sum().backward()
        hits.append(audit.hits("aten::addmm"))
        expected = reference(x.detach().requires_grad_())
        expected.sum().backward()
    # Step 1 keeps both addmm calls and frees the last one when the forward ends; later steps
    # do not keep it at all. The first is served every time.
    assert held == [[(1, 4 * 16 * 4)]] * 3
    assert hits == [1, 1, 1]
    for p, q in zip(block.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.native_engine("kept calls are read from the native engine's regions")
def test_early_stop_off_serves_every_kept_output():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    sac_plugin.apply_selective_checkpointing(block, Policy(kept_ops=["aten::addmm"]), early_stop=False)
    for _ in range(2):
        with observed_regions() as regions, sac_plugin.audit() as audit:
            out = block(torch.randn(4, 16, requires_grad=True))
            assert [region.kept_calls for region in regions] == [2]
            out.sum().backward()
        assert audit.hits("aten::addmm") == 2


def test_kept_outputs_sharing_a_written_storage_stay_aliased_through_a_backward_that_keeps_its_graph():
    # torch.matmul on 4-D inputs is a bmm whose output an _unsafe_view reshapes; a kept unit keeps
    # both, in one storage, and the mask is then added in place (as T5's attention does). Both are
    # served as views of one copy from before the write, and a backward that keeps its graph is
    # served a fresh copy, so the second backward sees the same values as the first.
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 8, requires_grad=True)
    mask = torch.randn(4, 4)

    def attention(q):
        with recompute_unit("attn"):
            scores = torch.matmul(q, q.transpose(-1, -2))
            scores += mask
            return torch.softmax(scores, dim=-1).sum()

    expected = torch.autograd.grad(attention(q), q)[0]
    context_fn = sac_plugin.context_fn(Policy(kept_units=["attn"]))
    with sac_plugin.audit() as audit:
        out = checkpoint(attention, q, use_reentrant=False, context_fn=context_fn)
        first = torch.autograd.grad(out, q, retain_graph=True)[0]
        second = torch.autograd.grad(out, q)[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert audit.hits("aten::bmm") == 2 and audit.hits("aten::_unsafe_view") == 2
    assert audit.count("aten::bmm", phase="recompute") == 0
