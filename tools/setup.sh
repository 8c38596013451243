#!/usr/bin/env bash
# Installs everything a fresh machine lacks: Debian build packages and a virtual environment
# with torch 2.13.0 (taken from this machine's disk; never a second torch download) and pytest.
# Idempotent: a second run installs nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${SAC_VENV:-$root/.venv}"
torch_version="${SAC_TORCH_VERSION:-2.13.0}"

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v ccache >/dev/null || need+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -d /usr/include/absl/container ] || need+=(libabsl-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, pytest, yaml" 2>/dev/null; then
  echo "setup: installing torch==$torch_version, pytest and pyyaml into $venv"
  "$venv/bin/pip" install -q "torch==$torch_version" pytest pyyaml numpy
fi
