#!/usr/bin/env bash
# The sanitizer job: builds every target with AddressSanitizer + UBSan (-DSAC_SANITIZE=ON, plain
# CMake, its own tree build/asan-torch-<version>) against the venv's torch, then runs the C++
# tests and a pytest subset on the installed package's Python with that library
# (SAC_PLUGIN_LIBRARY), libasan and libstdc++ preloaded into python. Any report fails the run.
# Arguments replace the default pytest selection.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
require_venv
(cd / && "$python" -c 'import sac_plugin' 2>/dev/null) || fail "sac_plugin is not installed in $venv; run bash tools/build.sh first"
libasan=$(g++ -print-file-name=libasan.so)
libstdcxx=$(g++ -print-file-name=libstdc++.so)
[ -e "$libasan" ] || fail "g++ has no libasan.so here ($libasan); install libasan (gcc's sanitizer runtime)"
build="${SAC_BUILD_DIR:-$root/build/asan-torch-$torch_version}"

start=$SECONDS
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSAC_PYTHON="$python" \
    -DSAC_SANITIZE=ON -DSAC_BUILD_TESTS=ON >/dev/null
fi
cmake --build "$build" -j "$(nproc)"
echo "build: sac_plugin (ASan+UBSan) built against torch $("$python" -c 'import torch; print(torch.__version__)') in $((SECONDS - start)) s (build tree $build)"

export SAC_TEST_BUILD_DIR="$build"  # the C++ test binaries, for tests that run them
export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
status=0
echo "== C++ tests under ASan+UBSan (ctest)"
ctest_junit=$(results_file ctest.xml)
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" ${ctest_junit:+--output-junit "$ctest_junit"} || status=1
echo "== Python tests under ASan+UBSan (pytest, $build/libsac_plugin.so)"
cd "$root"
[ $# -gt 0 ] || set -- tests/python/test_gradients.py tests/python/test_invariants.py tests/python/test_audit.py \
  tests/python/test_data_flow.py tests/python/test_policy.py tests/python/test_units.py tests/python/test_bad_input.py
rc=0
junit=$(results_file pytest-1.xml)
LD_PRELOAD="$libasan $libstdcxx" SAC_PLUGIN_LIBRARY="$build/libsac_plugin.so" \
  "$python" -m pytest -p no:cacheprovider ${junit:+--junitxml="$junit"} "$@" || rc=$?
if [ "$rc" -eq 5 ]; then echo "sanitize: pytest collected no tests (exit 5)" >&2; fi
[ "$rc" -eq 0 ] || status=1
exit "$status"
