#!/usr/bin/env bash
# The GPU check, as one command, for a machine with a CUDA build of torch that may have no network
# and no GoogleTest (for instance an H200 with torch 2.11 + CUDA 13): builds and installs the
# package against that python3's torch (build_plugin below says how), then, in this order, so that what matters
# most runs first if time runs out:
#   1. the CUDA tests (tests/python/test_cuda.py);
#   2. layer inputs offloaded, and sac_plugin.plan_step, on a stack of Llama blocks at bf16, hidden
#      4096, sequence 4096, peak by torch.cuda.max_memory_allocated (tools/gpu_check_features.py;
#      a build without the feature reports "not available in this build", not a failure);
#   3. the benchmarks (benchmarks/) on CUDA tensors at reduced sizes: overhead, memory, one Llama
#      block, keep / offload / recompute (bytes, step times, exposed copy time), memory budget.
# Everything goes to one file, $OUT/gpu_check.txt where OUT names an output directory, else ./gpu_check.txt:
# what each step prints, the benchmarks' JSON results, and last a machine-readable summary, one
# line "gpu_check summary: {JSON}" with every step's result, exit status and seconds.
# SAC_GPU_PYTHON picks another python.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
# A CUDA torch is often installed for the system's python rather than in a venv.
python="${SAC_GPU_PYTHON:-python3}"
cd "$root"
out_dir="${OUT:-$root}"
log="$out_dir/gpu_check.txt"
build="$root/build/gpu"
results="$build/results"  # the benchmarks' JSON, copied into the log at the end
steps_file="$build/steps.tsv"  # one line per step, for the summary
export PYTHONUNBUFFERED=1
unset PYTHONPATH
status=0

command -v "$python" >/dev/null || fail "$python not found; set SAC_GPU_PYTHON to the python with CUDA torch"
"$python" -c 'import torch' 2>/dev/null || fail "torch is not importable by $python; set SAC_GPU_PYTHON to the python with CUDA torch"
command -v cmake >/dev/null || fail "cmake is not installed"

# NOTE: [The GPU check's time budget]
# The check is meant for a GPU that is rented by the minute, and possibly for one command of at
# most 10 minutes: the whole check must run in 8 minutes, leaving room to run it again. Each step's time
# limit comes from the budget named here; steps that share a budget share its seconds (the pip
# build and the plain CMake build it falls back to), so the budgets below are the most the steps
# can take together. They add up to 480 s: tests/python/test_gpu_check.py holds them to it, and to
# every step naming one of them. A step past its limit is stopped and reported, and the next runs.
declare -A budget=(
  [build]=170
  [cuda_tests]=60
  [offload_inputs]=40
  [plan_step]=50
  [overhead]=30
  [memory]=20
  [block]=30
  [offload]=45
  [memory_budget]=35
)
declare -A spent=()
built=0  # whether build_plugin succeeded: without a build, the other steps are not run

# A step that exits with this status ran on a build without the feature it checks: "not
# available in this build", not a failure (tools/gpu_check_features.py).
not_available=77

step() {  # step BUDGET NAME COMMAND...: runs one part (an external command), keeps going when it fails
  local key=$1 name=$2 limit rc started seconds result
  shift 2
  [ -n "${budget[$key]:-}" ] || fail "gpu_check: step \"$name\" names no budget ($key)"
  if [ "$key" != build ] && [ "$built" -eq 0 ]; then
    echo "!! $name: not run (the build failed)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$key" "not run (the build failed)" "" 0 >>"$steps_file"
    status=1
    return 1
  fi
  limit=$(( budget[$key] - ${spent[$key]:-0} ))
  if [ "$limit" -le 0 ]; then
    echo "!! $name: no time left of the $key budget (${budget[$key]} s)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$key" "not run" "" 0 >>"$steps_file"
    status=1
    return 1
  fi
  echo "== $name ($(date +%T), at most $limit s)"
  started=$SECONDS
  timeout "$limit" "$@"
  rc=$?
  seconds=$(( SECONDS - started ))
  spent[$key]=$(( ${spent[$key]:-0} + seconds ))
  case $rc in
    0) result=passed ;;
    "$not_available") result="not available in this build" ;;
    124) result="timed out"; status=1 ;;
    *) result=failed; status=1 ;;
  esac
  [ "$rc" -ne 0 ] && echo "!! $name: $result (exit $rc)"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$key" "$result" "$rc" "$seconds" >>"$steps_file"
  [ "$rc" -eq 0 ] || [ "$rc" -eq "$not_available" ]
}

# Builds the way users install: pip, no build isolation, against this python's torch. This
# machine has no network, so nothing can be fetched: with scikit-build-core installed for $python
# that is `pip install --no-build-isolation --no-index`; without it, or where that fails, a plain
# CMake build of the same CMakeLists.txt, loaded through SAC_PLUGIN_LIBRARY with the sources on
# PYTHONPATH (what the package would install, from the tree). No C++ tests: the machine has no
# GoogleTest.
build_plugin() {
  local pip_flags=(--no-build-isolation --no-deps --no-index --disable-pip-version-check)
  # A distribution's python (PEP 668) refuses pip installs unless told otherwise.
  if "$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    pip_flags+=(--break-system-packages)
  fi
  if "$python" -c 'import scikit_build_core' 2>/dev/null; then
    echo "-- scikit-build-core is installed for $python: pip install --no-build-isolation"
    step build "build and install (pip)" "$python" -m pip install "${pip_flags[@]}" -C "build-dir=$build/pip" \
      -C cmake.define.SAC_BUILD_TESTS=OFF "$root" && { built=1; return; }
    echo "-- the pip build failed; falling back to a plain CMake build in what is left of its time"
    status=0
  else
    echo "-- scikit-build-core is not installed for $python and cannot be fetched (no network):"
    echo "-- plain CMake build, loaded through SAC_PLUGIN_LIBRARY with the sources on PYTHONPATH"
  fi
  step build "configure" cmake -S "$root" -B "$build/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSAC_BUILD_TESTS=OFF -DSAC_PYTHON="$(command -v "$python")" \
    && step build "build" cmake --build "$build/cmake" -j "$(nproc)" \
    && built=1 \
    && export SAC_PLUGIN_LIBRARY="$build/cmake/libsac_plugin.so" PYTHONPATH="$root/python"
}

# The summary: one JSON line, the last of the log, for whoever reads the file by machine.
summary() {
  "$python" - "$steps_file" "$status" "$SECONDS" <<'PY'
import json, sys
steps = []
with open(sys.argv[1]) as lines:
    for line in lines:
        name, budget, result, code, seconds = line.rstrip("\n").split("\t")
        steps.append({"step": name, "budget": budget, "result": result,
                      "exit": int(code) if code else None, "seconds": int(seconds)})
print("gpu_check summary: " + json.dumps({"status": int(sys.argv[2]), "seconds": int(sys.argv[3]), "steps": steps}))
PY
}

mkdir -p "$build"
rm -rf "$results" && mkdir -p "$results"
: >"$steps_file"
{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  build_plugin
  # 1. The CUDA tests.
  step cuda_tests "CUDA tests" "$python" -m pytest tests/python/test_cuda.py -q -rs -p no:cacheprovider
  # 2. The features below full recompute, at realistic size.
  step offload_inputs "layer inputs offloaded (cuda, bf16, hidden 4096, seq 4096)" "$python" tools/gpu_check_features.py \
    offload-inputs --device cuda --json "$results/offload_inputs_cuda.json"
  step plan_step "plan_step for a peak (cuda, bf16, hidden 4096, seq 4096)" "$python" tools/gpu_check_features.py \
    plan-step --device cuda --json "$results/plan_step_cuda.json"
  # 3. The benchmarks, at sizes that fit their budgets.
  step overhead "overhead benchmark (cuda)" "$python" benchmarks/bench_overhead.py --device cuda --sizes 64 400 \
    --reps 5 --paths native --layers --json "$results/overhead_cuda.json"
  step memory "memory benchmark (cuda)" "$python" benchmarks/bench_memory.py --device cuda --dims 4096 --seqs 4096 \
    --json "$results/memory_cuda.json"
  step block "Llama block, bf16, hidden 4096, seq 4096" "$python" benchmarks/bench_block.py --device cuda \
    --dtype bfloat16 --dim 4096 --heads 32 --seq 4096 --steps 3 --json "$results/block_cuda.json"
  step offload "keep, offload or recompute: Llama block, bf16, hidden 4096, seq 4096" "$python" benchmarks/bench_offload.py \
    --device cuda --dtype bfloat16 --dim 4096 --heads 32 --seq 4096 --steps 2 --min-bytes 1048576 \
    --json "$results/offload_cuda.json"
  step memory_budget "memory-budget plans (cuda, CUDA-event kernel times)" "$python" benchmarks/bench_budget.py \
    --device cuda --sizes 1024x1024 --reps 3 --json "$results/budget_cuda.json"
  for json in "$results"/*.json; do
    [ -f "$json" ] && { echo "== results: $(basename "$json")"; cat "$json"; echo; }
  done
  echo "gpu_check: done, status $status"
  summary
  exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
