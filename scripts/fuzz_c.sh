#!/usr/bin/env bash
# Coverage-guided fuzzing of the C core's file readers with libFuzzer (clang), under
# AddressSanitizer and UndefinedBehaviorSanitizer:
#   fuzz-gguf    the PWRI/GGUF header reader (src/powerinfer_c/gguf_reader.c)
#   fuzz-gpuidx  the gpuidx placement-cache parser (src/powerinfer_c/gpuidx.c)
# Usage: scripts/fuzz_c.sh [SECONDS]     (each target runs SECONDS, default 60, one after
#                                         the other; a 30-minute campaign: scripts/fuzz_c.sh 900)
# Environment: FUZZ_TARGETS ("gguf gpuidx"), FUZZ_MAX_LEN (16384), FUZZ_JOBS (1: parallel
# libFuzzer jobs per target, for machines with cores to spare).
#
# Installs clang and libFuzzer first when they are missing (Debian/Ubuntu, as root:
# apt-get install clang libclang-rt-<N>-dev); the build goes to build-fuzz/ (git-ignored),
# seeds are made at run time from the tests' crafted files (tests/fuzz/make_seeds.py), the
# corpus grows in build-fuzz/corpus/ between runs, and a crashing input is saved as
# build-fuzz/artifacts/<target>-crash-*. Prints executions, time and crashes per target;
# exits 1 on any crash, 77 when no libFuzzer can be had here.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

SECONDS_EACH=${1:-60}
TARGETS=${FUZZ_TARGETS:-gguf gpuidx}
MAX_LEN=${FUZZ_MAX_LEN:-16384}
JOBS=${FUZZ_JOBS:-1}
OUT=$ROOT/build-fuzz

note() { printf '==> %s\n' "$*"; }

# ---- a clang that links -fsanitize=fuzzer
find_clang() {
    local c
    for c in clang $(compgen -c clang- 2>/dev/null | grep -E '^clang-[0-9]+$' | sort -t- -k2 -rn | uniq); do
        command -v "$c" >/dev/null 2>&1 || continue
        if printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }\n' |
            "$c" -x c -fsanitize=fuzzer,address,undefined -o /dev/null - >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

CLANG=$(find_clang || true)
if [ -z "$CLANG" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    note "installing clang and libFuzzer (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends clang >/dev/null
    # libFuzzer's runtime is a separate package (only recommended by clang's): libclang-rt-<major>-dev
    major=$(clang --version 2>/dev/null | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)
    if [ -n "$major" ]; then
        apt-get install -y -qq --no-install-recommends "libclang-rt-$major-dev" >/dev/null 2>&1 || true
    fi
    CLANG=$(find_clang || true)
fi
if [ -z "$CLANG" ]; then
    echo "fuzz_c.sh: no clang with libFuzzer (-fsanitize=fuzzer) here, and none could be installed" >&2
    exit 77
fi
note "compiler: $CLANG ($("$CLANG" --version | head -1))"

# ---- the build (the core's readers and the fuzz targets only)
[ -x .venv/bin/python ] || ./scripts/setup.sh
CMAKE=cmake
[ -x .venv/bin/cmake ] && CMAKE=.venv/bin/cmake
CC_PATH=$(command -v "$CLANG")
# A cache made with another compiler is dropped first: CMake would reset it itself, but then
# it forgets the other -D options of this same command (Python3_EXECUTABLE among them).
if [ -f "$OUT/CMakeCache.txt" ] && ! grep -qx "CMAKE_C_COMPILER:[A-Z]*=$CC_PATH" "$OUT/CMakeCache.txt"; then
    rm -rf "$OUT/CMakeCache.txt" "$OUT/CMakeFiles"
fi
"$CMAKE" -S . -B "$OUT" -DCMAKE_C_COMPILER="$CC_PATH" -DPOWERINFER_FUZZ=ON \
    -DPython3_EXECUTABLE="$ROOT/.venv/bin/python" -DCMAKE_BUILD_TYPE=Release >"$OUT.cmake.log" 2>&1 ||
    { cat "$OUT.cmake.log" >&2; exit 1; }
rm -f "$OUT.cmake.log"
"$CMAKE" --build "$OUT" -j "$(nproc 2>/dev/null || echo 2)" --target $(printf 'fuzz-%s ' $TARGETS) >/dev/null

# ---- seeds from the tests' files, regenerated each run
rm -rf "$OUT/seeds"
.venv/bin/python tests/fuzz/make_seeds.py "$OUT/seeds"
mkdir -p "$OUT/artifacts" "$OUT/logs"

. "$ROOT/scripts/fuzz_common.sh"
status=0
summary=()
for t in $TARGETS; do
    corpus=$OUT/corpus/$t
    mkdir -p "$corpus"
    log=$OUT/logs/$t.log
    note "fuzz-$t for ${SECONDS_EACH}s (corpus $corpus, log $log)"
    args=(-max_total_time="$SECONDS_EACH" -max_len="$MAX_LEN" -timeout=10 -rss_limit_mb=2048
          -dict=tests/fuzz/gguf.dict -artifact_prefix="$OUT/artifacts/$t-" -print_final_stats=1)
    [ "$JOBS" -gt 1 ] && args+=(-fork="$JOBS" -ignore_crashes=0)
    # env -u LD_PRELOAD: the fuzzers carry clang's own ASan runtime, and gcc's, which
    # scripts/sanitize.sh preloads into the test run (make_seeds above needs it), cannot live
    # beside it ("linked against incompatible ASan runtimes", abort)
    fuzz_target "$t" "$corpus" "$log" "$OUT/artifacts" env -u LD_PRELOAD "$OUT/bin/fuzz-$t" "${args[@]}" "$corpus" "$OUT/seeds/$t"
done
printf '\n'
printf '%s\n' "${summary[@]}"
exit $status
