"""The per-layer report: counts, kept calls and kept bytes by checkpointed module and by unit, as
the audit and the regions see them; saved-for-backward storages by place; table and JSON."""

import json
import threading

import pytest
import sac_plugin
from sac_plugin import _observers
from sac_plugin._report import _TraceMode
import torch
from sac_plugin import RecomputeConfig, apply_recompute_config
from sac_plugin.models import Llama
from sac_plugin import Policy
from torch import nn

SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _model():
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, heads=4, layers=3, seq=16)
    apply_recompute_config(model, RecomputeConfig(units=["attn", "mlp"], every_nth_layer=2))  # layers 0 and 2
    return model


def test_layers_and_units_add_up_to_the_audit():
    model = _model()
    tokens = torch.randint(64, (2, 16))
    with sac_plugin.audit() as audit, sac_plugin.report(model) as report:
        model.loss(tokens, tokens).backward()
    assert list(report.layers) == ["layers.0", "layers.2"]
    for layer in report.layers.values():
        assert layer.calls == 1
        assert layer.ops[SDPA_CPU].hits == 1 and layer.ops[SDPA_CPU].recompute == 0
        unit = report.units[(layer.name, "mlp")]
        assert unit.calls == 1
        assert unit.ops["aten::silu"].forward == 1 and unit.ops["aten::mm"].forward == 3
    # The mlp unit keeps the w1, w3 and w2 matmuls, the three _unsafe_views that fold their outputs
    # back to 3-D (copies by schema, not views), silu and mul. w2 and its view run after the
    # layer's last tensor saved for backward: the policy's first forward (layers.0) finds that the
    # recompute never reaches them and frees them; layers.2 does not keep them (NOTE: [Kept outputs
    # the recompute never reaches]). The dispatch-mode engine does not learn this: it keeps them.
    expected = [8, 6] if sac_plugin.engine() == "native" else [8, 8]
    assert [report.units[(name, "mlp")].kept_calls for name in ("layers.0", "layers.2")] == expected
    # Per layer, the sum over layers is what the whole audit saw in the regions.
    for op in ("aten::mm", SDPA_CPU, "aten::silu"):
        assert sum(l.ops[op].hits for l in report.layers.values() if op in l.ops) == audit.hits(op)
        assert sum(l.ops[op].recompute for l in report.layers.values() if op in l.ops) == \
            audit.count(op, phase="recompute")
    data = json.loads(report.to_json())
    assert [layer["name"] for layer in data["layers"]] == ["layers.0", "layers.2"]
    assert data["layers"][0]["units"][0]["name"] == "mlp"
    assert data["totals"]["hits"] == sum(row.hits for row in audit.rows())
    table = report.table()
    assert table.splitlines()[0].split() == ["checkpointed", "module", "/", "unit", "calls", "fwd", "ops",
                                             "recomputed", "hits", "kept", "calls", "kept", "bytes"]
    assert "  unit mlp" in table and "saved for backward, by place (each storage once per life):" in table


@pytest.mark.native_engine("kept bytes are read from the native engine's regions")
def test_kept_bytes_by_layer_and_unit_match_the_regions():
    model = _model()
    tokens = torch.randint(64, (2, 16))
    regions = []

    class Regions(_observers.Observer):
        def region_created(self, region):
            regions.append(region)

    with _observers.observe(Regions()), sac_plugin.report(model) as report:
        loss = model.loss(tokens, tokens)
        held = [region.kept_bytes for region in regions]
        loss.backward()
    assert [layer.kept_bytes for layer in report.layers.values()] == held
    # mlp unit: w1, w3 outputs (2x16x128 fp32 = 16 KiB each), silu, mul (16 KiB each), w2 (4 KiB).
    assert report.units[("layers.0", "mlp")].kept_bytes == 4 * 16384 + 4096
    by_place = report.saved_bytes_by_place()
    assert by_place["layers.0"] == held[0] and by_place["layers.2"] == held[1]
    # Layer 1 is not checkpointed: autograd saves its activations, billed to its modules.
    assert any(place.startswith("(outside regions) layers.1") for place in by_place)
    for storage in report.saved_tensors():
        assert storage.nbytes > 0 and storage.tensors and all(isinstance(d, str) for _, d in storage.tensors)


def test_no_report_no_hooks():
    assert not _observers.observing()
    with sac_plugin.report():
        assert _observers.observing()
    assert not _observers.observing() and _observers.observers() == ()
    with pytest.raises(TypeError, match=r"^sac_plugin: report: model must be a torch.nn.Module or None, got 3 \(int\)$"):
        sac_plugin.report(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_oom_observer_needs_cuda():
    from sac_plugin._report import install_oom_observer

    with pytest.raises(RuntimeError) as error:
        install_oom_observer()
    assert str(error.value) == ("sac_plugin: install_oom_observer needs CUDA (torch.cuda.is_available() is False); "
                                "the OOM observer is a CUDA caching-allocator hook")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available: the OOM observer is a CUDA "
                                                          "caching-allocator hook")
def test_oom_observer_prints_the_report(capfd):
    from sac_plugin._report import install_oom_observer

    install_oom_observer()
    with sac_plugin.report():
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, device="cuda")
    assert "sac_plugin: CUDA out of memory on device" in capfd.readouterr().out


# --- the per-op trace (report(model, trace=True), sac_plugin.trace) ------------------------------

def needs_trace(test):
    test = pytest.mark.native_engine("the trace reads the native engine's regions; the dispatch-mode engine "
                                     "refuses it")(test)
    return pytest.mark.skipif(sac_plugin._compat.python_handlers_run_below_the_plugin(),
                              reason="the trace needs torch >= 2.13 (TorchDispatchModes above the plugin's key)")(test)


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with sac_plugin.recompute_unit("u"):
            return torch.tanh(self.lin(x))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.out = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        h = self.inner(x)
        return self.out(torch.sin(h) * h)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x).sum()


def _tiny(policy):
    torch.manual_seed(0)
    model = _Tiny()
    sac_plugin.apply_selective_checkpointing(model.block, policy)
    return model, torch.randn(3, 4, requires_grad=True)


# (module, unit, op, phase, status), in order. The recompute runs until autograd has saved its
# last tensor again (torch.utils.checkpoint stops there), so out's mm never runs twice.
TINY_FORWARD = [
    ("block.inner.lin", "u", "aten::t.default", "forward"),
    ("block.inner.lin", "u", "aten::addmm.default", "forward"),
    ("block.inner", "u", "aten::tanh.default", "forward"),
    ("block", "", "aten::sin.default", "forward"),
    ("block", "", "aten::mul.Tensor", "forward"),
    ("block.out", "", "aten::t.default", "forward"),
    ("block.out", "", "aten::mm.default", "forward"),
]
TINY_RECOMPUTE = [
    ("block.inner.lin", "u", "aten::t.default", "recompute"),
    ("block.inner.lin", "u", "aten::addmm.default", "recompute"),
    ("block.inner", "u", "aten::tanh.default", "recompute"),
    ("block", "", "aten::sin.default", "recompute"),
    ("block", "", "aten::mul.Tensor", "recompute"),
    ("block.out", "", "aten::t.default", "recompute"),
]


def _rows(report):
    return [(e.module, e.unit, e.op, e.phase, e.status) for e in report.trace]


@needs_trace
def test_trace_kept_ops_exact_sequence():
    model, x = _tiny(sac_plugin.Policy(kept_ops=["aten::tanh", "aten::mm"]))
    with sac_plugin.trace(model) as report:
        model(x).backward()
    kept = {"aten::tanh.default", "aten::mm.default"}
    assert _rows(report) == (
        [(*row, "kept" if row[2] in kept else "recomputed") for row in TINY_FORWARD]
        + [(*row, "served" if row[2] in kept else "recomputed") for row in TINY_RECOMPUTE])
    assert {e.layer for e in report.trace} == {"block"}


@needs_trace
def test_trace_kept_unit_and_full_recompute():
    model, x = _tiny(sac_plugin.Policy(kept_units=["u"]))
    with sac_plugin.report(model, trace=True) as report:
        model(x).backward()
    # The unit keeps addmm and tanh; t is a view (kept by no unit). Once tanh is served the
    # recompute has nothing more to serve, and torch's checkpoint still replays up to its last save.
    in_unit = {"aten::addmm.default", "aten::tanh.default"}
    assert _rows(report) == (
        [(*row, "kept" if row[2] in in_unit else "recomputed") for row in TINY_FORWARD]
        + [(*row, "served" if row[2] in in_unit else "recomputed") for row in TINY_RECOMPUTE])

    model, x = _tiny(sac_plugin.Policy())
    with sac_plugin.trace(model) as report:
        model(x).backward()
    assert _rows(report) == [(*row, "recomputed") for row in TINY_FORWARD + TINY_RECOMPUTE]


@needs_trace
def test_trace_table_json_and_no_change_to_results():
    policy = sac_plugin.Policy(kept_ops=["aten::tanh"])
    model, x = _tiny(policy)
    with sac_plugin.audit() as plain_audit:
        model(x).backward()
    plain = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model, x = _tiny(policy)
    with sac_plugin.audit() as traced_audit, sac_plugin.trace(model) as report:
        model(x).backward()
    traced = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    # What the regions ran and served is the same (the backward may differ: with a dispatch mode on,
    # autograd accumulates gradients out of place, add instead of add_).
    in_regions = lambda audit: [(r.op, r.forward, r.recompute, r.hits) for r in audit.rows()  # noqa: E731
                                if r.forward or r.recompute or r.hits]
    assert in_regions(plain_audit) == in_regions(traced_audit)
    table = report.trace_table().splitlines()
    assert table[0].split() == ["#", "layer", "module", "unit", "phase", "status", "op"]
    assert table[2].split() == ["0", "block", "block.inner.lin", "u", "forward", "recomputed", "aten::t.default"]
    assert table[4].split() == ["2", "block", "block.inner", "u", "forward", "kept", "aten::tanh.default"]
    assert table[11].split() == ["9", "block", "block.inner", "u", "recompute", "served", "aten::tanh.default"]
    data = json.loads(report.to_json())
    assert data["trace"][2] == {"layer": "block", "module": "block.inner", "unit": "u", "op": "aten::tanh.default",
                                "phase": "forward", "status": "kept"}
    assert len(data["trace"]) == len(TINY_FORWARD) + len(TINY_RECOMPUTE)


def test_no_trace_no_mode_and_no_trace_key():
    model, x = _tiny(sac_plugin.Policy(kept_ops=["aten::tanh"]))
    seen = []

    def forward_hook(module, args, output):
        modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
        seen.append(sum(isinstance(mode, _TraceMode) for mode in modes))

    handle = model.block.out.register_forward_hook(forward_hook)
    try:
        with sac_plugin.report(model) as report:
            model(x).backward()
    finally:
        handle.remove()
    assert seen == [0]  # no trace mode while a plain report runs
    assert report.trace == [] and "trace" not in report.to_dict()
    with pytest.raises(RuntimeError, match=r"^sac_plugin: this report was not asked for a trace"):
        report.trace_table()
    with pytest.raises(TypeError, match=r"^sac_plugin: report: trace must be a bool, got 1 \(int\)$"):
        sac_plugin.report(model, trace=1)
    with pytest.raises(TypeError, match=r"^sac_plugin: trace: model must be a torch.nn.Module or None"):
        sac_plugin.trace("model")


def test_profiler_attributes_allocations_to_the_checkpointed_module():
    from torch.profiler import ProfilerActivity, profile

    model, x = _tiny(sac_plugin.Policy(kept_units=["u"]))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, sac_plugin.report(model):
        model(x).backward()
    events = {e.key: e for e in prof.key_averages()}
    for scope in ("sac_plugin.forward: block", "sac_plugin.recompute: block", "sac_plugin.forward: block unit u"):
        assert events[scope].count == 1
    # Net bytes allocated in a scope (allocations minus frees; 3x4 fp32 = 48 bytes a tensor): the
    # forward leaves the unit's two kept outputs (addmm, tanh) and the block's output alive; sin's
    # and mul's outputs are freed (the checkpoint saves nothing). The unit scope: its two kept outputs.
    assert events["sac_plugin.forward: block"].cpu_memory_usage == 3 * 48
    assert events["sac_plugin.forward: block unit u"].cpu_memory_usage == 2 * 48
    # Without a report there is no such scope.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).backward()
    assert not [e for e in prof.key_averages() if e.key.startswith("sac_plugin.")]


@needs_trace
def test_trace_of_a_root_layer_names_its_submodules():
    # The checkpointed module is the report's model itself: named by its type, its submodules by
    # their qualified names, in the forward and in the recompute alike.
    model, x = _tiny(sac_plugin.Policy(kept_ops=["aten::tanh"]))
    block = model.block
    with sac_plugin.trace(block) as report:
        block(x).sum().backward()
    assert [(e.layer, e.module, e.phase) for e in report.trace] == (
        [("_Block", {"block.inner.lin": "inner.lin", "block.inner": "inner", "block": "_Block",
                     "block.out": "out"}[m], p) for m, _, _, p in TINY_FORWARD + TINY_RECOMPUTE])


# --- exact per step, bounded, nested, this thread's -------------------------------------------


class _TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.linear(x)).sin()


class _TinyStack(nn.Module):
    def __init__(self, policy):
        super().__init__()
        self.blocks = nn.ModuleList([_TinyBlock(), _TinyBlock()])
        for block in self.blocks:
            sac_plugin.apply_selective_checkpointing(block, policy)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _report_steps(model, steps):
    with sac_plugin.report(model) as rep:
        for _ in range(steps):
            model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    return rep


@pytest.mark.native_engine("kept bytes are read from the native engine's regions")
def test_a_report_over_n_steps_counts_n_times_one_step_and_identical_blocks_alike():
    torch.manual_seed(0)
    model = _TinyStack(Policy(kept_ops=["aten::addmm", "aten::tanh"]))
    one, five = _report_steps(model, 1), _report_steps(model, 5)
    assert (one.steps, five.steps) == (1, 5)
    kept_one = {name: layer.kept_bytes for name, layer in one.layers.items()}
    kept_five = {name: layer.kept_bytes for name, layer in five.layers.items()}
    assert kept_one["blocks.0"] == kept_one["blocks.1"] == 2 * 8 * 16 * 4
    assert kept_five == {name: 5 * value for name, value in kept_one.items()}
    assert five.saved_bytes_by_place() == {place: 5 * value for place, value in one.saved_bytes_by_place().items()}


def test_a_report_left_running_stays_bounded():
    torch.manual_seed(0)
    model = _TinyStack(Policy(kept_ops=["aten::addmm"]))
    with sac_plugin.report(model) as rep:
        for step in range(40):
            model(torch.randn(8, 16, requires_grad=True)).sum().backward()
            if step == 4:
                entries = len(rep._saved)
    assert len(rep._saved) == entries
    assert max(len(storage.tensors) for storage in rep._saved.values()) == 8
    assert sum(storage.count for storage in rep._saved.values()) == 40 * sum(
        storage.count for storage in _report_steps(model, 1)._saved.values())
    assert rep.steps == 40


def test_nested_reports_both_see_every_step_they_span():
    torch.manual_seed(0)
    model = _TinyStack(Policy(kept_ops=["aten::addmm"]))
    x = torch.randn(8, 16, requires_grad=True)
    with sac_plugin.report(model) as outer:
        model(x).sum().backward()
        with sac_plugin.report(model) as inner:
            model(x).sum().backward()
    assert {name: layer.calls for name, layer in outer.layers.items()} == {"blocks.0": 2, "blocks.1": 2}
    assert {name: layer.calls for name, layer in inner.layers.items()} == {"blocks.0": 1, "blocks.1": 1}
    assert {name: layer.kept_calls for name, layer in outer.layers.items()} == {"blocks.0": 2, "blocks.1": 2}


def test_a_report_shows_only_its_own_thread_s_layers_while_another_thread_trains():
    torch.manual_seed(0)
    model = _TinyStack(Policy(kept_ops=["aten::addmm"]))
    other = _TinyStack(Policy(kept_ops=["aten::addmm"]))
    stop = threading.Event()

    def train_other():
        while not stop.is_set():
            other(torch.randn(8, 16, requires_grad=True)).sum().backward()

    thread = threading.Thread(target=train_other)
    thread.start()
    try:
        rep = _report_steps(model, 3)
    finally:
        stop.set()
        thread.join()
    assert set(rep.layers) == {"blocks.0", "blocks.1"}
    assert {name: layer.calls for name, layer in rep.layers.items()} == {"blocks.0": 3, "blocks.1": 3}
    assert rep._modules == []
