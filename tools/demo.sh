#!/usr/bin/env bash
# The README's demo command: sets up, builds and installs the package, then runs the demo,
# examples/demo.py (trains a small GPT on CPU in three modes). Arguments go to the demo
# (--model gpt|dense|moe, --config FILE, --report, ...; --help lists them).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
bash "$root/tools/setup.sh"
bash "$root/tools/build.sh" >/dev/null
exec "$python" "$root/examples/demo.py" "$@"
