#!/usr/bin/env bash
# The README's test command: sets up, builds and installs the package, then runs every test,
# C++ (ctest, in the build tree) and Python (pytest, against the installed package).
# SAC_VENV and SAC_TORCH_VERSION pick another venv and torch (as .ci/run's version matrix does);
# arguments go to pytest. Two more settings, for CI:
#   SAC_TEST_SUITE=torch-sensitive  only the modules whose result can change with the torch version
#                                   (default all; NOTE: [Which runs a test module needs] in
#                                   tests/python/conftest.py says which and why);
#   SAC_TEST_WORKERS=N              each pytest run in N processes (pytest-xdist; default 1).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
# The settings are checked before anything is installed or built.
case "${SAC_TEST_SUITE:-all}" in
  all) torch_filter="" engine_filter="" ;;
  torch-sensitive) torch_filter=" and not torch_independent" engine_filter=" and not over_the_engines" ;;
  *) fail "SAC_TEST_SUITE=$SAC_TEST_SUITE: expected all or torch-sensitive" ;;
esac
workers=${SAC_TEST_WORKERS:-1}
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || fail "SAC_TEST_WORKERS=$workers: expected a number of processes, 1 or more"
bash "$root/tools/setup.sh"
bash "$root/tools/build.sh"
require_venv
build="${SAC_BUILD_DIR:-$root/build/torch-$torch_version}"
status=0
echo "== C++ tests (ctest)"
ctest_junit=$(results_file ctest.xml)
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" ${ctest_junit:+--output-junit "$ctest_junit"} || status=1
echo "== Python tests (pytest, against $(cd / && "$python" -c 'import sac_plugin; print(sac_plugin.__file__)'))"
cd "$root"
# The coexistence tests load another owner of the plugin's dispatch key, built in the same tree.
export SAC_TEST_FOREIGN_OWNER="$build/libsac_test_foreign_owner.so"
export SAC_TEST_BUILD_DIR="$build"  # the C++ test binaries, for tests that run them
parallel=()
if [ "$workers" -gt 1 ]; then
  "$python" -c 'import xdist' 2>/dev/null || fail "SAC_TEST_WORKERS=$workers needs pytest-xdist in $venv; run bash tools/setup.sh"
  parallel=(-n "$workers")
  # One worker per core already keeps the cores busy: torch's intra-op threads in each worker (and
  # in the interpreters its tests start) would only contend for them. The suite's tensors are small,
  # so the threads mostly wait, spinning: a third of the suite's CPU time on 2 cores.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
pytest_runs=0
run_pytest() {  # run_pytest LABEL [ENV=VALUE...] -- PYTEST ARGS...: one pytest run; exit 5 fails too
  local label=$1 rc=0 junit
  shift
  local env_args=()
  while [ "$1" != "--" ]; do env_args+=("$1"); shift; done
  shift
  pytest_runs=$((pytest_runs + 1))
  junit=$(results_file "pytest-$pytest_runs.xml")
  echo "== pytest: $label"
  env "${env_args[@]}" "$python" -m pytest tests/python "${parallel[@]}" ${junit:+--junitxml="$junit"} "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "test: pytest collected no tests (exit 5)" >&2; fi
  [ "$rc" -eq 0 ] || status=1
}
run_pytest "native engine, every test${torch_filter:+ that can tell torch versions apart}" -- \
  ${torch_filter:+-m "${torch_filter# and }"} "$@"
# The engine suite again, in the two other ways the plugin can run (tests specific to one engine
# skip themselves with the reason): beside another owner of its dispatch key (per-op kernels,
# NOTE: [Sharing the key with another owner]), and through torch's SAC (the dispatch-mode engine).
# The modules whose result no engine changes ran above (NOTE: [Which runs a test module needs]).
engine_suite="not slow and not engine_independent$torch_filter$engine_filter"
run_pytest "coexisting path (another owner of the key loaded first)" \
  SAC_TEST_PRELOAD_FOREIGN_OWNER="$SAC_TEST_FOREIGN_OWNER" -- -m "$engine_suite" -q "$@"
run_pytest "dispatch-mode engine (SAC_PLUGIN_ENGINE=dispatch_mode)" SAC_PLUGIN_ENGINE=dispatch_mode -- \
  -m "$engine_suite and not starts_each_engine" -q "$@"
exit "$status"
