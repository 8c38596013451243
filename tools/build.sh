#!/usr/bin/env bash
# Configures (once) and builds the plugin and the GoogleTest suite against the venv's torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${SAC_VENV:-$root/.venv}"
build="${SAC_BUILD_DIR:-$root/build}"
python="$venv/bin/python"
[ -x "$python" ] || python=$(command -v python3)
prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DSAC_PYTHON="$python" \
    -DCMAKE_BUILD_TYPE="${SAC_BUILD_TYPE:-RelWithDebInfo}" ${SAC_CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -j "$(nproc)"
