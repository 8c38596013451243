"""tests/cpp/check_layers.py: the C++ layers, and the layers inside csrc/dispatch, hold, and a
break of either is named."""

import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tests" / "cpp" / "check_layers.py")
check_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_layers)


def test_the_sources_keep_every_layer():
    assert check_layers.problems(ROOT / "csrc") == []


def test_an_include_up_the_dispatch_layers_and_an_unplaced_dispatch_file_are_named(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    data_flow = csrc / "dispatch" / "data_flow.cpp"
    data_flow.write_text('#include "dispatch/region.h"\n' + data_flow.read_text())
    (csrc / "dispatch" / "new_part.h").write_text("#pragma once\n")
    assert check_layers.problems(csrc) == [
        'dispatch/data_flow.cpp: #include "dispatch/region.h" reaches up from dispatch layer records to region; '
        "a dispatch layer may include only itself and nothing below",
        "dispatch/new_part.h: is in no layer of dispatch; name its layer in DISPATCH_SUBLAYERS "
        "(tests/cpp/check_layers.py), one of records, parts, region, pipeline, engines",
    ]
