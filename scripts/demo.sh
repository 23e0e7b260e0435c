#!/usr/bin/env bash
# Set up (if needed), fetch SmolLM2-135M-Instruct and generate 64 tokens with build/bin/main.
# Usage: scripts/demo.sh [PROMPT] [extra arguments for main, e.g. --vram-budget 1 -t 2]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

./scripts/setup.sh

printf '\n==> %s\n' "model: smollm2"
MODEL=$(.venv/bin/python -m powerinfer_py.assets.models path smollm2)
echo "    $MODEL"

PROMPT="The three most important things about running language models locally are"
if [ $# -gt 0 ]; then
    PROMPT=$1
    shift
fi

printf '\n==> %s\n' "build/bin/main -m $MODEL -p \"$PROMPT\" -n 64 $*"
exec build/bin/main -m "$MODEL" -p "$PROMPT" -n 64 "$@"
