"""The per-layer report: counts, kept calls and kept bytes by checkpointed module and by unit, as
the audit and the regions see them; saved-for-backward storages by place; table and JSON."""

import gc
import json
import sys
import threading
import weakref

import pytest
import sac_plugin
from sac_plugin import _observers
import torch
from sac_plugin import RecomputeConfig, apply_recompute_config
from sac_plugin.models import Llama
from sac_plugin import Policy
from torch import nn
from torch.utils.checkpoint import checkpoint
from support import toy_models
from support.accelerator import SKIP_REASON, runner_with_models

SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _model():
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, heads=4, layers=3, seq=16)
    apply_recompute_config(model, RecomputeConfig(kept_units=["attn", "mlp"], every_nth_layer=2))  # layers 0 and 2
    return model


def test_each_layer_learns_what_its_own_recompute_reaches():
    model = _model()
    tokens = torch.randint(64, (2, 16))
    model.loss(tokens, tokens).backward()  # the first forward of each layer's site is watched
    with sac_plugin.report(model) as report:
        model.loss(tokens, tokens).backward()
    # w2 and its view, after each layer's last save, are no longer held by either layer.
    assert [report.units[(name, "mlp")].kept_calls for name in ("layers.0", "layers.2")] == [6, 6]


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
    # layer's last tensor saved for backward: each layer's first forward (each is a checkpoint site
    # of its own) finds that the recompute never reaches them and frees them at its end (NOTE:
    # [Kept outputs the recompute never reaches], NOTE: [What a site learns]); both engines learn it.
    assert [report.units[(name, "mlp")].kept_calls for name in ("layers.0", "layers.2")] == [8, 8]
    # Per layer, the sum over layers is what the whole audit saw in the regions.
    for op in ("aten::mm", SDPA_CPU, "aten::silu"):
        assert sum(layer.ops[op].hits for layer in report.layers.values() if op in layer.ops) == audit.hits(op)
        assert sum(layer.ops[op].recompute for layer in report.layers.values() if op in layer.ops) == audit.count(
            op, phase="recompute"
        )
    data = json.loads(report.to_json())
    assert [layer["name"] for layer in data["layers"]] == ["layers.0", "layers.2"]
    assert data["layers"][0]["units"][0]["name"] == "mlp"
    assert data["totals"]["hits"] == sum(row.hits for row in audit.rows())
    table = report.table()
    assert table.splitlines()[0].split() == [
        "checkpointed",
        "module",
        "/",
        "unit",
        "calls",
        "fwd",
        "ops",
        "recomputed",
        "hits",
        "kept",
        "calls",
        "kept",
        "bytes",
        "fwd",
        "ms",
        "recompute",
        "ms",
        "never",
        "served",
    ]
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
    with pytest.raises(
        TypeError, match=r"^sac_plugin: report: model must be a torch.nn.Module or None, got 3 \(int\)$"
    ):
        sac_plugin.report(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_oom_observer_needs_cuda():
    from sac_plugin._oom import install_oom_observer

    with pytest.raises(RuntimeError) as error:
        install_oom_observer()
    assert str(error.value) == (
        "sac_plugin: install_oom_observer needs CUDA (torch.cuda.is_available() is False); "
        "the OOM observer is a CUDA caching-allocator hook"
    )


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available: the OOM observer is a CUDA caching-allocator hook"
)
def test_oom_observer_prints_the_report(capfd):
    from sac_plugin._oom import install_oom_observer

    install_oom_observer()
    with sac_plugin.report():
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, device="cuda")
    assert "sac_plugin: CUDA out of memory on device" in capfd.readouterr().out


# --- the per-op trace (report(model, trace=True), sac_plugin.trace) ------------------------------


def needs_trace(test):
    return pytest.mark.native_engine(
        "the trace reads the native engine's regions; the dispatch-mode engine refuses it"
    )(test)


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
    # addmm's output only feeds the kept tanh, which saves its own result: nothing the backward
    # needs reads it, so the recompute skips it (NOTE: [The recompute runs only what backward needs]).
    recompute = {**dict.fromkeys(kept, "served"), "aten::addmm.default": "skipped"}
    assert _rows(report) == (
        [(*row, "kept" if row[2] in kept else "recomputed") for row in TINY_FORWARD]
        + [(*row, recompute.get(row[2], "recomputed")) for row in TINY_RECOMPUTE]
    )
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
        + [(*row, "served" if row[2] in in_unit else "recomputed") for row in TINY_RECOMPUTE]
    )

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
    def in_regions(audit):
        return [(r.op, r.forward, r.recompute, r.hits) for r in audit.rows() if r.forward or r.recompute or r.hits]

    assert in_regions(plain_audit) == in_regions(traced_audit)
    table = report.trace_table().splitlines()
    assert table[0].split() == ["#", "layer", "module", "unit", "phase", "status", "op"]
    assert table[2].split() == ["0", "block", "block.inner.lin", "u", "forward", "recomputed", "aten::t.default"]
    assert table[4].split() == ["2", "block", "block.inner", "u", "forward", "kept", "aten::tanh.default"]
    assert table[11].split() == ["9", "block", "block.inner", "u", "recompute", "served", "aten::tanh.default"]
    data = json.loads(report.to_json())
    assert data["trace"][2] == {
        "layer": "block",
        "module": "block.inner",
        "unit": "u",
        "op": "aten::tanh.default",
        "phase": "forward",
        "status": "kept",
    }
    assert len(data["trace"]) == len(TINY_FORWARD) + len(TINY_RECOMPUTE)


def test_no_trace_no_mode_and_no_trace_key():
    model, x = _tiny(sac_plugin.Policy(kept_ops=["aten::tanh"]))
    seen = []

    def forward_hook(module, args, output):
        modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
        # The dispatch-mode engine's own modes aside, none.
        seen.append(
            sum(type(mode).__module__ not in ("sac_plugin._dispatch_mode", "torch.utils.checkpoint") for mode in modes)
        )

    handle = model.block.out.register_forward_hook(forward_hook)
    try:
        with sac_plugin.report(model) as report:
            model(x).backward()
        if sac_plugin.engine() == "native":
            with sac_plugin.trace(model):
                model(x).backward()
            seen.append("traced")
    finally:
        handle.remove()
    # No Python dispatch mode while a report runs, traced or not (NOTE: [The per-op trace is
    # recorded below Python]).
    assert seen == ([0, 0, "traced"] if sac_plugin.engine() == "native" else [0])
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
        [
            (
                "_Block",
                {"block.inner.lin": "inner.lin", "block.inner": "inner", "block": "_Block", "block.out": "out"}[m],
                p,
            )
            for m, _, _, p in TINY_FORWARD + TINY_RECOMPUTE
        ]
    )


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
        storage.count for storage in _report_steps(model, 1)._saved.values()
    )
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


def _layer_counts(rep):
    return sorted(
        (name, layer.calls, layer.total("forward"), layer.total("recompute"), layer.total("hits"))
        for name, layer in rep.layers.items()
    )


def _unit_counts(rep):
    return sorted(
        (layer, unit, b.calls, b.total("forward"), b.total("recompute"), b.total("hits"))
        for (layer, unit), b in rep.units.items()
    )


def test_nested_reports_with_units_count_exactly_their_own_steps():
    # Units open audits of their own in both reports: the inner report's close inside the outer's.
    model = _model()
    tokens = torch.randint(64, (2, 16))
    one = _report_model_steps(model, tokens, 1)
    with sac_plugin.report(model) as outer:
        _step(model, tokens)
        with sac_plugin.report(model) as inner:
            _step(model, tokens)
    assert _layer_counts(inner) == _layer_counts(one)
    assert _unit_counts(inner) == _unit_counts(one)
    assert inner.totals == one.totals
    assert _layer_counts(outer) == [(n, 2 * c, 2 * f, 2 * r, 2 * h) for n, c, f, r, h in _layer_counts(one)]
    assert _unit_counts(outer) == [(name, u, 2 * c, 2 * f, 2 * r, 2 * h) for name, u, c, f, r, h in _unit_counts(one)]
    assert [(r.op, r.forward, r.recompute, r.backward, r.hits) for r in outer.totals] == [
        (r.op, 2 * r.forward, 2 * r.recompute, 2 * r.backward, 2 * r.hits) for r in one.totals
    ]
    assert (outer.steps, inner.steps) == (2, 1)


def _step(model, tokens):
    model.zero_grad(set_to_none=True)  # every step's backward the same: no accumulation into .grad
    model.loss(tokens, tokens).backward()


def _report_model_steps(model, tokens, steps):
    with sac_plugin.report(model) as rep:
        for _ in range(steps):
            _step(model, tokens)
    return rep


@pytest.mark.parametrize(
    "trace",
    [False, pytest.param(True, marks=pytest.mark.native_engine("the per-op trace needs the native engine"))],
)
def test_a_report_left_open_by_a_thread_that_ends_is_closed_with_it(trace):
    from sac_plugin import _report

    models = [_model()]
    tokens = torch.randint(64, (2, 16))
    seen = {}

    def left_open():
        model = models[0]
        report = sac_plugin.report(model, trace=trace).__enter__()
        model.loss(tokens, tokens).backward()
        seen["registered"] = sum(isinstance(o, _report._ReportObserver) for o in _observers.registered)
        seen["report"] = weakref.ref(report)

    gc.disable()
    try:
        thread = threading.Thread(target=left_open)
        thread.start()
        thread.join()
        assert seen["registered"] == 1
        assert [o for o in _observers.registered if isinstance(o, _report._ReportObserver)] == []
        assert _report.running_reports == [] and not sac_plugin._audit.any_active()
        freed = weakref.ref(models.pop())
        assert freed() is None and seen["report"]() is None
    finally:
        gc.enable()


def test_reports_on_two_threads_training_at_once_count_their_own_calls():
    # Each thread trains its own copy of the model, both at once; each report reads what a
    # report of the same steps reads alone.
    tokens = torch.randint(64, (2, 16))
    alone = _report_model_steps(_model(), tokens, 4)
    models = [_model(), _model()]
    start = threading.Barrier(2)
    reports, errors = {}, []

    def train(i):
        try:
            start.wait()
            reports[i] = _report_model_steps(models[i], tokens, 4)
        except BaseException as error:  # noqa: BLE001 (handed to the main thread)
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for rep in reports.values():
        assert _layer_counts(rep) == _layer_counts(alone)
        assert _unit_counts(rep) == _unit_counts(alone)
        assert rep.totals == alone.totals


class _TransposedLinear(nn.Module):
    """F.linear on a non-contiguous 3-D input: without a Python dispatch mode, its bias is added
    in place into the mm output, after the region copied a kept mm's value (NOTE: [Kept outputs
    written in the forward] in csrc/dispatch/preserved_writes.cpp); under any mode it is added out of place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x.transpose(0, 1))).sin()


@needs_trace
def test_the_trace_says_what_an_untraced_run_does_for_f_linear_on_a_transposed_input():
    torch.manual_seed(0)
    layer = _TransposedLinear()
    sac_plugin.apply_selective_checkpointing(layer, Policy(kept_calls={"aten::mm.default": [0]}))
    x = torch.randn(4, 3, 8, requires_grad=True)
    with sac_plugin.audit() as untraced:
        layer(x).sum().backward()
    with sac_plugin.trace(layer) as traced:
        layer(x).sum().backward()
    entries = [(e.op, e.phase, e.status) for e in traced.trace]
    # The mm is kept in the forward and served from the copy made before the bias's in-place add.
    assert ("aten::mm.default", "forward", "kept") in entries
    assert ("aten::mm.default", "recompute", "served") in entries
    assert untraced.hits("aten::mm") == 1 and untraced.count("aten::mm", phase="recompute") == 0
    # Call by call, the trace counts what the untraced audit counts in the region's passes.
    for op in {e.op for e in traced.trace}:
        phases = [(p, s) for o, p, s in entries if o == op]
        assert phases.count(("recompute", "served")) == untraced.hits(op), op
        assert phases.count(("recompute", "recomputed")) == untraced.count(op, phase="recompute"), op
        assert sum(p == "forward" for p, _ in phases) == untraced.count(op, phase="forward"), op
    assert [e.module for e in traced.trace if e.op == "aten::mm.default"] == ["lin", "lin"]


def test_a_layer_whose_kept_outputs_are_never_served_says_so_in_its_row():
    # Layers checkpointed inside a plain torch checkpoint (docs/limits.md): the second layer's
    # recompute reads the first layer's output the outer recompute made anew, which nothing names,
    # so its kept tanh is held and never served. The first layer's outputs are held, so that the
    # new one never takes the address of the forward's, which would name it alike.
    model, _ = toy_models.make_pair(checkpoint=False)
    for layer in model.layers:
        sac_plugin.apply_selective_checkpointing(layer, Policy(kept_ops=["aten::tanh"]))
    outputs = []
    model.layers[0].register_forward_hook(lambda module, args, output: outputs.append(output))
    x = torch.randn(4, 16)
    with pytest.warns(sac_plugin.HeldNeverServedWarning), sac_plugin.report(model) as rep:
        checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
    # The held outputs' graphs reach the model through C++, which the cycle collector cannot see.
    outputs.clear()
    rows = {layer["name"]: (layer["hits"], layer["never_served"]) for layer in rep.to_dict()["layers"]}
    assert rows == {"layers.0": (1, 0), "layers.1": (0, 1)}
    lines = rep.table().splitlines()
    assert lines[0].endswith("never served")
    assert {line.split()[0]: line.split()[-1] for line in lines if line.startswith("layers.")} == {
        "layers.0": "0",
        "layers.1": "1",
    }


def _toy_report(policy, *, backward=True):
    model, _ = toy_models.make_pair(policy=policy)
    x = torch.randn(4, 16)
    with sac_plugin.report(model) as rep:
        if backward:
            toy_models.run_step(model, x)
        else:
            model(x)
    return rep


def test_each_layer_times_its_forward_and_its_recompute():
    rep = _toy_report(Policy(kept_ops=["aten::tanh"]))
    for layer in rep.layers.values():
        # q's addmm only feeds the kept tanh: the native engine skips it (NOTE: [The recompute runs
        # only what backward needs]); the dispatch-mode engine runs every recompute call.
        skipped = 1 if sac_plugin.engine() == "native" else 0
        assert (layer.total("recompute"), layer.total("skipped")) == (4 - skipped, skipped)
        assert layer.forward_seconds > 0 and layer.recompute_seconds > 0
        unit = rep.units[(layer.name, "attn")]
        # A unit opens and closes inside its layer's pass: its time is part of the layer's.
        assert 0 < unit.forward_seconds <= layer.forward_seconds
        assert 0 < unit.recompute_seconds <= layer.recompute_seconds
    data = rep.to_dict()["layers"]
    assert [(d["forward_seconds"], d["recompute_seconds"]) for d in data] == [
        (layer.forward_seconds, layer.recompute_seconds) for layer in rep.layers.values()
    ]
    rows = {line.split()[0]: line.split()[-3:-1] for line in rep.table().splitlines() if line.startswith("layers.")}
    assert rows == {
        layer.name: [f"{layer.forward_seconds * 1e3:.2f}", f"{layer.recompute_seconds * 1e3:.2f}"]
        for layer in rep.layers.values()
    }


def test_a_recompute_that_reruns_nothing_still_takes_the_time_of_serving_the_kept_outputs():
    # Every op the recompute reaches is kept: it reruns none, and its pass is still entered to
    # serve the kept outputs, so it is timed.
    rep = _toy_report(Policy(kept_ops=["aten::tanh", "aten::addmm", "aten::t"]))
    assert [(layer.total("recompute"), layer.total("hits")) for layer in rep.layers.values()] == [(0, 5), (0, 5)]
    assert all(layer.recompute_seconds > 0 for layer in rep.layers.values())


def test_a_layer_run_forward_only_has_no_recompute_time():
    rep = _toy_report(Policy(kept_ops=["aten::tanh"]), backward=False)
    assert [(layer.calls, layer.forward_seconds > 0, layer.recompute_seconds) for layer in rep.layers.values()] == [
        (1, True, 0.0),
        (1, True, 0.0),
    ]
    assert all(unit.recompute_seconds == 0.0 for unit in rep.units.values())


def test_the_table_says_under_each_layer_which_ops_it_served_from_the_forward():
    lines = _toy_report(Policy(kept_ops=["aten::tanh"])).table().splitlines()
    assert [lines[i + 1] for i, line in enumerate(lines) if line.startswith("layers.")] == ["    kept: tanh"] * 2
    lines = _toy_report(Policy(kept_ops=["aten::tanh", "aten::addmm", "aten::t"])).table().splitlines()
    assert [lines[i + 1] for i, line in enumerate(lines) if line.startswith("layers.")] == [
        "    kept: addmm x2, t x2, tanh"
    ] * 2
    # A layer that served nothing has no such line.
    lines = _toy_report(Policy()).table().splitlines()
    assert [lines[i + 1].startswith("  unit") for i, line in enumerate(lines) if line.startswith("layers.")] == [
        True,
        True,
    ]


def test_the_kept_line_ends_in_dots_past_forty_characters():
    from sac_plugin._report_values import Breakdown, OpCounts
    from sac_plugin._report_render import kept_summary

    layer = Breakdown("l")
    layer.ops = {f"aten::op_number_{i}.default": OpCounts(hits=10 - i) for i in range(4)}
    assert kept_summary(layer) == "op_number_0 x10, op_number_1 x9, ..."
    layer.ops = {"aten::a_very_long_operator_name_of_fifty_characters_": OpCounts(hits=1)}
    assert kept_summary(layer) == "..."
    layer.ops = {"aten::mm": OpCounts(hits=2), "aten::mm.out": OpCounts(hits=1), "aten::cat": OpCounts(hits=0)}
    assert kept_summary(layer) == "mm x3"


def test_plot_draws_the_held_bytes_and_the_recompute_time_of_each_layer(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    rep = _toy_report(Policy(kept_ops=["aten::tanh", "aten::addmm"]))
    path = tmp_path / "report.png"
    figure = rep.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    held, recompute = figure.axes
    layers = list(rep.layers.values())
    assert [tick.get_text() for tick in recompute.get_xticklabels()] == ["layers.0", "layers.1"]
    assert [bar.get_height() for bar in held.patches] == [layer.kept_bytes / 2**20 for layer in layers] + [
        layer.offloaded_bytes / 2**20 for layer in layers
    ]
    # The offloaded bars stand on the kept ones.
    assert [bar.get_y() for bar in held.patches[len(layers) :]] == [layer.kept_bytes / 2**20 for layer in layers]
    assert [bar.get_height() for bar in recompute.patches] == [layer.recompute_seconds * 1e3 for layer in layers]
    assert rep.plot() is not figure


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    rep = _toy_report(Policy(kept_ops=["aten::tanh"]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError) as raised:
        rep.plot()
    assert str(raised.value) == (
        "sac_plugin: Report.plot draws with matplotlib, which is not installed: pip install sac_plugin[plot]"
    )


@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_on_an_accelerator_the_plot_stacks_offloaded_bytes_on_kept_ones_and_passes_are_timed():
    values = runner_with_models("offloaded_outputs")("""
import matplotlib
matplotlib.use("Agg")
model, x = checkpointed(Policy(kept_ops=["aten::tanh"], offloaded_ops=["aten::addmm"]))
step(model, x)
with sac_plugin.report(model) as layer_report:
    step(model, x)
held, recompute = layer_report.plot().axes
layers = list(layer_report.layers.values())
lines = layer_report.table().splitlines()
report(
    accelerator=torch.accelerator.is_available(),
    held=[float(bar.get_height()) for bar in held.patches],
    bottoms=[float(bar.get_y()) for bar in held.patches],
    expected=[l.kept_bytes / 2**20 for l in layers] + [l.offloaded_bytes / 2**20 for l in layers],
    timed=[(l.forward_seconds > 0, l.recompute_seconds > 0) for l in layers],
    recompute=[bar.get_height() for bar in recompute.patches] == [l.recompute_seconds * 1e3 for l in layers],
    kept=[lines[i + 1] for i, line in enumerate(lines) if line.startswith(("0 ", "1 "))],
)
""")
    # Per layer: tanh (1 MiB) and the down projection (512 KiB, under the offload floor) kept on
    # the device, the up projection (1 MiB) offloaded.
    assert values == {
        "accelerator": True,
        "held": [1.5, 1.5, 1.0, 1.0],
        "bottoms": [0.0, 0.0, 1.5, 1.5],
        "expected": [1.5, 1.5, 1.0, 1.0],
        "timed": [[True, True], [True, True]],
        "recompute": True,
        "kept": ["    kept: addmm x2, tanh", "    kept: addmm x2, tanh"],
    }


def test_a_clock_that_raises_as_a_pass_ends_leaves_the_report_balanced(monkeypatch):
    from sac_plugin import _report

    clock = _report._clock

    def failing_at_pass_end():
        if sys._getframe(1).f_code.co_name == "__exit__":
            raise RuntimeError("the accelerator failed")
        return clock()

    model, _ = toy_models.make_pair(policy=Policy(kept_ops=["aten::tanh"]))
    x = torch.randn(4, 16)
    with sac_plugin.report(model) as rep:
        monkeypatch.setattr(_report, "_clock", failing_at_pass_end)
        with pytest.raises(RuntimeError, match="the accelerator failed"):
            model(x)
        monkeypatch.setattr(_report, "_clock", clock)
        assert _report._stack(rep) == []
        toy_models.run_step(model, x)
    assert [(layer.calls, layer.total("hits")) for layer in rep.layers.values()] == [(2, 1), (1, 1)]
