"""Rewrites the NOTE index in docs/engines.md from the NOTE blocks in csrc/ and python/.

python tools/note_index.py          # rewrite the table in place
python tools/note_index.py --check  # exit 1 if the table is stale (tests/python/test_docs.py checks it too)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "engines.md"
# A block opens with "NOTE: [title]" at the start of a comment line; "NOTE: [title] in file" and
# "(NOTE: [title])" are references to one.
NOTE = re.compile(r"^\s*(?://|#)?\s*NOTE: \[(?P<title>[^\]]+)\](?P<rest>.*)$")
HEADER = "| NOTE | file |\n|---|---|\n"


def note_blocks() -> list[tuple[str, str]]:
    """(title, file) of every NOTE block that opens a comment paragraph (not a reference to one)."""
    found = []
    for path in sorted([*ROOT.glob("csrc/**/*.h"), *ROOT.glob("csrc/**/*.cpp"), *ROOT.glob("python/**/*.py")]):
        for line in path.read_text(encoding="utf-8").splitlines():
            match = NOTE.match(line)
            if match and not re.match(r"\s*(in |\()", match.group("rest")):
                found.append((match.group("title"), str(path.relative_to(ROOT))))
    return found


def table() -> str:
    return HEADER + "".join(f"| {title} | `{file}` |\n" for title, file in note_blocks())


def main(argv) -> int:
    text = PAGE.read_text()
    start = text.index(HEADER)
    end = start + len(HEADER)
    while end < len(text) and text[end:].startswith("| "):
        end = text.index("\n", end) + 1
    new = text[:start] + table() + text[end:]
    if "--check" in argv:
        return 0 if new == text else 1
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
