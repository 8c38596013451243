#!/usr/bin/env bash
# Builds sac_plugin against the venv's torch and installs it into that venv with pip
# (scikit-build-core, no build isolation), with the GoogleTest suite in the same build tree:
# build/torch-<version> unless SAC_BUILD_DIR says otherwise. Incremental: the tree is kept.
# SAC_CMAKE_DEFINES="NAME=VALUE ..." passes CMake options (e.g. CMAKE_BUILD_TYPE=RelWithDebInfo).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
require_venv
"$python" -c 'import scikit_build_core' 2>/dev/null \
  || fail "scikit-build-core is not installed in $venv; run bash tools/setup.sh first"
command -v cmake >/dev/null || fail "cmake is not installed; run bash tools/setup.sh first"
build="${SAC_BUILD_DIR:-$root/build/torch-$torch_version}"

defines=(-C "cmake.define.SAC_BUILD_TESTS=ON")
for define in ${SAC_CMAKE_DEFINES:-}; do defines+=(-C "cmake.define.$define"); done
start=$SECONDS
# --no-deps: pip never touches torch; -C build-dir: one persistent tree per torch, so a rebuild
# compiles only what changed and ctest runs in the very tree the installed library came from.
"$python" -m pip install -q --no-build-isolation --no-deps --disable-pip-version-check \
  -C "build-dir=$build" "${defines[@]}" "$root"
echo "build: sac_plugin built against torch $("$python" -c 'import torch; print(torch.__version__)') and installed into $venv in $((SECONDS - start)) s (build tree $build)"
