#!/usr/bin/env bash
# The GPU check, as one command, for a machine with a CUDA build of torch and nvcc and no network
# (an H200 with torch 2.11 + CUDA 13): builds the plugin against that machine's python3 torch,
# runs every test (CUDA tests included), both benchmarks on CUDA tensors and a Llama-style block
# at realistic size (bf16, hidden 4096, sequence 4096) with peak memory. Everything it prints
# also goes to one file: $OUT/gpu_check.txt under the device tool, else ./gpu_check.txt.
# Budget: under 8 minutes on an H200.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out_dir="${OUT:-$root}"
log="$out_dir/gpu_check.txt"
python="${SAC_GPU_PYTHON:-python3}"
build="$root/build-gpu"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

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

configure() {  # configure [EXTRA CMAKE ARGS]: configures $build against this machine's torch
  local prefix
  prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  step "configure $*" 120 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSAC_PYTHON="$(command -v "$python")" -DCMAKE_PREFIX_PATH="$prefix" "$@"
}

{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  # A CUDA build's TorchConfig also looks for the CUDA toolkit; when that fails, build against
  # the same installed torch's headers and libraries directly (SAC_TORCH_FROM_PYTHON).
  configure
  [ -f "$build/build.ninja" ] && step "build" 240 cmake --build "$build" -j "$(nproc)"
  if [ "$status" -ne 0 ]; then
    echo "-- TorchConfig did not give a build; plan B: the same torch's headers and libraries directly"
    rm -rf "$build"
    status=0
    configure -DSAC_TORCH_FROM_PYTHON=ON
    step "build (torch from python)" 240 cmake --build "$build" -j "$(nproc)"
  fi
  if [ -f "$build/CTestTestfile.cmake" ]; then
    step "C++ tests" 120 bash -c "cd '$build' && ctest --output-on-failure -j 8"
  else
    echo "== C++ tests: GoogleTest is not on this machine; skipped"
  fi
  step "Python tests" 240 "$python" -m pytest tests/python -q -rs -p no:cacheprovider
  step "overhead benchmark (cuda)" 120 "$python" tools/bench_overhead.py --device cuda --reps 10 \
    --json "$out_dir/overhead_cuda.json"
  step "memory benchmark (cuda)" 90 "$python" tools/bench_memory.py --device cuda --dims 1024 4096 \
    --seqs 2048 4096 --json "$out_dir/memory_cuda.json"
  step "Llama block, bf16, hidden 4096, seq 4096" 120 "$python" tools/bench_block.py --device cuda \
    --dtype bfloat16 --dim 4096 --heads 32 --seq 4096 --steps 5 --json "$out_dir/block_cuda.json"
  echo "gpu_check: done, status $status"
  exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
