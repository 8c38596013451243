"""torch.compile: the same selection in compiled and eager code.

Graph-level proofs use a capturing backend that runs AOTAutograd with the min-cut partitioner
Inductor uses, and inspect the joint graph's tags and the partitioned backward graph: a kept op
is tagged MUST_SAVE and does not reappear in the backward graph; a recomputed op does. Runs under
Inductor check that nothing breaks the graph and that gradients match.

Compiled gradients are compared with a tolerance: Inductor fuses pointwise ops and reorders
reductions, so its float rounding differs from eager's. Where both sides run the same compiled
code, with and without checkpointing, they are compared bitwise.
"""

import copy

import pytest
import sac_plugin
import torch
from sac_plugin import Policy, in_recompute_unit, recompute_unit
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

pytestmark = pytest.mark.slow

COMPILED_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


class Layer(nn.Module):
    """attn unit: a Linear and a tanh; then a Linear and a sin outside any unit."""

    def __init__(self, dim=16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x):
        with recompute_unit("attn"):
            h = torch.tanh(self.a(x))
        return torch.sin(self.b(h))


class DecoratedLayer(Layer):
    @in_recompute_unit("attn")
    def attention(self, x):
        return torch.tanh(self.a(x))

    def forward(self, x):
        return torch.sin(self.b(self.attention(x)))


def capture_graphs():
    """A backend recording the joint graph's recompute tags and the partitioned graphs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    seen = {"tags": {}, "fw": None, "bw": None}

    def partition(joint, inputs, **kwargs):
        for node in joint.graph.nodes:
            if node.op == "call_function" and "recompute" in node.meta:
                seen["tags"].setdefault(str(node.target), set()).add(node.meta["recompute"])
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    def keep(kind):
        def compiler(graph, inputs):
            seen[kind] = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
            return make_boxed_func(graph.forward)

        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition)

    return backend, seen


def compiled_graphs(layer_class, policy):
    torch.manual_seed(0)
    layer = sac_plugin.apply_selective_checkpointing(layer_class(), policy)
    backend, seen = capture_graphs()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    compiled(torch.randn(4, 16, requires_grad=True)).sum().backward()
    return seen


def test_full_recompute_recomputes_everything():
    seen = compiled_graphs(Layer, Policy())
    assert seen["bw"].count("aten.addmm.default") == 2
    assert "aten.tanh.default" in seen["bw"]


@pytest.mark.parametrize("layer_class", [Layer, DecoratedLayer])
@pytest.mark.parametrize(
    "policy",
    [Policy(kept_ops=["aten::tanh", "aten::addmm"]), Policy(kept_units=["attn"])],
    ids=["kept_ops", "kept_units"],
)
def test_kept_selection_is_saved_in_the_partitioned_graph(layer_class, policy):
    seen = compiled_graphs(layer_class, policy)
    assert CheckpointPolicy.MUST_SAVE in seen["tags"]["aten.tanh.default"]
    assert "aten.tanh.default" not in seen["bw"]
    if policy.kept_units:
        # a's addmm is in the unit (saved); b's is not (recomputed for sin's backward).
        assert seen["bw"].count("aten.addmm.default") == 1
        assert seen["tags"]["aten.addmm.default"] == {CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE}
    else:
        assert "aten.addmm.default" not in seen["bw"]
    assert "aten.sin.default" not in seen["fw"] or "aten.cos.default" in seen["bw"]


@pytest.mark.parametrize(
    "policy",
    [Policy(offloaded_ops=["aten::tanh"]), Policy(offloaded_units=["attn"])],
    ids=["offloaded_ops", "offloaded_units"],
)
def test_offloaded_calls_are_saved_where_the_compiler_does_not_offload(policy):
    # NOTE: [Offloaded calls under torch.compile]: without torch's activation offloading, an
    # offloaded call is tagged MUST_SAVE, as kept.
    seen = compiled_graphs(Layer, policy)
    assert seen["tags"]["aten.tanh.default"] == {CheckpointPolicy.MUST_SAVE}
    assert "aten.tanh.default" not in seen["bw"]


def test_offloaded_calls_are_tagged_for_offload_where_the_compiler_offloads():
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    layer = sac_plugin.apply_selective_checkpointing(Layer(), Policy(offloaded_ops=["aten::tanh"]))
    tags = {}

    def backend(gm, inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def partition(joint, joint_inputs, **kwargs):
            for node in joint.graph.nodes:
                if node.op == "call_function" and "recompute" in node.meta:
                    tags.setdefault(str(node.target), set()).add(node.meta["recompute"])
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        return aot_module_simplified(
            gm,
            inputs,
            fw_compiler=lambda g, _: make_boxed_func(g.forward),
            bw_compiler=lambda g, _: make_boxed_func(g.forward),
            partition_fn=partition,
        )

    torch._dynamo.reset()
    with functorch_config.patch(enable_activation_offloading=True):
        torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert tags["aten.tanh.default"] == {CheckpointPolicy.MUST_CPU_OFFLOAD}


def test_recomputed_unit_wins_under_compile():
    seen = compiled_graphs(Layer, Policy(kept_ops=["aten::tanh"], recomputed_units=["attn"]))
    assert seen["tags"]["aten.tanh.default"] == {CheckpointPolicy.MUST_RECOMPUTE}
    assert "aten.tanh.default" in seen["bw"]


def test_every_other_matmul_under_compile():
    class FourMatmuls(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(torch.randn(16, 16) * 0.1) for _ in range(4))

        def forward(self, x):
            for w in self.weights:
                x = torch.tanh(x @ w)
            return x

    seen = compiled_graphs(FourMatmuls, Policy(every_nth_op={"aten::mm": 2}))
    assert seen["tags"]["aten.mm.default"] == {CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE}


def test_same_selection_as_eager():
    """The ops the compiled backward recomputes are the ops the eager recompute runs."""
    policy = Policy(kept_units=["attn"])
    seen = compiled_graphs(Layer, policy)
    torch.manual_seed(0)
    layer = sac_plugin.apply_selective_checkpointing(Layer(), policy)
    with sac_plugin.audit() as audit:
        layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
    eager_recomputed = {row.op for row in audit.rows() if row.recompute and row.op in ("aten::addmm", "aten::tanh")}
    compiled_recomputed = {
        op.replace("aten.", "aten::").replace(".default", "")
        for op in seen["bw"]
        if op in ("aten.addmm.default", "aten.tanh.default")
    }
    assert eager_recomputed == compiled_recomputed == {"aten::addmm"}


def test_fullgraph_inductor_has_no_graph_break():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    layer = Layer()
    reference = copy.deepcopy(layer)
    sac_plugin.apply_selective_checkpointing(layer, Policy(kept_ops=["aten::addmm"], kept_units=["attn"]))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for p, q in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **COMPILED_TOLERANCE)


def test_compiled_submodule_inside_an_eager_checkpointed_layer():
    torch.manual_seed(0)
    layer = Layer()
    reference = copy.deepcopy(layer)
    compiled_only = copy.deepcopy(layer)
    torch._dynamo.reset()
    # b runs after the unit: the unit's addmm and tanh stay eager. (Outputs of compiled code are
    # made outside the dispatcher, so the data flow cannot name them, and an eager op that reads
    # one is recomputed rather than served: see NOTE: [Matching kept calls by data flow].)
    layer.b = torch.compile(layer.b, backend="inductor")
    compiled_only.b = torch.compile(compiled_only.b, backend="inductor")
    sac_plugin.apply_selective_checkpointing(layer, Policy(kept_units=["attn"]))
    x = torch.randn(4, 16)
    with sac_plugin.audit() as audit:
        layer(x).sum().backward()
    compiled_only(x).sum().backward()
    reference(x).sum().backward()
    # The eager region still intercepts: the unit's addmm and tanh are served in the recompute.
    assert audit.hits("aten::tanh") == 1 and audit.hits("aten::addmm") == 1
    for p, c, r in zip(layer.parameters(), compiled_only.parameters(), reference.parameters()):
        assert torch.equal(p.grad, c.grad)  # the same compiled code, with and without checkpointing
        torch.testing.assert_close(p.grad, r.grad, **COMPILED_TOLERANCE)


def test_eager_checkpointed_layer_inside_a_compiled_model():
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer())
    reference = copy.deepcopy(model)
    eager_layer = sac_plugin.apply_selective_checkpointing(model[1], Policy(kept_units=["attn"]))
    eager_layer.forward = torch.compiler.disable(eager_layer.forward)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    x = torch.randn(4, 16)
    with sac_plugin.audit() as audit:
        compiled(x).sum().backward()
    reference(x).sum().backward()
    assert audit.hits("aten::tanh") == 1  # the eager layer's unit, served by the plugin
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **COMPILED_TOLERANCE)


def test_config_units_survive_compilation():
    """A config's units under torch.compile: KeptOps by name, KeptCallables through the unit
    metadata their wrappers write."""
    from sac_plugin import RecomputeConfig, apply_recompute_config
    from sac_plugin.models import LlamaBlock, rotary_tables
    from sac_plugin.models import LLAMA_TARGETS

    torch.manual_seed(0)
    block = LlamaBlock(32, 4)
    apply_recompute_config(
        block, RecomputeConfig(kept_units=["attn", "mlp"]), target_map=LLAMA_TARGETS, wrap_sites=[block]
    )
    cos, sin = rotary_tables(8, 16)
    backend, seen = capture_graphs()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    compiled(torch.randn(1, 16, 32, requires_grad=True), cos, sin).sum().backward()
    attention = [op for op in seen["tags"] if "scaled_dot_product" in op and "backward" not in op]
    assert attention and all(seen["tags"][op] == {CheckpointPolicy.MUST_SAVE} for op in attention)
    assert CheckpointPolicy.MUST_SAVE in seen["tags"]["aten.silu.default"]  # inside the "mlp" unit
    assert "aten.silu.default" not in seen["bw"]


def test_compiled_policy_reads_the_fallbacks_classification():
    from sac_plugin._call_facts import op_traits as _op_traits

    assert _op_traits(torch.ops.aten.add_.Tensor) == (False, False, False, True, False, -1, False)
    assert _op_traits(torch.ops.aten._to_copy.default).copy_cast is True
    assert _op_traits(torch.ops._c10d_functional.all_reduce.default)[0] is True
    assert _op_traits(torch.ops.aten.sym_size.int)[1] is True  # metadata query: never counted
    with pytest.raises(ValueError, match=r"op_traits needs one overload such as 'aten::mm.default', got 'aten::mm'"):
        sac_plugin._C.op_traits("aten::mm")


class RegionLayer(nn.Module):
    """A torch_remat region around a Linear and a tanh, then a Linear and a sin outside it; or the
    same code in a recompute_unit of the same name."""

    def __init__(self, recompute=None, dim=16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.recompute = recompute

    def core(self, x):
        return torch.tanh(self.a(x))

    def forward(self, x):
        if self.recompute is None:
            with recompute_unit("attn.core"):
                h = self.core(x)
        else:
            import torch_remat

            h = torch_remat.region(self.core, "attn.core", recompute=self.recompute)(x)
        return torch.sin(self.b(h))


@pytest.mark.parametrize(
    "policy, recompute, kept",
    [
        (Policy(kept_units=["attn.core"]), True, True),
        (Policy(kept_units=["attn.*"]), True, True),
        (Policy(kept_units=["attn.core"]), None, True),
        (Policy(kept_ops=["aten::sin"]), False, True),
        (Policy(kept_ops=["aten::sin"]), True, False),
        (Policy(kept_ops=["aten::sin"], recomputed_units=["attn.core"]), False, False),
        (Policy(), False, False),
    ],
    ids=["kept_by_name", "kept_by_pattern", "recompute_unit", "flag_keeps", "flag_recomputes", "list_wins", "full"],
)
def test_torch_remat_regions_compile_as_eager_keeps_them(policy, recompute, kept):
    """A region the eager policy keeps (named in kept_units, or recompute=False where no list names
    it) is MUST_SAVE in the compiled graph, as a recompute_unit of the same name is."""
    pytest.importorskip("torch_remat")
    layer = RegionLayer(recompute)
    x = torch.randn(4, 16)
    with sac_plugin.audit() as audit:
        sac_plugin.apply_selective_checkpointing(copy.deepcopy(layer), policy)(x.requires_grad_()).sum().backward()
    assert (audit.hits("aten::tanh") == 1) == kept  # what eager keeps

    seen = compiled_graphs(lambda: layer, policy)
    tanh = seen["tags"]["aten.tanh.default"]
    if kept:
        assert tanh == {CheckpointPolicy.MUST_SAVE}
        assert "aten.tanh.default" not in seen["bw"]
    else:
        assert CheckpointPolicy.MUST_SAVE not in tanh
        assert "aten.tanh.default" in seen["bw"]
