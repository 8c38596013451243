#!/usr/bin/env bash
# The style checks, as CI's lint job runs them: ruff's lint rules and formatting on the Python
# tree, clang-format on the C++ tree (configured in pyproject.toml and .clang-format), and that every
# path the docs and comments mention exists (tools/check_paths.py). --fix rewrites the tree instead
# of checking it (paths are not fixed). Prints one "lint: ..." line per check; exits 1 if any
# fails.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
cd "$root"
[ -x "$venv/bin/ruff" ] && [ -x "$venv/bin/clang-format" ] || fail "ruff or clang-format is missing from $venv; run bash tools/setup.sh"
mapfile -t python_files < <(git ls-files '*.py')
mapfile -t cpp_files < <(git ls-files '*.h' '*.cpp')
status=0
if [ "${1:-}" = "--fix" ]; then
  "$venv/bin/ruff" check --fix "${python_files[@]}"
  "$venv/bin/ruff" format "${python_files[@]}"
  "$venv/bin/clang-format" -i "${cpp_files[@]}"
  exit 0
fi
if "$venv/bin/ruff" check --quiet "${python_files[@]}"; then echo "lint: ruff check clean"
else echo "lint: ruff check FAILED"; status=1; fi
if "$venv/bin/ruff" format --check --quiet "${python_files[@]}"; then echo "lint: ruff format clean"
else echo "lint: ruff format FAILED (bash tools/lint.sh --fix rewrites the files)"; status=1; fi
if "$venv/bin/clang-format" --dry-run --Werror "${cpp_files[@]}"; then echo "lint: clang-format clean"
else echo "lint: clang-format FAILED (bash tools/lint.sh --fix rewrites the files)"; status=1; fi
if "$python" tools/check_paths.py; then echo "lint: every path mentioned exists"
else echo "lint: paths FAILED (tools/check_paths.py names each missing one)"; status=1; fi
exit "$status"
