#!/usr/bin/env bash
# The README's test command: sets up, builds, then runs every test, C++ (ctest) and Python (pytest).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/setup.sh"
bash "$root/tools/build.sh"
build="${SAC_BUILD_DIR:-$root/build}"
echo "== C++ tests (ctest)"
(cd "$build" && ctest --output-on-failure -j "$(nproc)")
echo "== Python tests (pytest)"
cd "$root"
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" "${SAC_VENV:-$root/.venv}/bin/python" -m pytest tests/python "$@"
