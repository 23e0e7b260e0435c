#!/usr/bin/env bash
# The C core and its C tests under AddressSanitizer and UndefinedBehaviorSanitizer.
# Usage: scripts/sanitize.sh [pytest arguments]   (default: the whole suite, tests/)
#
# 1. builds everything in build-asan/ (git-ignored) with -DPOWERINFER_SANITIZE=address,undefined
#    (gcc; every report is fatal: -fno-sanitize-recover=all);
# 2. runs the C test drivers through tests/test_sparse_ops.py, leak checking on;
# 3. runs the Python tests (all of them unless told) on the sanitized libpowerinfer (POWERINFER_LIB, libasan
#    preloaded into Python, leak checking off there: the interpreter is not instrumented);
#    the CLI and drivers the tests call are the sanitized ones (tests/sanitize_plugin.py).
# Exits non-zero on any sanitizer report or test failure.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=$ROOT/build-asan
SAN=${POWERINFER_SANITIZERS:-address,undefined}

[ -x .venv/bin/python ] || ./scripts/setup.sh
CMAKE=cmake
[ -x .venv/bin/cmake ] && CMAKE=.venv/bin/cmake
printf '==> build (%s) in %s\n' "$SAN" "$OUT"
"$CMAKE" -S . -B "$OUT" -DPOWERINFER_SANITIZE="$SAN" -DPython3_EXECUTABLE="$ROOT/.venv/bin/python" \
    -DCMAKE_BUILD_TYPE=Release >"$OUT.cmake.log" 2>&1 || { cat "$OUT.cmake.log" >&2; exit 1; }
rm -f "$OUT.cmake.log"
"$CMAKE" --build "$OUT" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

LIBASAN=$(${CC:-gcc} -print-file-name=libasan.so)
[ -e "$LIBASAN" ] || { echo "sanitize.sh: no libasan.so next to ${CC:-gcc}" >&2; exit 1; }
# libstdc++ is preloaded too: Python is C, so when libllama (C++) is dlopen'ed later, ASan's
# __cxa_throw interceptor has no real function to call and the first C++ exception (libllama
# refusing a file, in the fallback tests) dies in "CHECK failed: real___cxa_throw != 0".
LIBSTDCXX=$(${CXX:-g++} -print-file-name=libstdc++.so)
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export POWERINFER_SANITIZE_BIN=$OUT/bin
# The aarch64 drivers under qemu (scripts/build_aarch64.sh) are not sanitized builds: their
# tests run in scripts/test.sh, not again here.
export POWERINFER_AARCH64=0 POWERINFER_REQUIRE_AARCH64=0
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider -p sanitize_plugin)
export PYTHONPATH=$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}

printf '\n==> C test drivers (ASan with leak checks, UBSan)\n'
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 "${PYTEST[@]}" tests/test_sparse_ops.py

if [ $# -eq 0 ]; then
    set -- tests  # the whole suite: a subset once hid qsort(NULL, 0) on every greedy token (issue 28)
fi
printf '\n==> Python tests on the sanitized library: %s\n' "$*"
export LD_PRELOAD="$LIBASAN $LIBSTDCXX" POWERINFER_LIB=$OUT/lib/libpowerinfer.so ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
# First make sure that the library the tests load is the sanitized one, with ASan running.
.venv/bin/python - <<'PY'
import os
from powerinfer_py._core.bindings import lib, library_path  # loads it
maps = open("/proc/self/maps").read()
assert str(library_path()) == os.environ["POWERINFER_LIB"] and os.environ["POWERINFER_LIB"] in maps, library_path()
assert "libasan" in maps and "libubsan" in maps, "ASan/UBSan runtimes are not loaded"
print("    loaded", library_path(), "with libasan and libubsan")
PY
"${PYTEST[@]}" "$@"
printf '\n==> sanitize.sh: clean\n'
