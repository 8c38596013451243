"""The per-layer report: counts, kept calls and kept bytes by checkpointed module and by unit, as
the audit and the regions see them; saved-for-backward storages by place; table and JSON."""

import json

import pytest
import sac_plugin
import torch
from sac_plugin import RecomputeConfig, apply_recompute_config
from sac_plugin.models import Llama

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
        # The mlp unit keeps the w1, w3 and w2 matmuls, the three _unsafe_views that fold their
        # outputs back to 3-D (copies by schema, not views), silu and mul.
        unit = report.units[(layer.name, "mlp")]
        assert unit.calls == 1 and unit.kept_calls == 8
        assert unit.ops["aten::silu"].forward == 1 and unit.ops["aten::mm"].forward == 3
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
    assert "  unit mlp" in table and "saved for backward, by place (each storage once):" in table


@pytest.mark.native_engine("kept bytes are read from the native engine's region store; torch's SAC cache is opaque")
def test_kept_bytes_by_layer_and_unit_match_the_regions():
    model = _model()
    tokens = torch.randint(64, (2, 16))
    regions = []
    sac_plugin.checkpointing._region_observers.append(regions.append)
    try:
        with sac_plugin.report(model) as report:
            loss = model.loss(tokens, tokens)
            held = [region.kept_bytes for region in regions]
            loss.backward()
    finally:
        sac_plugin.checkpointing._region_observers.remove(regions.append)
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
    assert sac_plugin.checkpointing._scope_wrappers == [] and sac_plugin.units._report_hooks == []
    with sac_plugin.report():
        pass
    assert sac_plugin.checkpointing._scope_wrappers == [] and sac_plugin.units._report_hooks == []
    with pytest.raises(TypeError, match=r"^sac_plugin: report: model must be a torch.nn.Module or None, got 3 \(int\)$"):
        sac_plugin.report(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_oom_observer_needs_cuda():
    from sac_plugin.report import install_oom_observer

    with pytest.raises(RuntimeError) as error:
        install_oom_observer()
    assert str(error.value) == ("sac_plugin: install_oom_observer needs CUDA (torch.cuda.is_available() is False); "
                                "the OOM observer is a CUDA caching-allocator hook")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available: the OOM observer is a CUDA "
                                                          "caching-allocator hook")
def test_oom_observer_prints_the_report(capfd):
    from sac_plugin.report import install_oom_observer

    install_oom_observer()
    with sac_plugin.report():
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, device="cuda")
    assert "sac_plugin: CUDA out of memory on device" in capfd.readouterr().out
