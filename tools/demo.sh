#!/usr/bin/env bash
# The README's demo command: sets up, builds, then trains a small GPT on CPU in three modes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/setup.sh"
bash "$root/tools/build.sh" >/dev/null
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" "${SAC_VENV:-$root/.venv}/bin/python" "$root/tools/demo.py" "$@"
