"""The README's integration snippets run as written."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def first_python_block(section: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end if end >= 0 else None], re.S)
    assert blocks, f"README section {section!r} has no python block"
    return blocks[0]


def test_hugging_face_snippet_runs():
    pytest.importorskip("transformers", reason="transformers is not installed (tools/setup.sh installs it)")
    exec(compile(first_python_block("Hugging Face"), "README.md: Hugging Face", "exec"), {})


@pytest.mark.slow
def test_torchtitan_snippet_runs():
    pytest.importorskip("torchtitan", reason="torchtitan is not importable: tools/setup.sh installs torchtitan 0.3.0, which needs torch >= 2.13")
    threads = torch.get_num_threads()
    try:
        exec(compile(first_python_block("torchtitan"), "README.md: torchtitan", "exec"), {})
    finally:
        torch.set_num_threads(threads)  # the snippet sets one thread
