# The shell helpers every script in tools/ (and .ci/run) sources: where the checkout is, which venv
# and python it uses, and one way to stop with a message. Sourcing it sets:
#   root     the checkout (the directory above tools/)
#   venv     the virtual environment: SAC_VENV, else $root/.venv
#   python   $venv/bin/python
#   fail     fail MESSAGE...: prints "<script>: MESSAGE" to stderr and exits 1
#   venv_torch_version  prints the version of the venv's torch (no local suffix: 2.13.0)
#   require_venv        stops with what to run first unless the venv imports torch; then sets
#                       torch_version
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${SAC_VENV:-$root/.venv}"
python="$venv/bin/python"
script_name=$(basename "${BASH_SOURCE[1]:-$0}" .sh)

fail() {
  echo "$script_name: $*" >&2
  exit 1
}

venv_torch_version() {
  "$python" -c 'import torch; print(torch.__version__.split("+")[0])'
}

require_venv() {
  [ -x "$python" ] || fail "no virtual environment at $venv; run bash tools/setup.sh first"
  torch_version=$(venv_torch_version 2>/dev/null) || fail "torch is not importable by $python; run bash tools/setup.sh first"
}

# Where a script writes its runs' structured results (JUnit XML: ctest's and each pytest run's),
# for .ci/run to read: SAC_TEST_RESULTS_DIR, unset outside CI. results_file NAME prints the path
# for NAME (creating the folder), or nothing when no folder was asked for.
results_file() {
  [ -n "${SAC_TEST_RESULTS_DIR:-}" ] || return 0
  mkdir -p "$SAC_TEST_RESULTS_DIR"
  echo "$SAC_TEST_RESULTS_DIR/$1"
}
