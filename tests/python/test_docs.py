"""The documentation's code runs as written, and the site builds.

Every ```python block in README.md and docs/*.md runs, each on its own, in a fresh namespace, from
an empty scratch directory, against the installed package, as a user runs it (a block that needs a
file writes it). A block that cannot run standalone says so in the HTML comment right above it:

    <!-- not-run: REASON -->            never run; listed, with the reason, by test_not_run_blocks
    <!-- doc-test: needs=MODULE slow --> run only where MODULE imports (skipped, naming it,
                                         elsewhere); `slow` marks it slow

The NOTE index in docs/engines.md is checked against the NOTE blocks in csrc/ and python/.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_BLOCK = re.compile(r"(?:<!--\s*(?P<directive>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    file: str
    line: int
    code: str
    not_run: str | None  # the reason, for a block marked not-run
    needs: tuple[str, ...]
    slow: bool

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"


def _parse_directive(directive: str | None, where: str) -> tuple[str | None, tuple[str, ...], bool]:
    if not directive:
        return None, (), False
    if directive.startswith("not-run:"):
        reason = directive[len("not-run:") :].strip()
        assert reason, f"{where}: a not-run block must say why"
        return reason, (), False
    if directive.startswith("doc-test:"):
        needs, slow = [], False
        for word in directive[len("doc-test:") :].split():
            if word == "slow":
                slow = True
            elif word.startswith("needs="):
                needs.extend(word[len("needs=") :].split(","))
            else:
                raise AssertionError(f"{where}: unknown doc-test word {word!r} (expected needs=MODULE or slow)")
        return None, tuple(needs), slow
    # Any other comment right above a block is prose, not a directive.
    return None, (), False


def _blocks() -> list[Block]:
    blocks = []
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1  # the block's first code line
            where = f"{path.relative_to(ROOT)}:{line}"
            not_run, needs, slow = _parse_directive(match.group("directive"), where)
            blocks.append(Block(str(path.relative_to(ROOT)), line, match.group("code"), not_run, needs, slow))
    return blocks


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b.not_run is None]
NOT_RUN = [b for b in BLOCKS if b.not_run is not None]

# The blocks marked not-run, by reason: a new one must be added here on purpose.
EXPECTED_NOT_RUN: dict[str, str] = {
    "docs/memory-budget.md:116": "the peak is an accelerator's allocator's; tests/python/test_plan_step.py plans such "
    "a step on the test accelerator",
}


def _param(block: Block):
    marks = [pytest.mark.slow] if block.slow else []
    return pytest.param(block, id=block.name, marks=marks)


def test_blocks_are_found():
    assert any(b.file == "README.md" for b in RUN), "README.md has no runnable python block"
    assert len(RUN) >= 8, [b.name for b in RUN]


def test_not_run_blocks():
    assert {b.name: b.not_run for b in NOT_RUN} == EXPECTED_NOT_RUN


@pytest.mark.parametrize("block", [_param(b) for b in RUN])
def test_block_runs(block: Block, tmp_path, monkeypatch):
    for module in block.needs:
        pytest.importorskip(
            module, reason=f"{block.name} needs {module}, which is not importable here (tools/setup.sh installs it)"
        )
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        # Padded so that a traceback names the Markdown file and its line.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, str(ROOT / block.file), "exec"), {"__name__": "__docs__"})
    finally:
        torch.set_num_threads(threads)  # a snippet may set one thread


def test_the_config_file_in_the_docs_is_the_examples():
    """docs/integrations.md writes examples/configs/moe_routing.yaml in its first block: the same config."""
    pytest.importorskip("yaml", reason="pyyaml is not importable here (tools/setup.sh installs it)")
    import sac_plugin

    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    written = re.search(r'Path\("moe_routing.yaml"\).write_text\("""\\\n(.*?)"""\)', text, re.S).group(1)
    assert sac_plugin.RecomputeConfig.from_yaml(written) == sac_plugin.RecomputeConfig.load(
        ROOT / "examples" / "configs" / "moe_routing.yaml"
    )


def test_install_docs_list_each_extras_packages_as_pyproject_does():
    """docs/install.md installs the package with --no-deps, which leaves an extra's packages out:
    its table names them, exactly as pyproject.toml declares them, so that they can be installed by
    name, and no sentence says to install an extra "as above"."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    text = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Extras\n") : text.index("\n## The development setup\n")]
    rows = re.findall(r"^\| `sac_plugin\[(\w+)\]` \| (.+?) \| .+ \|$", section, re.M)
    assert {extra: re.findall(r"`([^`]+)`", packages) for extra, packages in rows} == extras
    assert "--no-deps" in section and "as above" not in section


# --- the NOTE index in docs/engines.md ------------------------------------------------------------


def _note_index_tool():
    """tools/note_index.py, the one NOTE scanner: it writes the table this test reads."""
    spec = importlib.util.spec_from_file_location("note_index", ROOT / "tools" / "note_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _note_index() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    section = text[text.index("\n## NOTE blocks\n") :]
    return set(re.findall(r"^\| (?!NOTE \|)([^|]+?) \| `([^`]+)` \|$", section, re.M))


def test_note_index_lists_every_note_block():
    note_index = _note_index_tool()
    in_code, in_docs = set(note_index.note_blocks()), _note_index()
    assert in_code, "no NOTE block found under csrc/ and python/"
    assert sorted(in_code - in_docs) == [], "NOTE blocks missing from docs/engines.md"
    assert sorted(in_docs - in_code) == [], "docs/engines.md lists NOTE blocks the code does not have"
    # The table is what tools/note_index.py writes (run it after adding or moving a NOTE).
    assert note_index.main(["--check"]) == 0, "docs/engines.md's NOTE table is stale: run python tools/note_index.py"


# --- the site ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip(
            "mkdocs is not installed: tools/setup.sh installs mkdocs-material and mkdocstrings[python] (the docs extra)"
        )
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_pages_read_as_plain_markdown():
    # The site's cross-references ([`Policy`][sac_plugin.Policy]) and directives (`::: name`)
    # render as literal text outside mkdocs: pages link with relative links, and only the
    # generated reference (api.md) holds directives.
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    cross_references = re.compile(r"\]\[[\w.]+\]")
    found = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if cross_references.search(line) or (line.startswith("::: ") and page.name != "api.md")
    ]
    assert found == []
