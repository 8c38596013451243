#!/usr/bin/env bash
# The README's demo command: sets up, builds and installs the package, then trains a small GPT on
# CPU in three modes. Arguments go to tools/demo.py (--model dense|moe, --config FILE, ...).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/setup.sh"
bash "$root/tools/build.sh" >/dev/null
"${SAC_VENV:-$root/.venv}/bin/python" "$root/tools/demo.py" "$@"
