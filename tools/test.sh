#!/usr/bin/env bash
# The README's test command: sets up, builds and installs the package, then runs every test,
# C++ (ctest, in the build tree) and Python (pytest, against the installed package).
# SAC_VENV and SAC_TORCH_VERSION pick another venv and torch (as .ci/run's version matrix does);
# arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${SAC_VENV:-$root/.venv}"
bash "$root/tools/setup.sh"
bash "$root/tools/build.sh"
torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
build="${SAC_BUILD_DIR:-$root/build/torch-$torch_version}"
status=0
echo "== C++ tests (ctest)"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" || status=1
echo "== Python tests (pytest, against $(cd / && "$venv/bin/python" -c 'import sac_plugin; print(sac_plugin.__file__)'))"
cd "$root"
rc=0
"$venv/bin/python" -m pytest tests/python "$@" || rc=$?
if [ "$rc" -eq 5 ]; then echo "test: pytest collected no tests (exit 5)" >&2; fi
[ "$rc" -eq 0 ] || status=1
exit "$status"
