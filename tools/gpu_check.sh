#!/usr/bin/env bash
# The GPU check, as one command, for a machine with a CUDA build of torch and no network (an H200
# with torch 2.11 + CUDA 13): builds and installs the package against that machine's python3 torch
# (build_plugin below says how), runs every test (CUDA tests included), the overhead, memory and
# memory-budget benchmarks (benchmarks/) on CUDA tensors, a Llama-style block at realistic size
# (bf16, hidden 4096, sequence 4096) with peak memory, and the same block kept, offloaded and
# recomputed (bytes, step times, exposed copy time). Everything it prints also goes to one file:
# $OUT/gpu_check.txt under the device tool, else ./gpu_check.txt, the benchmarks' JSON results
# at its end. SAC_GPU_PYTHON picks another python.
# Budget: under 8 minutes on an H200.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
# This machine's CUDA torch is installed for its own python, not in a venv.
python="${SAC_GPU_PYTHON:-python3}"
cd "$root"
out_dir="${OUT:-$root}"
log="$out_dir/gpu_check.txt"
build="$root/build/gpu"
results="$build/results"  # the benchmarks' JSON, copied into the log at the end
export PYTHONUNBUFFERED=1
unset PYTHONPATH
status=0

command -v "$python" >/dev/null || fail "$python not found; set SAC_GPU_PYTHON to the python with CUDA torch"
"$python" -c 'import torch' 2>/dev/null || fail "torch is not importable by $python; set SAC_GPU_PYTHON to the python with CUDA torch"
command -v cmake >/dev/null || fail "cmake is not installed on this machine"

step() {  # step NAME TIMEOUT COMMAND...: runs one part (an external command), keeps going when it fails
  local name=$1 limit=$2 rc
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit $rc)"
    status=1
  fi
}

# Builds the way users install: pip, no build isolation, against this python's torch, the test
# suite in the same tree. This machine has no network, so nothing can be fetched: with
# scikit-build-core installed for $python that is `pip install --no-build-isolation --no-index`;
# without it, a plain CMake build of the same CMakeLists.txt, loaded through SAC_PLUGIN_LIBRARY
# with the sources on PYTHONPATH (what the package would install, from the tree).
build_plugin() {
  local pip_flags=(--no-build-isolation --no-deps --no-index --disable-pip-version-check)
  # A distribution's python (PEP 668) refuses pip installs unless told otherwise.
  if "$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    pip_flags+=(--break-system-packages)
  fi
  if "$python" -c 'import scikit_build_core' 2>/dev/null; then
    echo "-- scikit-build-core is installed for $python: pip install --no-build-isolation"
    step "build and install (pip)" 420 "$python" -m pip install "${pip_flags[@]}" -C "build-dir=$build" \
      -C cmake.define.SAC_BUILD_TESTS=ON "$root"
    [ "$status" -eq 0 ] && return
    echo "-- the pip build failed; falling back to a plain CMake build"
    status=0
  else
    echo "-- scikit-build-core is not installed for $python and cannot be fetched (no network):"
    echo "-- plain CMake build, loaded through SAC_PLUGIN_LIBRARY with the sources on PYTHONPATH"
  fi
  step "configure" 120 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSAC_BUILD_TESTS=ON \
    -DSAC_PYTHON="$(command -v "$python")"
  step "build" 300 cmake --build "$build" -j "$(nproc)"
  export SAC_PLUGIN_LIBRARY="$build/libsac_plugin.so" PYTHONPATH="$root/python"
}

{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  build_plugin
  rm -rf "$results" && mkdir -p "$results"
  if [ -f "$build/CTestTestfile.cmake" ]; then
    step "C++ tests" 120 bash -c "cd '$build' && ctest --output-on-failure -j 8"
  else
    echo "== C++ tests: GoogleTest is not on this machine; skipped"
  fi
  step "Python tests" 240 "$python" -m pytest tests/python -q -rs -p no:cacheprovider
  step "overhead benchmark (cuda)" 120 "$python" benchmarks/bench_overhead.py --device cuda --reps 10 \
    --json "$results/overhead_cuda.json"
  step "memory benchmark (cuda)" 90 "$python" benchmarks/bench_memory.py --device cuda --dims 1024 4096 \
    --seqs 2048 4096 --json "$results/memory_cuda.json"
  step "Llama block, bf16, hidden 4096, seq 4096" 120 "$python" benchmarks/bench_block.py --device cuda \
    --dtype bfloat16 --dim 4096 --heads 32 --seq 4096 --steps 5 --json "$results/block_cuda.json"
  step "keep, offload or recompute: Llama block, bf16, hidden 4096, seq 4096" 150 "$python" benchmarks/bench_offload.py \
    --device cuda --dtype bfloat16 --dim 4096 --heads 32 --seq 4096 --steps 3 --min-bytes 1048576 \
    --json "$results/offload_cuda.json"
  step "memory-budget plans (cuda, CUDA-event kernel times)" 240 "$python" benchmarks/bench_budget.py --device cuda \
    --sizes 1024x1024 2048x2048 --reps 5 --json "$results/budget_cuda.json"
  for json in "$results"/*.json; do
    [ -f "$json" ] && { echo "== results: $(basename "$json")"; cat "$json"; echo; }
  done
  echo "gpu_check: done, status $status"
  exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
