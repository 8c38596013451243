"""Loading the compiled library: clear errors for a missing build or another torch."""

import pytest
import sac_plugin
import torch
from sac_plugin import _library


def test_library_reports_the_torch_it_was_built_for():
    assert torch.ops.sac.built_for_torch() == torch.__version__


def test_version_mismatch_names_both_versions(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(ImportError) as error:
        _library.load()
    assert str(error.value) == (
        f"sac_plugin: {_library.library_path()} was built for torch {torch.ops.sac.built_for_torch()}, "
        "but torch 9.9.9 is installed; rebuild it against the installed torch with `pip install --no-build-isolation "
        "--no-deps --force-reinstall --no-cache-dir <sac_plugin source directory or git URL>` (from a checkout: "
        "`bash tools/build.sh`)"
    )


def test_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SAC_PLUGIN_LIBRARY", str(tmp_path / "libsac_plugin.so"))
    with pytest.raises(ImportError, match=r"compiled library not found at .*; rebuild it .*`pip install --no-build-isolation"):
        _library.load()


def test_loading_again_is_harmless():
    _library.load()
    with sac_plugin.audit() as audit:
        torch.tanh(torch.ones(1))
    assert audit.count("aten::tanh") == 1
