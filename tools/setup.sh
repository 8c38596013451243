#!/usr/bin/env bash
# Installs everything a fresh machine lacks: Debian build packages (cmake, ninja, g++, ccache,
# GoogleTest, abseil) and a virtual environment with torch (2.13.0 by default; SAC_TORCH_VERSION
# picks another), then what pyproject.toml declares for development: the build backend
# (scikit-build-core, needed in the venv because the package builds without isolation) and every
# extra (the test, docs and lint tools). Idempotent: a second run installs nothing. SAC_VENV picks
# the venv (default .venv). Nothing installed after torch may change it: the last line checks.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
want_torch="${SAC_TORCH_VERSION:-2.13.0}"

command -v python3 >/dev/null || fail "python3 is not installed; install Python >= 3.10 first"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "python3 is $(python3 -V 2>&1); sac_plugin needs Python >= 3.10"

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v ccache >/dev/null || need+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -d /usr/include/absl/container ] || need+=(libabsl-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  command -v apt-get >/dev/null || fail "missing ${need[*]} and no apt-get here; install them by hand"
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || fail "missing ${need[*]}; run as root or install sudo"
    sudo_cmd="sudo"
  fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x "$python" ]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
have_torch=$(venv_torch_version 2>/dev/null || true)
if [ "$have_torch" != "$want_torch" ]; then
  echo "setup: installing torch==$want_torch into $venv${have_torch:+ (it has torch $have_torch)}"
  "$venv/bin/pip" install -q "torch==$want_torch"
fi
# Everything else is what pyproject.toml declares, its one list of pins (tools/dev_requirements.py
# reads it): the build backend (needed in the venv because the package builds without isolation)
# and every extra (test, docs and lint tools, torch_remat for the benchmarks), then the
# [tool.sac_plugin] dev-no-deps list with --no-deps. pip may never change torch: the venv's torch
# is a constraint.
constraint=$(mktemp)  # the venv's torch, which pip must keep
trap 'rm -f "$constraint"' EXIT
echo "torch==$(venv_torch_version)" > "$constraint"
install_missing() {  # install_missing [--no-deps]: installs the declared requirements the venv lacks
  local listed requirements
  listed=$("$python" "$root/tools/dev_requirements.py" "$@" --missing) || fail "cannot read pyproject.toml's requirements"
  [ -n "$listed" ] || return 0
  mapfile -t requirements <<< "$listed"
  echo "setup: installing into $venv${1:+ ($1)}: ${requirements[*]}"
  "$venv/bin/pip" install -q "$@" -c "$constraint" "${requirements[@]}"
}
install_missing
# torchtitan 0.3.0 needs torch >= 2.13 (torch.distributed.fsdp.DataParallelMeshDims); on older
# torch its tests skip, saying so.
if [ "$(printf '%s\n' 2.13.0 "$want_torch" | sort -V | head -1)" = 2.13.0 ]; then
  install_missing --no-deps
fi
now_torch=$(venv_torch_version)
[ "$now_torch" = "$want_torch" ] || fail "torch in $venv is $now_torch after installing the extras, not $want_torch"
