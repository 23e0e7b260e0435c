#!/usr/bin/env bash
# Set up this checkout from nothing (Debian, Python >= 3.9, gcc, cmake): .venv, a cached
# source build of llama-cpp-python 0.3.36 (our ggml + libllama), the Python deps, the
# project itself (editable) and the CLI in build/bin. Idempotent: re-running skips what
# is done and only re-runs the (incremental) CMake build.
#
# Environment:
#   POWERINFER_CACHE          cache root (default ~/.cache/powerinfer-py), shared with
#                             powerinfer_py.assets.models; the llama wheel goes to
#                             $POWERINFER_CACHE/wheels-llama-<hash>/
#   CMAKE_ARGS                passed to the llama-cpp-python build (default "-DGGML_RPC=on":
#                             ggml's RPC backend, for `powerinfer rpc-server` and --rpc;
#                             e.g. "-DGGML_RPC=on -DGGML_CUDA=on"); part of <hash>, so a
#                             different value builds another wheel
#   POWERINFER_LLAMA_CFLAGS   C/C++ flags of that build (default on x86_64: no AMX, see below)
#   PYTHON                    interpreter that creates .venv (default python3)
#   POWERINFER_VULKAN=1       same as --vulkan
#
# Options:
#   --vulkan            also build (or reuse) ggml's Vulkan backend as a loadable module,
#                       beside the unchanged CPU wheel: scripts/build_vulkan.sh,
#                       docs/hybrid.md#vulkan
#   --llama-wheel-only  build (or reuse) the llama-cpp-python wheel for this CMAKE_ARGS and
#                       POWERINFER_LLAMA_CFLAGS, print its path last, and stop: nothing is
#                       installed into .venv (scripts/gpu_kit.sh packs a portable one)
set -euo pipefail

VULKAN=${POWERINFER_VULKAN:-0}
WHEEL_ONLY=0
for arg in "$@"; do
    case $arg in
        --vulkan) VULKAN=1 ;;
        --llama-wheel-only) WHEEL_ONLY=1 ;;
        *) echo "error: unknown argument '$arg' (setup.sh [--vulkan] [--llama-wheel-only])" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

LLAMA_VERSION=0.3.36
# sha256 of its sdist (also in powerinfer_py/assets/models.py, which fetches the same file).
LLAMA_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE=${POWERINFER_CACHE:-$HOME/.cache/powerinfer-py}
VENV=$ROOT/.venv
VPY=$VENV/bin/python
JOBS=$(nproc 2>/dev/null || echo 2)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$JOBS}
# Python deps of the project, its tests and its build (we build with --no-build-isolation
# so the build sees the installed llama-cpp-python). llama-cpp-python is installed with
# --no-deps; numpy, typing-extensions, diskcache and jinja2 are its runtime deps.
# The server and langchain extras, and what their tests drive them with (httpx, the
# official openai and anthropic clients, selenium for the chat page in Debian's headless
# Chromium, which scripts/test.sh installs, langchain-community's LlamaCpp classes), are
# installed too,
# import-linter, whose lint-imports checks the package's layers (tests/test_layers.py),
# atheris (coverage-guided fuzzing of the Python readers, tests/fuzz/) and schemathesis
# (the server against its own OpenAPI schema, tests/test_server_schema.py), and
# starlette-context, which llama-cpp-python's own server needs (the baseline of
# `python -m powerinfer_py.bench parallel`).
DEPS=(numpy cffi gguf jinja2 diskcache typing-extensions pytest pytest-benchmark
      scikit-build-core cmake ninja
      fastapi uvicorn sse-starlette pydantic-settings httpx openai anthropic selenium
      langchain-core langchain-community import-linter atheris schemathesis starlette-context)

phase() { printf '\n==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }

# --------------------------------------------------------------------------- venv
phase "virtual environment: $VENV"
if [ ! -x "$VPY" ]; then
    PY=${PYTHON:-python3}
    if ! "$PY" -m venv "$VENV"; then
        # Debian ships venv's ensurepip in a separate package.
        rm -rf "$VENV"
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
            apt-get update -qq
            apt-get install -y -qq "python${pyver}-venv" || apt-get install -y -qq python3-venv
            "$PY" -m venv "$VENV"
        else
            echo "error: '$PY -m venv' failed; install your distribution's python3-venv package" >&2
            exit 1
        fi
    fi
    note "created with $("$VPY" --version)"
else
    note "exists ($("$VPY" --version))"
fi
if ! "$VPY" -m pip --version >/dev/null 2>&1; then
    "$VPY" -m ensurepip --default-pip
fi
PIP=("$VPY" -m pip)

# --------------------------------------------------------------------------- llama-cpp-python wheel
# A default source build of llama-cpp-python 0.3.36 segfaults at the first decode on
# CPUs with AMX (gcc miscompiles ggml's AMX tile setup, llama.cpp issue 20824): build
# without AMX codegen, which keeps AVX512/VNNI/BF16. pip's wheel cache ignores CFLAGS,
# so we build explicitly (--no-cache-dir) into a folder keyed by the flags.
if [ -n "${POWERINFER_LLAMA_CFLAGS+x}" ]; then
    LLAMA_CFLAGS=$POWERINFER_LLAMA_CFLAGS
elif [ "$(uname -m)" = x86_64 ]; then
    LLAMA_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
else
    LLAMA_CFLAGS=""  # the -mno-amx-* options exist only on x86
fi
LLAMA_CMAKE_ARGS=${CMAKE_ARGS:--DGGML_RPC=on}
# Our patches of the sdist's sources (vendor/ggml/patches/, each says why), part of the key.
PATCHES=("$ROOT"/vendor/ggml/patches/*.patch)
LLAMA_KEY=$( { printf 'llama-cpp-python==%s\nCFLAGS=%s\nCXXFLAGS=%s\nCMAKE_ARGS=%s\n' \
    "$LLAMA_VERSION" "$LLAMA_CFLAGS" "$LLAMA_CFLAGS" "$LLAMA_CMAKE_ARGS"; cat "${PATCHES[@]}"; } | sha256sum | cut -c1-12)
WHEEL_DIR=$CACHE/wheels-llama-$LLAMA_KEY
phase "llama-cpp-python $LLAMA_VERSION wheel: $WHEEL_DIR"
note "CFLAGS=CXXFLAGS='$LLAMA_CFLAGS' CMAKE_ARGS='$LLAMA_CMAKE_ARGS'"
mkdir -p "$WHEEL_DIR"

# The sdist (sha256-checked, cached beside the models): the wheel is built from it.
SDIST_DIR=$CACHE/sdist
SDIST=$SDIST_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz
ensure_sdist() {
    if ! printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status 2>/dev/null; then
        mkdir -p "$SDIST_DIR"
        "${PIP[@]}" download --no-deps --no-binary :all: -d "$SDIST_DIR" "llama-cpp-python==$LLAMA_VERSION"
        printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status || {
            echo "error: $SDIST does not have the sha256 $LLAMA_SDIST_SHA256; delete it and run again" >&2; exit 1; }
    fi
}

find_llama_wheel() {  # $1: folder. Its wheels are py3-none-<platform>: any Python 3 takes them.
    local w
    for w in "$1"/llama_cpp_python-"$LLAMA_VERSION"-*.whl; do
        [ -f "$w" ] && { echo "$w"; return 0; }
    done
    return 1
}

# Serialize concurrent set-ups (two checkouts, CI and a developer) on the same cache.
if command -v flock >/dev/null; then
    exec 9>"$WHEEL_DIR.lock"
    flock 9
fi

WHEEL=$(find_llama_wheel "$WHEEL_DIR" || true)
if [ -z "$WHEEL" ]; then
    note "building from source; the first build takes ~10 minutes (2 cores), later runs reuse it"
    tmp=$(mktemp -d "$WHEEL_DIR/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    # The sdist, our patches applied.
    ensure_sdist
    tar -xzf "$SDIST" -C "$tmp"
    if ! command -v patch >/dev/null; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && apt-get install -y -qq patch
        else
            echo "error: 'patch' is needed to build llama-cpp-python with our patches; install it" >&2; exit 1
        fi
    fi
    for p in "${PATCHES[@]}"; do
        note "patch: $(basename "$p")"
        patch -d "$tmp/llama_cpp_python-$LLAMA_VERSION" -p1 --forward --quiet <"$p"
    done
    CFLAGS="$LLAMA_CFLAGS" CXXFLAGS="$LLAMA_CFLAGS" CMAKE_ARGS="$LLAMA_CMAKE_ARGS" \
        "${PIP[@]}" wheel --no-deps --no-cache-dir -w "$tmp" "$tmp/llama_cpp_python-$LLAMA_VERSION" 2>&1 | tee "$WHEEL_DIR/build.log"
    built=$(find_llama_wheel "$tmp") || { echo "error: the build produced no wheel in $tmp" >&2; exit 1; }
    mv "$built" "$WHEEL_DIR/"
    WHEEL=$WHEEL_DIR/$(basename "$built")
    rm -rf "$tmp"
    trap - EXIT
    printf 'CFLAGS=%s\nCXXFLAGS=%s\nCMAKE_ARGS=%s\n' "$LLAMA_CFLAGS" "$LLAMA_CFLAGS" \
        "$LLAMA_CMAKE_ARGS" >"$WHEEL_DIR/flags.txt"
else
    note "cached: $(basename "$WHEEL")"
fi
[ -f "$WHEEL_DIR/flags.txt" ] || printf 'CFLAGS=%s\nCXXFLAGS=%s\nCMAKE_ARGS=%s\n' \
    "$LLAMA_CFLAGS" "$LLAMA_CFLAGS" "$LLAMA_CMAKE_ARGS" >"$WHEEL_DIR/flags.txt"
if command -v flock >/dev/null; then
    flock -u 9
fi
if [ "$WHEEL_ONLY" = 1 ]; then
    echo "$WHEEL"
    exit 0
fi

phase "install llama-cpp-python into .venv"
installed=$("$VPY" -c 'import importlib.metadata as m
try:
    print(m.version("llama_cpp_python"))
except m.PackageNotFoundError:
    print("none")')
LLAMA_STAMP=$VENV/.powerinfer-llama-wheel
want="$LLAMA_KEY $(basename "$WHEEL")"
if [ "$installed" = "$LLAMA_VERSION" ] && [ "$(cat "$LLAMA_STAMP" 2>/dev/null)" = "$want" ]; then
    note "already installed ($installed, from $(basename "$WHEEL_DIR"))"
else
    # --force-reinstall: a 0.3.36 from elsewhere (PyPI's cache, other flags) is replaced.
    "${PIP[@]}" install --no-deps --force-reinstall "$WHEEL"
    echo "$want" >"$LLAMA_STAMP"
fi

# --------------------------------------------------------------------------- ggml's internal header
# The RPC worker's memory cap (src/powerinfer_c/rpc_worker.c) wraps ggml's CPU device, whose
# structs are in ggml-backend-impl.h, which llama-cpp-python does not install: take it from
# the same sdist (CMakeLists.txt looks for it here).
GGML_SRC=$CACHE/ggml-src/$LLAMA_VERSION
if [ ! -f "$GGML_SRC/ggml-backend-impl.h" ]; then
    phase "ggml-backend-impl.h from the llama-cpp-python sdist"
    ensure_sdist
    mkdir -p "$GGML_SRC"
    # a temporary of its own: set-ups of two checkouts may run at once
    impl_tmp=$(mktemp "$GGML_SRC/.ggml-backend-impl.h.XXXXXX")
    tar -xzf "$SDIST" -O "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/ggml/src/ggml-backend-impl.h" >"$impl_tmp"
    mv "$impl_tmp" "$GGML_SRC/ggml-backend-impl.h"
fi

# --------------------------------------------------------------------------- Python deps
phase "Python dependencies"
DEPS_STAMP=$VENV/.powerinfer-deps
if [ "$(cat "$DEPS_STAMP" 2>/dev/null)" = "${DEPS[*]}" ]; then
    note "already installed: ${DEPS[*]}"
else
    "${PIP[@]}" install "${DEPS[@]}"
    echo "${DEPS[*]}" >"$DEPS_STAMP"
fi
# PyTorch (CPU build) for `powerinfer relufy` and its tests: the `pipeline` extra.
if ! "$VPY" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install torch==2.13.0 || note "torch==2.13.0 is not installable here: relufy's tests will be skipped"
fi

# --------------------------------------------------------------------------- the project
# Reinstall when the build inputs change: build files, C sources, the llama wheel, and
# the list of Python files (an editable install maps files known at install time).
project_hash() {
    {
        for f in pyproject.toml CMakeLists.txt; do
            [ -f "$f" ] && sha256sum "$f"
        done
        for d in src include vendor cmake tools; do
            [ -d "$d" ] && find "$d" -type f -print0 | sort -z | xargs -0 -r sha256sum
        done
        [ -d powerinfer_py ] && find powerinfer_py -type f -name '*.py' | sort
        [ -f "$GGML_SRC/ggml-backend-impl.h" ] && echo ggml-backend-impl
        echo "$want"
    } | sha256sum | cut -c1-16
}

phase "project (editable install, --no-build-isolation)"
PROJECT_STAMP=$VENV/.powerinfer-project
h=$(project_hash)
if [ "$(cat "$PROJECT_STAMP" 2>/dev/null)" = "$h" ]; then
    note "up to date"
else
    rm -f "$PROJECT_STAMP"
    "${PIP[@]}" install --no-build-isolation -e .
    echo "$h" >"$PROJECT_STAMP"
fi

# --------------------------------------------------------------------------- the CLI
phase "CLI (cmake build in build/)"
CMAKE=cmake
[ -x "$VENV/bin/cmake" ] && CMAKE=$VENV/bin/cmake
"$CMAKE" -S . -B build -DPython3_EXECUTABLE="$VPY" -DCMAKE_BUILD_TYPE=Release
"$CMAKE" --build build -j "$JOBS"

# --------------------------------------------------------------------------- Vulkan (opt-in)
if [ "$VULKAN" = 1 ]; then
    PYTHON=$VPY "$ROOT/scripts/build_vulkan.sh"
fi

phase "setup done"
