#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: builds this project against a CUDA-capable
# ggml, runs the GPU tests (hybrid placement on a real device) and the hybrid benchmark.
#
# Usage: scripts/gpu_check.sh --offline KIT [--install-only] [--work DIR]
#   With no network (a lent GPU machine): installs everything from KIT (made here by
#   scripts/gpu_kit.sh: a CUDA module built for sm_90, llama-cpp-python for any x86-64-v3
#   CPU, cp312 wheels), builds the C library with the machine's cores, runs
#   tests/test_device.py and tests/test_hybrid.py on the GPU, makes the 7B-shaped
#   synthetic pair and runs `bench hybrid` at budgets of 25/50/75% of the model against
#   llama-cpp-python's n_gpu_layers on the same memory, decode and prompt. Sized for 8
#   minutes on 16 cores. --install-only stops after the install and build (the proof of
#   scripts/gpu_kit.sh --prove runs that part here under `unshare -n`); --work is the
#   scratch folder (default /tmp/pi-kit). Interpreter: python3 (PI_KIT_PYTHON). It builds
#   into build/ of the tree it runs in (the tests look there): on a machine of your own, run
#   it in a copy, not in the checkout whose build/ you use.
#   Reading the output: docs/hybrid.md, "CUDA: the offline kit".
#
#        scripts/gpu_check.sh [--bench-model small|7b]
#   With a network and the CUDA toolkit: builds llama-cpp-python 0.3.36 with
#   -DGGML_CUDA=on for this machine's GPU architecture (scripts/setup.sh), then the same
#   tests and benchmark. small (default): the synthetic "small" preset, made in seconds;
#   7b: the 7B-shaped synthetic pair (made once, ~3.8 GB, minutes; cached). The machine
#   needs what scripts/setup.sh needs (PyPI, or a wheelhouse through PIP_FIND_LINKS=...
#   PIP_NO_INDEX=1).
#
# Results in either mode: $OUT (default ./gpu-check-out).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BENCH_MODEL=small
KIT=""
INSTALL_ONLY=0
WORK=/tmp/pi-kit
while [ $# -gt 0 ]; do
    case $1 in
        --bench-model) BENCH_MODEL=${2:?small or 7b}; shift ;;
        --offline) KIT=$(realpath -m "${2:?--offline needs the kit folder (scripts/gpu_kit.sh makes gpu-kit/)}"); shift ;;
        --install-only) INSTALL_ONLY=1 ;;
        --work) WORK=$(realpath -m "${2:?--work needs a folder}"); shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
t0=$(date +%s)
step() { printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*" | tee -a "$OUT/summary.txt"; }

if [ -n "$KIT" ]; then
    # ======================================================================= offline
    PY=${PI_KIT_PYTHON:-python3}
    [ -d "$KIT" ] || { echo "error: $KIT is not a folder; make the kit with scripts/gpu_kit.sh" >&2; exit 1; }
    : >"$OUT/summary.txt"
    step "check the kit ($KIT) against its manifest"
    "$PY" scripts/kit_tools.py verify "$KIT"
    sed 's/^/    /' "$KIT/info.txt"
    LLAMA_VERSION=$(sed -n 's/^llama-cpp-python==//p' vendor/ggml/PIN)

    step "install from the kit into $WORK (no network)"
    rm -rf "$WORK/site" "$WORK/cache"
    mkdir -p "$WORK/cache/ggml-src/$LLAMA_VERSION"
    xz -dc "$KIT/llama-cpp-python-site.tar.xz" | tar -xf - -C "$WORK"
    # --python-version and the platforms: the kit's wheels are cp312 manylinux; naming them
    # lets pip install them into a target folder from another interpreter too (the proof).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$WORK/site" \
        --only-binary :all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$KIT"/wheels/*.whl
    xz -dc "$KIT/libggml-cuda.so.xz" >"$WORK/libggml-cuda.so.tmp" && mv "$WORK/libggml-cuda.so.tmp" "$WORK/libggml-cuda.so"
    cp "$KIT/ggml-backend-impl.h" "$WORK/cache/ggml-src/$LLAMA_VERSION/"
    export PYTHONPATH=$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
    export POWERINFER_CACHE=$WORK/cache
    mods="llama_cpp, gguf, diskcache"
    [ "${PI_KIT_SKIP_CFFI_IMPORT:-0}" = 1 ] || mods="$mods, cffi"
    "$PY" -c "import $mods; print('    imported: $mods; llama-cpp-python', llama_cpp.__version__)"

    # The benchmark's synthetic pair takes minutes of one core (3 min 40 s here for the 7B
    # shape) and needs only what was just installed: it is made in the background while the
    # library builds and the tests run on the other cores.
    case ${PI_KIT_BENCH_PRESET:-7b} in
        7b) PRESET=7b; NAME=relu-7b-shaped ;;
        small) PRESET=small; NAME=small-relu ;;
        *) echo "error: PI_KIT_BENCH_PRESET must be 7b or small" >&2; exit 2 ;;
    esac
    SYN_PID=""
    if [ "$INSTALL_ONLY" = 0 ]; then
        "$PY" -m powerinfer_py.assets.synthetic --preset "$PRESET" --out "$WORK/syn" >"$OUT/synthetic.log" 2>&1 &
        SYN_PID=$!
        echo "    making the $PRESET synthetic pair in the background (pid $SYN_PID, log: $OUT/synthetic.log)"
    fi

    step "build the C library and the CLI (cmake, $(nproc) cores)"
    GEN=()
    command -v ninja >/dev/null && GEN=(-G Ninja)
    CMAKE=$(command -v cmake || echo "$(dirname "$PY")/cmake")
    {
        "$CMAKE" -S . -B build ${GEN[@]+"${GEN[@]}"} -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v "$PY")" \
            -DLLAMA_CPP_PYTHON_ROOT="$WORK/site"
        "$CMAKE" --build build -j "$(nproc)"
    } >"$OUT/build.log" 2>&1 || { tail -n 40 "$OUT/build.log" >&2; echo "error: the build failed (log: $OUT/build.log)" >&2; exit 1; }
    [ -f build/lib/libpowerinfer.so ] && [ -x build/bin/main ] || { echo "error: the build made no libpowerinfer.so or main" >&2; exit 1; }
    echo "    build/lib/libpowerinfer.so, build/bin/main (log: $OUT/build.log)"
    if [ "$INSTALL_ONLY" = 1 ]; then
        step "installed and built (--install-only)"
        exit 0
    fi

    if [ -n "${PI_KIT_REHEARSE_BACKEND:-}" ]; then
        # A rehearsal on a machine without CUDA: another ggml backend module (Vulkan on
        # lavapipe) stands in for the kit's, so the steps below run end to end.
        step "rehearsal: $PI_KIT_REHEARSE_BACKEND instead of the kit's CUDA module"
        export GGML_BACKEND_PATH=$PI_KIT_REHEARSE_BACKEND
    else
        step "the GPU and its CUDA libraries"
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv | tee "$OUT/gpu.txt"
        echo "    host: $(gcc --version 2>/dev/null | sed -n 1p); $("$PY" --version); $(nproc) cores; $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | sed -n 1p)" | tee -a "$OUT/gpu.txt"
        # libcublas.so.13 and libcudart.so.13: the Python's nvidia packages, else the toolkit.
        libdirs=$("$PY" -c 'import os, importlib.util
spec = importlib.util.find_spec("nvidia")
for p in (spec.submodule_search_locations if spec else []):
    for sub in ("cu13/lib", "cublas/lib", "cuda_runtime/lib"):
        if os.path.isdir(os.path.join(p, sub)):
            print(os.path.join(p, sub))' 2>/dev/null || true)
        LIBS=""
        for want in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
            found=""
            for d in $libdirs /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
                [ -e "$d/$want" ] && { found=$d; break; }
            done
            [ -n "$found" ] || found=$(find /usr /opt -name "$want" -print -quit 2>/dev/null | xargs -r dirname)
            [ -n "$found" ] || { echo "error: $want not found (the CUDA module needs it)" >&2; exit 1; }
            case ":$LIBS:" in *":$found:"*) ;; *) LIBS=${LIBS:+$LIBS:}$found ;; esac
            echo "    $want: $found"
        done
        export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        export GGML_BACKEND_PATH=$WORK/libggml-cuda.so
    fi
    "$PY" -c 'from powerinfer_py._core.devices import gpu_count; import sys; n = gpu_count(); print("    GPUs in ggml:", n); sys.exit(0 if n else 1)' \
        2>&1 | tee -a "$OUT/gpu.txt" || { echo "error: ggml lists no GPU with the kit's CUDA module" >&2; exit 1; }

    step "GPU tests: tests/test_device.py, tests/test_hybrid.py"
    # SmolLM2 (98 MB) does not travel in the 64 MiB: its tests skip (POWERINFER_NO_FETCH).
    set +e
    POWERINFER_NO_FETCH=1 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_device.py tests/test_hybrid.py \
        >"$OUT/tests.log" 2>&1
    tests_rc=$?
    set -e
    tail -n 15 "$OUT/tests.log"

    # PI_KIT_BENCH_PRESET=small: the small synthetic pair (a rehearsal's), in seconds.
    step "the $PRESET synthetic pair (started before the build)"
    wait "$SYN_PID" || { tail -n 20 "$OUT/synthetic.log" >&2; echo "error: the synthetic pair failed" >&2; exit 1; }
    tail -n 3 "$OUT/synthetic.log"
    step "hybrid benchmark: budgets 25/50/75% against llama-cpp-python -ngl"
    "$PY" -m powerinfer_py.bench hybrid --dense "$WORK/syn/$NAME.gguf" \
        --powerinfer "$WORK/syn/$NAME.powerinfer.gguf" --threads "$(nproc)" --n-gen 32 --n-prompt 256 \
        --emulate no --json "$OUT/bench_hybrid.json" 2>&1 | tee "$OUT/bench_hybrid.txt"
    step "done (tests exit $tests_rc); results in $OUT"
    exit "$tests_rc"
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv | tee "$OUT/gpu.txt"
command -v nvcc >/dev/null || { echo "error: nvcc (CUDA toolkit) not found" >&2; exit 1; }

step "llama-cpp-python with CUDA (this GPU's architecture only) + the project"
# CMAKE_ARGS is part of setup.sh's wheel-cache key: a CUDA wheel never replaces the CPU one.
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
./scripts/setup.sh 2>&1 | tee "$OUT/setup.log" | grep -E '^==>|error' || true
.venv/bin/python -c 'import llama_cpp, sys; ok = llama_cpp.llama_supports_gpu_offload(); print("GPU offload:", ok); sys.exit(0 if ok else 1)'

step "GPU tests (hybrid placement on the device; emulation tests run too)"
.venv/bin/python -m pytest -q tests/test_hybrid.py 2>&1 | tee "$OUT/tests.log"

step "hybrid benchmark ($BENCH_MODEL)"
SYN=${POWERINFER_CACHE:-$HOME/.cache/powerinfer-py}/synthetic
case $BENCH_MODEL in
    small) NAME=small-relu; PRESET=small ;;
    7b)    NAME=relu-7b-shaped; PRESET=7b ;;
    *)     echo "error: --bench-model small|7b" >&2; exit 1 ;;
esac
[ -f "$SYN/$NAME.powerinfer.gguf" ] || .venv/bin/python -m powerinfer_py.assets.synthetic --preset "$PRESET" --out "$SYN"
.venv/bin/python -m powerinfer_py.bench hybrid --dense "$SYN/$NAME.gguf" --powerinfer "$SYN/$NAME.powerinfer.gguf" \
    --threads "$(nproc)" --emulate no --json "$OUT/bench_hybrid.json" 2>&1 | tee "$OUT/bench_hybrid.txt"
step "done; results in $OUT"
