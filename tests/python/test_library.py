"""The compiled library: clear errors for a missing build or another torch, and its GoogleTest
suite passes as one process."""

import os
import subprocess
from pathlib import Path

import pytest
import sac_plugin
import torch
from sac_plugin import _native


def test_library_reports_the_torch_it_was_built_for():
    assert torch.ops.sac.built_for_torch() == torch.__version__


def test_version_mismatch_names_both_versions(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(ImportError) as error:
        _native.load()
    assert str(error.value) == (
        f"sac_plugin: {_native.library_path()} was built for torch {torch.ops.sac.built_for_torch()}, "
        "but torch 9.9.9 is installed; rebuild it against the installed torch with `pip install --no-build-isolation "
        "--no-deps --force-reinstall --no-cache-dir <sac_plugin source directory or git URL>` (from a checkout: "
        "`bash tools/build.sh`)"
    )


def test_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SAC_PLUGIN_LIBRARY", str(tmp_path / "libsac_plugin.so"))
    with pytest.raises(
        ImportError, match=r"compiled library not found at .*; rebuild it .*`pip install --no-build-isolation"
    ):
        _native.load()


def test_loading_again_is_harmless():
    _native.load()
    with sac_plugin.audit() as audit:
        torch.tanh(torch.ones(1))
    assert audit.count("aten::tanh") == 1


def test_the_cpp_tests_pass_as_one_process_in_any_order():
    build = os.environ.get("SAC_TEST_BUILD_DIR")
    if not build or not (Path(build) / "sac_cpp_tests").exists():
        pytest.skip("needs SAC_TEST_BUILD_DIR, the build tree with sac_cpp_tests (tools/test.sh sets it)")
    binary = Path(build) / "sac_cpp_tests"
    # --gtest_repeat=2: the second round runs every test after the fallback was installed.
    result = subprocess.run(
        [str(binary), "--gtest_repeat=2", "--gtest_shuffle", "--gtest_brief=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
