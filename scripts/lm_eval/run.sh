#!/usr/bin/env bash
# lm-eval-harness's `local-completions` backend against `python -m powerinfer_py.server
# --n_parallel 4`, with 4 requests in flight (num_concurrent=4), on a local task (zen.yaml:
# the Zen of Python from CPython's `this` module; no dataset hub is needed).
#
#   scripts/lm_eval/run.sh [MODEL.gguf]      (default: SmolLM2-135M-Instruct)
#
# lm-eval is not a dependency of the project: it goes into its own venv ($LMEVAL_VENV,
# default ~/.cache/powerinfer-py/lmeval-venv) with the CPU build of torch it requires.
# Writes the results and the server's /metrics after the run to $OUT (default
# ~/.cache/powerinfer-py/lm-eval-zen).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || "$ROOT/scripts/setup.sh"
CACHE=$("$PY" -c "from powerinfer_py.assets.models import cache_dir; print(cache_dir())")
VENV=${LMEVAL_VENV:-$CACHE/lmeval-venv}
OUT=${OUT:-$CACHE/lm-eval-zen}
MODEL=${1:-$("$PY" -m powerinfer_py.assets.models path smollm2)}
PORT=${PORT:-8791}
if [ ! -x "$VENV/bin/lm_eval" ]; then
    echo "==> installing lm-eval into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0   # the CPU build on disk; lm-eval would pull a CUDA one
    "$VENV/bin/pip" install -q "lm-eval[api]"
fi
mkdir -p "$OUT"
"$PY" "$HERE/make_zen.py" "$HERE/zen.jsonl" > /dev/null

echo "==> server: $MODEL, --n_parallel 4" >&2
"$PY" -m powerinfer_py.server --model "$MODEL" --host 127.0.0.1 --port "$PORT" --n_ctx 512 \
    --n_parallel 4 --n_threads 2 --n_threads_batch 2 --verbose false > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/props"; echo

echo "==> lm_eval local-completions, num_concurrent=4" >&2
cd "$HERE"
HF_DATASETS_OFFLINE=1 "$VENV/bin/lm_eval" --model local-completions \
    --model_args "model=smollm2,base_url=http://127.0.0.1:$PORT/v1/completions,num_concurrent=4,max_retries=1,tokenized_requests=False,tokenizer_backend=None" \
    --tasks zen_of_python --include_path "$HERE" --output_path "$OUT" --log_samples 2>&1 | tee "$OUT/lm_eval.log"
curl -sf "http://127.0.0.1:$PORT/metrics" | grep -v '^#' > "$OUT/metrics.txt"
cat "$OUT/metrics.txt"
