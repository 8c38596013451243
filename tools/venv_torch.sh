# Sourced by tools/build.sh and tools/sanitize.sh (which define $root and fail()): the project's
# venv, its python and the version of its torch, or one clear line saying what to run first.
venv="${SAC_VENV:-$root/.venv}"
python="$venv/bin/python"
[ -x "$python" ] || fail "no virtual environment at $venv; run bash tools/setup.sh first"
torch_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) \
  || fail "torch is not importable by $python; run bash tools/setup.sh first"
