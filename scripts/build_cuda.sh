#!/usr/bin/env bash
# Build ggml's CUDA backend as a loadable backend module (libggml-cuda.so) from the
# llama-cpp-python sdist's ggml sources, linked against the installed wheel's
# libggml-base.so, into a cache folder; reuse it when it is there. The CPU wheel (the
# parity tests' reference) is not rebuilt or changed. A process loads the module with
# GGML_BACKEND_PATH=<module> (or ggml_backend_load); its GPUs then appear in ggml's device
# list. It needs nvcc (the CUDA toolkit) but no GPU and no driver: it builds on a CPU
# machine for a GPU machine (scripts/gpu_kit.sh packs it). docs/hybrid.md, "CUDA: the
# offline kit", has the recipe, times and sizes.
#
# Usage: scripts/build_cuda.sh                build (or reuse) and print the module path last
#        scripts/build_cuda.sh --print-path   print the cached module's path; exit 1 (and
#                                             build nothing) when it is not built
#        scripts/build_cuda.sh --cublas-dir   print the folder of the libcublas*.so.13 it
#                                             links against (for LD_LIBRARY_PATH); exit 1
#                                             when they are not unpacked
#
# Environment:
#   POWERINFER_CACHE           cache root (default ~/.cache/powerinfer-py); the module goes
#                              to $POWERINFER_CACHE/cuda-<key>/libggml-cuda.so, the cuBLAS
#                              wheel to $POWERINFER_CACHE/cuda-cublas/
#   POWERINFER_CUDA_ARCHS      CMAKE_CUDA_ARCHITECTURES (default 90-real: the H100/H200's
#                              sm_90 machine code, no PTX); part of <key>
#   POWERINFER_CUDA_FA_QUANTS  GGML_CUDA_FA_QUANTS, the FlashAttention vector kernels' K-V
#                              types (default ggml's: q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16)
#   NVCC                       the CUDA compiler (default: the nvcc of $CUDA_HOME,
#                              /usr/local/cuda, then the PATH's, resolved to the real file)
#   PYTHON                     interpreter whose site-packages hold llama-cpp-python
#                              (default .venv/bin/python)
#
# cuBLAS: a toolkit without it (this project's CPU machine has nvcc and cudart only) gets
# the headers and libcublas.so.13 from PyPI's nvidia-cublas wheel (pinned below, sha256-
# checked, 421 MB, downloaded once). The module needs libcudart.so.13 and libcublas.so.13
# (+ libcublasLt.so.13) on the library path at run time; a GPU machine has them in its
# CUDA toolkit or its Python's nvidia/cu13/lib.
#
# <key> hashes the llama-cpp-python version and sdist sha256, nvcc's version, the cuBLAS
# wheel, the architectures, the FlashAttention types, vendor/ggml/cuda/ (CMake glue and
# any patches) and this script's recipe version.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

MODE=build
for arg in "$@"; do
    case $arg in
        --print-path) MODE=print ;;
        --cublas-dir) MODE=cublas ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

quiet() { [ "$MODE" != build ]; }
phase() { quiet || printf '\n==> %s\n' "$*"; }
note() { quiet || printf '    %s\n' "$*"; }

# Bumped when the recipe below changes in a way that changes the module.
RECIPE=1
LLAMA_VERSION=$(sed -n 's/^llama-cpp-python==//p' vendor/ggml/PIN)
# sha256 of its sdist (also in scripts/setup.sh and powerinfer_py/assets/models.py).
LLAMA_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# cuBLAS of CUDA 13.0 (this machine's nvcc is 13.0): the oldest 13.x API, so the module
# runs with any libcublas.so.13 the GPU machine has.
CUBLAS_VERSION=13.0.2.14
CUBLAS_WHEEL=nvidia_cublas-$CUBLAS_VERSION-py3-none-manylinux_2_27_x86_64.whl
CUBLAS_SHA256=0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c
CACHE=${POWERINFER_CACHE:-$HOME/.cache/powerinfer-py}
SDIST=$CACHE/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz
CUBLAS_CACHE=$CACHE/cuda-cublas
CUBLAS_ROOT=$CUBLAS_CACHE/$CUBLAS_VERSION/nvidia/cu13
GLUE=$ROOT/vendor/ggml/cuda
shopt -s nullglob
PATCHES=("$GLUE"/patches/*.patch)
shopt -u nullglob
JOBS=$(nproc 2>/dev/null || echo 2)
VPY=${PYTHON:-$ROOT/.venv/bin/python}
CMAKE=cmake
[ -x "$ROOT/.venv/bin/cmake" ] && CMAKE=$ROOT/.venv/bin/cmake
ARCHS=${POWERINFER_CUDA_ARCHS:-90-real}
FA_QUANTS=${POWERINFER_CUDA_FA_QUANTS:-q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16}

if [ "$MODE" = cublas ]; then
    [ -f "$CUBLAS_ROOT/lib/libcublas.so.13" ] && { echo "$CUBLAS_ROOT/lib"; exit 0; }
    exit 1
fi

# --------------------------------------------------------------------------- nvcc
find_nvcc() {
    local c
    for c in ${NVCC:+"$NVCC"} ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
        [ -n "$c" ] && [ -x "$c" ] || continue
        # /usr/local/bin/nvcc may be a shell wrapper: CMake wants the compiler in its toolkit.
        if head -c 2 "$c" | grep -q '#!'; then
            local real
            real=$(sed -n 's/^exec \([^ ]*nvcc\) .*/\1/p' "$c" | head -n 1)
            [ -n "$real" ] && [ -x "$real" ] && c=$real
        fi
        readlink -f "$c"
        return 0
    done
    return 1
}
NVCC_BIN=$(find_nvcc) || {
    quiet && exit 1
    echo "error: nvcc (the CUDA toolkit) not found; set NVCC or CUDA_HOME" >&2; exit 1; }
NVCC_VERSION=$("$NVCC_BIN" --version | sed -n 's/.*release \([0-9.]*\), V\([0-9.]*\).*/\2/p')

# --------------------------------------------------------------------------- key
KEY=$( {
    printf 'recipe=%s\nllama-cpp-python==%s\nsdist=%s\nnvcc=%s\ncublas=%s %s\narchs=%s\nfa=%s\n' \
        "$RECIPE" "$LLAMA_VERSION" "$LLAMA_SDIST_SHA256" "$NVCC_VERSION" "$CUBLAS_VERSION" \
        "$CUBLAS_SHA256" "$ARCHS" "$FA_QUANTS"
    cat "$GLUE/CMakeLists.txt" ${PATCHES[@]+"${PATCHES[@]}"}
} | sha256sum | cut -c1-12)
OUT=$CACHE/cuda-$KEY
MODULE=$OUT/libggml-cuda.so

if [ "$MODE" = print ]; then
    [ -f "$MODULE" ] && { echo "$MODULE"; exit 0; }
    exit 1
fi

phase "ggml CUDA backend module: $OUT"
note "llama-cpp-python $LLAMA_VERSION, nvcc $NVCC_VERSION ($NVCC_BIN), cuBLAS $CUBLAS_VERSION"
note "CMAKE_CUDA_ARCHITECTURES=$ARCHS GGML_CUDA_FA_QUANTS=$FA_QUANTS"
mkdir -p "$OUT"

# Serialize concurrent builds on the same cache.
if command -v flock >/dev/null; then
    exec 9>"$OUT.lock"
    flock 9
fi

if [ -f "$MODULE" ]; then
    note "cached: $(du -h "$MODULE" | cut -f1) $(cat "$OUT/build-time.txt" 2>/dev/null || true)"
    echo "$MODULE"
    exit 0
fi

# The wheel's libggml-base.so: the module links against it (same ggml release, same ABI).
SITE_LIB=$("$VPY" -c 'import importlib.metadata as m, os, llama_cpp
assert m.version("llama_cpp_python") == "'"$LLAMA_VERSION"'", m.version("llama_cpp_python")
print(os.path.join(os.path.dirname(os.path.dirname(llama_cpp.__file__)), "lib"))') || {
    echo "error: llama-cpp-python $LLAMA_VERSION is not installed for $VPY; run scripts/setup.sh first" >&2
    exit 1; }
GGML_BASE=$SITE_LIB/libggml-base.so
[ -f "$GGML_BASE" ] || { echo "error: $GGML_BASE not found" >&2; exit 1; }

# --------------------------------------------------------------------------- cuBLAS
TOOLKIT=$(dirname "$(dirname "$NVCC_BIN")")
CUBLAS_ARGS=()
if compgen -G "$TOOLKIT/targets/*/include/cublas_v2.h" >/dev/null || [ -f "$TOOLKIT/include/cublas_v2.h" ]; then
    note "cuBLAS: the toolkit's ($TOOLKIT)"
else
    if [ ! -f "$CUBLAS_ROOT/lib/libcublas.so.13" ]; then
        phase "cuBLAS $CUBLAS_VERSION headers and libraries from PyPI's nvidia-cublas wheel"
        mkdir -p "$CUBLAS_CACHE"
        if ! printf '%s  %s\n' "$CUBLAS_SHA256" "$CUBLAS_CACHE/$CUBLAS_WHEEL" | sha256sum -c --status 2>/dev/null; then
            "$VPY" -m pip download --no-deps --only-binary :all: --python-version 3.12 \
                --platform manylinux_2_27_x86_64 -d "$CUBLAS_CACHE" "nvidia-cublas==$CUBLAS_VERSION"
            printf '%s  %s\n' "$CUBLAS_SHA256" "$CUBLAS_CACHE/$CUBLAS_WHEEL" | sha256sum -c --status || {
                echo "error: $CUBLAS_CACHE/$CUBLAS_WHEEL does not have the sha256 $CUBLAS_SHA256" >&2; exit 1; }
        fi
        rm -rf "$CUBLAS_CACHE/$CUBLAS_VERSION.tmp"
        mkdir -p "$CUBLAS_CACHE/$CUBLAS_VERSION.tmp"
        "$VPY" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = [n for n in z.namelist() if n.startswith("nvidia/cu13/include/cublas")
         or n in ("nvidia/cu13/lib/libcublas.so.13", "nvidia/cu13/lib/libcublasLt.so.13")]
z.extractall(sys.argv[2], names)' "$CUBLAS_CACHE/$CUBLAS_WHEEL" "$CUBLAS_CACHE/$CUBLAS_VERSION.tmp"
        rm -rf "$CUBLAS_CACHE/$CUBLAS_VERSION"
        mv "$CUBLAS_CACHE/$CUBLAS_VERSION.tmp" "$CUBLAS_CACHE/$CUBLAS_VERSION"
    fi
    note "cuBLAS: $CUBLAS_ROOT (nvidia-cublas $CUBLAS_VERSION)"
    CUBLAS_ARGS=(-DCUBLAS_INCLUDE_DIR="$CUBLAS_ROOT/include" -DCUDA_cublas_LIBRARY="$CUBLAS_ROOT/lib/libcublas.so.13"
                 -DCUDA_cublasLt_LIBRARY="$CUBLAS_ROOT/lib/libcublasLt.so.13")
fi

start=$(date +%s)
tmp=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The sdist's ggml (sha256-checked), our patches (if any) applied.
if ! printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status 2>/dev/null; then
    mkdir -p "$(dirname "$SDIST")"
    "$VPY" -m pip download --no-deps --no-binary :all: -d "$(dirname "$SDIST")" "llama-cpp-python==$LLAMA_VERSION"
    printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status || {
        echo "error: $SDIST does not have the sha256 $LLAMA_SDIST_SHA256; delete it and run again" >&2; exit 1; }
fi
SRC=$tmp/llama_cpp_python-$LLAMA_VERSION
tar -xzf "$SDIST" -C "$tmp" "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/ggml"
for p in ${PATCHES[@]+"${PATCHES[@]}"}; do
    note "patch: $(basename "$p")"
    patch -d "$SRC" -p1 --forward --quiet <"$p"
done
GGML_SRC=$SRC/vendor/llama.cpp/ggml

# ABI check: the public headers we compile against are the wheel's, so the structs and
# GGML_BACKEND_API_VERSION match the installed libggml-base; ggml_backend_load refuses a
# module whose API differs.
for h in ggml.h ggml-backend.h ggml-alloc.h ggml-cuda.h; do
    cmp -s "$GGML_SRC/include/$h" "$SITE_LIB/../include/$h" || {
        echo "error: $h of the sdist differs from the installed wheel's ($SITE_LIB/../include)" >&2; exit 1; }
done

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
{
    "$CMAKE" -S "$GLUE" -B "$tmp/build" ${GEN[@]+"${GEN[@]}"} \
        -DCMAKE_BUILD_TYPE=Release -DGGML_SOURCE_DIR="$GGML_SRC" -DGGML_BASE_LIBRARY="$GGML_BASE" \
        -DCMAKE_CUDA_COMPILER="$NVCC_BIN" -DCUDAToolkit_ROOT="$TOOLKIT" \
        -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -DGGML_CUDA_FA_QUANTS="$FA_QUANTS" \
        ${CUBLAS_ARGS[@]+"${CUBLAS_ARGS[@]}"}
    "$CMAKE" --build "$tmp/build" -j "$JOBS"
} 2>&1 | tee "$OUT/build.log"
built=$tmp/build/bin/libggml-cuda.so
[ -f "$built" ] || { echo "error: the build produced no $built (log: $OUT/build.log)" >&2; exit 1; }
# Per-file compile times (start, end ms, target) for measuring where the time goes.
[ -f "$tmp/build/.ninja_log" ] && cp "$tmp/build/.ninja_log" "$OUT/ninja_log.txt"
strip --strip-unneeded "$built" 2>/dev/null || true
mv "$built" "$MODULE.tmp" && mv "$MODULE.tmp" "$MODULE"
rm -rf "$tmp"
trap - EXIT

secs=$(( $(date +%s) - start ))
printf 'built in %d min %02d s on %d cores\n' $((secs / 60)) $((secs % 60)) "$JOBS" >"$OUT/build-time.txt"
printf 'recipe=%s\nllama-cpp-python==%s\nnvcc=%s\ncublas=%s\narchs=%s\nfa_quants=%s\nggml-base=%s\n' \
    "$RECIPE" "$LLAMA_VERSION" "$NVCC_VERSION" "$CUBLAS_VERSION" "$ARCHS" "$FA_QUANTS" "$GGML_BASE" >"$OUT/info.txt"
note "$(cat "$OUT/build-time.txt"), $(du -h "$MODULE" | cut -f1)"
echo "$MODULE"
