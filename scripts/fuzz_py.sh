#!/usr/bin/env bash
# Coverage-guided fuzzing of the Python package's untrusted-input entry points with atheris
# (libFuzzer for Python):
#   fuzz-pt_io      powerinfer_py.formats.pt_io.load (PyTorch .pt archives, restricted unpickler)
#   fuzz-tokenizer  Llama.tokenize / detokenize / token_to_piece and the chat template, on
#                   SmolLM2-135M's vocabulary (vocab_only)
# Usage: scripts/fuzz_py.sh [SECONDS]     (each target runs SECONDS, default 60, one after
#                                         the other; a 15-minute campaign: scripts/fuzz_py.sh 450)
# Environment: FUZZ_PY_TARGETS ("pt_io tokenizer"), FUZZ_MAX_LEN (8192), FUZZ_RSS_MB (2048),
# FUZZ_TIMEOUT (10 s per input), POWERINFER_FUZZ_MODEL (a GGUF for fuzz-tokenizer instead
# of the tests' SmolLM2, fetched by powerinfer_py.assets.models when missing).
#
# The targets are tests/fuzz/py/fuzz_<target>.py; seeds are made at run time
# (tests/fuzz/py/make_seeds.py), the corpus grows in build-fuzz/py/corpus/<target>
# (git-ignored) between runs, and a failing input is saved as
# build-fuzz/py/artifacts/<target>-{crash,timeout,oom}-*. Reproduce one with
#   .venv/bin/python tests/fuzz/py/fuzz_<target>.py build-fuzz/py/artifacts/<file>
# Prints executions, time and crashes per target; exits 1 on any crash (a Python exception
# the target does not allow, a native crash, a hang or a memory blow-up), 77 when atheris
# cannot be imported here.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

SECONDS_EACH=${1:-60}
TARGETS=${FUZZ_PY_TARGETS:-pt_io tokenizer}
MAX_LEN=${FUZZ_MAX_LEN:-8192}
RSS_MB=${FUZZ_RSS_MB:-2048}
TIMEOUT=${FUZZ_TIMEOUT:-10}
OUT=$ROOT/build-fuzz/py
PY=$ROOT/.venv/bin/python
FUZZ_DIR=$ROOT/tests/fuzz/py

note() { printf '==> %s\n' "$*"; }

[ -x "$PY" ] || ./scripts/setup.sh
if ! "$PY" -c 'import atheris' 2>/dev/null; then
    echo "fuzz_py.sh: atheris cannot be imported by $PY (pip install atheris)" >&2
    exit 77
fi

# ---- seeds from the tests' files, regenerated each run
rm -rf "$OUT/seeds"
mkdir -p "$OUT/artifacts" "$OUT/logs"
"$PY" "$FUZZ_DIR/make_seeds.py" "$OUT/seeds"

. "$ROOT/scripts/fuzz_common.sh"
status=0
summary=()
for t in $TARGETS; do
    corpus=$OUT/corpus/$t
    mkdir -p "$corpus"
    log=$OUT/logs/$t.log
    note "fuzz-$t for ${SECONDS_EACH}s (corpus $corpus, log $log)"
    args=(-max_total_time="$SECONDS_EACH" -max_len="$MAX_LEN" -timeout="$TIMEOUT" -rss_limit_mb="$RSS_MB"
          -artifact_prefix="$OUT/artifacts/$t-" -print_final_stats=1)
    [ -f "$FUZZ_DIR/$t.dict" ] && args+=(-dict="$FUZZ_DIR/$t.dict")
    # the tokenizer's C++ is not instrumented: value profiles of the Python-side checks of
    # its output (ids against the vocabulary) are its only feedback
    [ "$t" = tokenizer ] && args+=(-use_value_profile=1)
    # PYTHONHASHSEED: a fixed hash order keeps the instrumented code's paths reproducible
    fuzz_target "$t" "$corpus" "$log" "$OUT/artifacts" \
        env PYTHONHASHSEED=0 "$PY" "$FUZZ_DIR/fuzz_$t.py" "${args[@]}" "$corpus" "$OUT/seeds/$t"
done
printf '\n'
printf '%s\n' "${summary[@]}"
exit $status
