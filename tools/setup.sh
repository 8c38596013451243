#!/usr/bin/env bash
# Installs everything a fresh machine lacks: Debian build packages (cmake, ninja, g++, ccache,
# GoogleTest, abseil) and a virtual environment with torch (2.13.0 by default, taken from this
# machine's disk; SAC_TORCH_VERSION picks another), scikit-build-core (the build backend, needed
# in the venv because the package builds without isolation), the test tools and the lint and docs
# tools (.ci/run's lint job). Idempotent: a second run installs nothing. SAC_VENV picks the venv
# (default .venv). Nothing installed after torch may change it: the last line checks.
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
if ! "$python" -c "import scikit_build_core, pytest, yaml, hypothesis" 2>/dev/null; then
  echo "setup: installing scikit-build-core, pytest, pyyaml and hypothesis into $venv"
  "$venv/bin/pip" install -q "scikit-build-core>=0.10" pytest pyyaml hypothesis numpy
fi
# Optional-dependency test extras, so that their tests run rather than skip: transformers (the
# Hugging Face integration) and matplotlib (the report's chart). transformers goes in with
# --no-deps and its light dependencies by name, so that pip can never swap the venv's torch.
if ! "$python" -c "import transformers" 2>/dev/null; then
  echo "setup: installing transformers (no deps) and its light dependencies into $venv"
  "$venv/bin/pip" install -q --no-deps "transformers==5.24.0"
  "$venv/bin/pip" install -q "huggingface-hub>=1.31.0,<3.0" "tokenizers>=0.23.1,<0.24.0" "safetensors>=0.8.0" \
    "regex>=2025.10.22" "packaging>=20.0" "tqdm>=4.60" typer
fi
"$python" -c "import accelerate" 2>/dev/null || "$venv/bin/pip" install -q --no-deps "accelerate==1.15.0" "psutil>=5.9"  # Trainer's; its other imports (pyyaml, huggingface-hub, safetensors, numpy, packaging) are above
# torchtitan (the torchtitan integration's tests): --no-deps, with only what its model code and
# activation-checkpoint module import (tyro, spmd_types, and triton, which its expert-parallel
# kernels import at module level; the CUDA torch wheels already bring triton).
# torchtitan 0.3.0 needs torch >= 2.13 (torch.distributed.fsdp.DataParallelMeshDims); on older
# torch its tests skip, saying so.
if [ "$(printf '%s\n' 2.13.0 "$want_torch" | sort -V | head -1)" = 2.13.0 ] &&
   ! "$python" -c "import torchtitan.models.deepseek_v3, torchtitan.distributed.activation_checkpoint" 2>/dev/null; then
  echo "setup: installing torchtitan (no deps) and the modules its models import into $venv"
  "$venv/bin/pip" install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro==1.0.17" docstring-parser typeguard \
    typing-extensions
  "$python" -c "import triton" 2>/dev/null || "$venv/bin/pip" install -q --no-deps "triton==3.6.0"
fi
# torch_remat (Meta's region-based rematerialization, PyPI): the benchmarks measure the plugin
# side by side with it (benchmarks/bench_overhead.py, benchmarks/bench_budget.py). --no-deps: it needs
# only torch.
if ! "$python" -c "import torch_remat" 2>/dev/null; then
  echo "setup: installing torch_remat (no deps) into $venv"
  "$venv/bin/pip" install -q --no-deps "torch_remat==0.2.2"
fi
if ! "$python" -c "import matplotlib" 2>/dev/null; then
  echo "setup: installing matplotlib into $venv"
  "$venv/bin/pip" install -q matplotlib
fi
# The lint job's tools (.ci/run): import-linter checks the import contracts, mkdocs with the
# Material theme and mkdocstrings' Python handler builds the docs. None of them depends on torch.
if ! "$python" -c "import importlinter, mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
  echo "setup: installing import-linter, mkdocs-material and mkdocstrings[python] into $venv"
  "$venv/bin/pip" install -q "import-linter==2.17" "mkdocs-material==9.8.2" "mkdocstrings[python]==1.0.8" \
    "mkdocstrings-python==2.0.11"
fi
# The style checks (tools/lint.sh): ruff and clang-format, pinned so that every machine formats alike.
if [ ! -x "$venv/bin/ruff" ] || [ ! -x "$venv/bin/clang-format" ]; then
  echo "setup: installing ruff and clang-format into $venv"
  "$venv/bin/pip" install -q "ruff==0.14.14" "clang-format==21.1.8"
fi
now_torch=$(venv_torch_version)
[ "$now_torch" = "$want_torch" ] || fail "torch in $venv is $now_torch after installing the extras, not $want_torch"
