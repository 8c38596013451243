"""Every path of this repository that the docs and the code's comments mention exists.

    python tools/check_paths.py    # prints each missing path as FILE:LINE: PATH; exits 1 if any

A mention is a word that names a file or folder of the checkout: one that starts with a top-level
folder (`csrc/dispatch/offload.cpp`, `tests/python/test_docs.py`), or a source file's name, bare
or under a folder of the tree (`offload.cpp`, `dispatch/offload.cpp`, `planner/_plan.py`,
`test_planner.py`). A mention resolves when some tracked file or folder ends with it. Words that
name other projects' files (`ATen/core/Tensor.h`, `torchtitan/...`), files a command writes
(`plan.json`) and patterns (`*`, `{h,cpp}`, `$VAR`) are not mentions. CI's lint job runs it
(tools/lint.sh).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where mentions are looked for: the docs, the tools, CI, and the sources' comments and docstrings.
SCANNED = ("README.md", "docs/", "tools/", ".ci/", "benchmarks/", "examples/", "csrc/", "python/")
SCANNED_SUFFIXES = {".md", ".py", ".sh", ".h", ".cpp", ".toml", ".yaml", ".yml", ""}
# A bare name is a mention only for the project's own kinds of source.
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".sh", ".md")
WORD = re.compile(r"(?<![\w./$<{-])((?:\.?[\w-]+/)*[\w.-]+)(?![\w/{*<-]|\.\{)")
INCLUDE = re.compile(r"^\s*#\s*include\s*<")


def tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [path for path in listed.stdout.splitlines() if (ROOT / path).exists()]


def _suffixes(paths: list[str]) -> tuple[set[str], set[str]]:
    """Every trailing run of components of every tracked file and folder, and the folder names."""
    endings, folders = set(), set()
    for path in paths:
        parts = path.split("/")
        for start in range(len(parts)):
            endings.add("/".join(parts[start:]))
        for end in range(1, len(parts)):
            endings.update("/".join(parts[start:end]) for start in range(end))
            folders.add(parts[end - 1])
    return endings, folders


def mentions(line: str, folders: set[str], top: set[str]) -> list[str]:
    if INCLUDE.match(line):
        return []  # a system include names another project's header
    found = []
    for match in WORD.finditer(line):
        word = match.group(1).rstrip(".")
        first = word.split("/", 1)[0]
        if "/" in word:
            if first in top or (first in folders and word.endswith(SOURCE_SUFFIXES)):
                found.append(word.rstrip("/"))
        elif word.endswith(SOURCE_SUFFIXES) and re.search(r"[a-z]", word.rsplit(".", 1)[0]):
            found.append(word)
    return found


def missing(paths: list[str] | None = None) -> list[str]:
    paths = tracked() if paths is None else paths
    endings, folders = _suffixes(paths)
    top = {path.split("/", 1)[0] for path in paths if "/" in path}
    problems = []
    for path in paths:
        if not path.startswith(SCANNED) or Path(path).suffix not in SCANNED_SUFFIXES:
            continue
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for word in mentions(line, folders, top):
                if word not in endings:
                    problems.append(f"{path}:{number}: {word}")
    return problems


def main() -> int:
    problems = missing()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
