#!/usr/bin/env bash
# Assemble gpu-kit/: what a lent GPU machine needs to run the GPU tests and the hybrid
# benchmark with no network (scripts/gpu_check.sh --offline gpu-kit). Runs here, on the
# CPU machine, with no GPU; docs/hybrid.md, "CUDA: the offline kit", says why each piece is
# built where it is and how long each step takes.
#
# The kit (git-ignored, at most 60 MiB; the device tool carries 64 MiB with the tree):
#   libggml-cuda.so.xz          ggml's CUDA backend for sm_90 as a loadable module
#                               (scripts/build_cuda.sh, ~42 min on 2 cores, cached)
#   llama-cpp-python-site.tar.xz  llama-cpp-python 0.3.36 as a site-packages folder, built
#                               for any x86-64-v3 CPU (AVX2/FMA/F16C/BMI2, GGML_NATIVE off:
#                               the GPU machine's CPU is not this one), its libraries stored
#                               once (a wheel stores six copies of each)
#   ggml-backend-impl.h         ggml's internal header our CMake build looks for
#   wheels/                     cp312 manylinux wheels of what the GPU machine lacks: cffi,
#                               pycparser, gguf, diskcache
#   info.txt, MANIFEST          versions and flags; sha256 and size of every file
#
# Usage: scripts/gpu_kit.sh [--out DIR]     (default gpu-kit/ in the checkout)
#        scripts/gpu_kit.sh --prove [DIR]   the offline proofs on this machine (no GPU):
#                                           install and build from the kit inside
#                                           `unshare -n`, resolve the cp312 wheels, and load
#                                           the CUDA module in a process that finds no GPU
# Environment: POWERINFER_CACHE (default ~/.cache/powerinfer-py), PYTHON (default .venv's).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
KIT=$ROOT/gpu-kit
MODE=build
while [ $# -gt 0 ]; do
    case $1 in
        --out) KIT=$(realpath -m "${2:?--out needs a folder}"); shift ;;
        --prove) MODE=prove; [ -n "${2:-}" ] && { KIT=$(realpath -m "$2"); shift; } ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

MAX_BYTES=$((60 * 1024 * 1024))
CACHE=${POWERINFER_CACHE:-$HOME/.cache/powerinfer-py}
VPY=${PYTHON:-$ROOT/.venv/bin/python}
LLAMA_VERSION=$(sed -n 's/^llama-cpp-python==//p' vendor/ggml/PIN)
# The Python packages the GPU machine lacks (device tool, KINDS.md), at the versions
# scripts/setup.sh installs here; and those it has, which their requirements may name.
KIT_PACKAGES=(cffi==2.1.1 pycparser==3.12 gguf==0.19.0 diskcache==5.6.3)
GPU_MACHINE_HAS=(numpy pyyaml requests tqdm jinja2 markupsafe typing-extensions pytest)
# x86-64-v3: every x86 server CPU since 2013 (Haswell, Zen 1) runs it.
PORTABLE_CMAKE_ARGS="-DGGML_RPC=on -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)

t0=$(date +%s)
phase() { printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
note() { printf '    %s\n' "$*"; }
tools() { "$VPY" "$ROOT/scripts/kit_tools.py" "$@"; }

# =========================================================================== prove
if [ "$MODE" = prove ]; then
    tools verify "$KIT" || { echo "error: $KIT is not a whole kit; run scripts/gpu_kit.sh first" >&2; exit 1; }
    phase "1/3 the cp312 wheels resolve with no index (pip --dry-run for Python 3.12)"
    # --no-deps: the wheels' own requirements are checked against the kit plus what the GPU
    # machine has (kit_tools.py closure), since those are not in the kit.
    "$VPY" -m pip install --dry-run --no-index --no-deps --only-binary :all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" --find-links "$KIT/wheels" --target /tmp/pi-kit-dry \
        "${KIT_PACKAGES[@]}" 2>&1 | grep -E '^Would install|ERROR' || true
    "$VPY" -m pip install --dry-run --no-index --no-deps --only-binary :all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" --find-links "$KIT/wheels" --target /tmp/pi-kit-dry \
        "${KIT_PACKAGES[@]}" >/dev/null
    tools closure "$KIT" "${GPU_MACHINE_HAS[@]}"
    note "every requirement is in the kit or on the GPU machine (${GPU_MACHINE_HAS[*]})"

    phase "2/3 install and build from the kit with no network (unshare -n)"
    command -v unshare >/dev/null || { echo "error: unshare (util-linux) is needed for the proof" >&2; exit 1; }
    WORK=$(mktemp -d /tmp/pi-kit-prove.XXXXXX)
    trap 'rm -rf "$WORK"' EXIT
    # A copy of the tracked tree (what the device tool sends), built from scratch.
    mkdir -p "$WORK/tree"
    git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$WORK/tree"
    # gpu_check.sh's own offline install and build steps, this machine's Python standing in
    # for the GPU machine's (the cp312 cffi cannot load in it: the step named in the docs).
    unshare -n --map-root-user bash -c '
        set -euo pipefail
        if python3 -c "import socket; socket.create_connection((\"pypi.org\", 443), timeout=5)" 2>/dev/null; then
            echo "error: the network is reachable inside unshare -n" >&2; exit 1
        fi
        echo "    network: unreachable (as on the GPU machine)"
        cd "$1/tree"
        PI_KIT_PYTHON="$2" PI_KIT_SKIP_CFFI_IMPORT=1 ./scripts/gpu_check.sh --offline "$3" --install-only --work "$1/kit-work"
    ' _ "$WORK" "$VPY" "$KIT"
    phase "3/3 the CUDA module loads where no GPU is (unshare -n): it must say so, not crash"
    MODULE=$WORK/kit-work/libggml-cuda.so
    CUBLAS=$("$ROOT/scripts/build_cuda.sh" --cublas-dir) || { echo "error: cuBLAS is not unpacked (scripts/build_cuda.sh)" >&2; exit 1; }
    CUDART=$(dirname "$(readlink -f "$(command -v nvcc)")")/../lib64
    # The library built from the kit (linked to the kit's portable ggml), the module beside it.
    probe=$(cd "$WORK/tree" && unshare -n --map-root-user env GGML_BACKEND_PATH=$MODULE LD_LIBRARY_PATH=$CUBLAS:$CUDART \
        POWERINFER_LIB=$WORK/tree/build/lib/libpowerinfer.so PYTHONPATH=$WORK/tree \
        "$VPY" -c 'from powerinfer_py._core.devices import gpu_count; print("GPUs listed:", gpu_count())' 2>&1) || {
        echo "$probe" >&2; echo "error: the probe failed" >&2; exit 1; }
    ldd "$WORK/tree/build/lib/libpowerinfer.so" | grep -E 'ggml-base|llama' | sed 's/^[[:space:]]*/    linked: /'
    ldd "$WORK/tree/build/lib/libpowerinfer.so" | grep -q "$WORK/kit-work/site/lib/libggml-base" \
        || { echo "error: the library built from the kit does not use the kit's ggml" >&2; exit 1; }
    echo "$probe" | sed 's/^/    /'
    echo "$probe" | grep -q "loaded CUDA backend" || { echo "error: the CUDA module did not load" >&2; exit 1; }
    echo "$probe" | grep -q "GPUs listed: 0" || { echo "error: a GPU was listed on a machine without one" >&2; exit 1; }
    phase "proofs passed"
    exit 0
fi

# =========================================================================== build
mkdir -p "$(dirname "$KIT")"
STAGE=$KIT.tmp
rm -rf "$STAGE"
mkdir -p "$STAGE/wheels"
trap 'rm -rf "$STAGE" "$STAGE.site"' EXIT

phase "1/5 ggml's CUDA backend module (scripts/build_cuda.sh; cached after the first build)"
MODULE=$("$ROOT/scripts/build_cuda.sh" | tail -n 1)
[ -f "$MODULE" ] || { echo "error: scripts/build_cuda.sh built no module" >&2; exit 1; }
note "$MODULE ($(du -h "$MODULE" | cut -f1)); compressing (xz -9, about 15 s)"
xz -9 -T1 -c "$MODULE" >"$STAGE/libggml-cuda.so.xz"

phase "2/5 llama-cpp-python $LLAMA_VERSION for any x86-64-v3 CPU (4 min 35 s on 2 cores the first time)"
# setup.sh's progress goes to stderr; its last line is the wheel's path.
WHEEL=$(CMAKE_ARGS="$PORTABLE_CMAKE_ARGS" "$ROOT/scripts/setup.sh" --llama-wheel-only | tee /dev/stderr | tail -n 1)
[ -f "$WHEEL" ] || { echo "error: no portable llama-cpp-python wheel was built" >&2; exit 1; }
note "$WHEEL"
# The module links against libggml-base by soname and ggml's API version: the portable
# build has the same sources, so the same exported symbols. Check rather than assume.
rm -rf "$STAGE.site"
tools site "$WHEEL" "$STAGE.site/site" | sed 's/^/    /'
missing=$(comm -23 <(nm -D --undefined-only "$MODULE" | awk '{print $2}' | grep '^ggml_' | sort -u) \
                   <(nm -D --defined-only "$STAGE.site/site/lib/libggml-base.so" | awk '{print $3}' | sort -u))
[ -z "$missing" ] || { echo "error: the portable libggml-base lacks symbols the CUDA module needs: $missing" >&2; exit 1; }
tar -C "$STAGE.site" -cf - site | xz -9 -T1 >"$STAGE/llama-cpp-python-site.tar.xz"

phase "3/5 ggml-backend-impl.h"
cp "$CACHE/ggml-src/$LLAMA_VERSION/ggml-backend-impl.h" "$STAGE/" 2>/dev/null \
    || { echo "error: $CACHE/ggml-src/$LLAMA_VERSION/ggml-backend-impl.h missing; run scripts/setup.sh" >&2; exit 1; }

phase "4/5 cp312 wheels: ${KIT_PACKAGES[*]}"
WHEELS_CACHE=$CACHE/gpu-kit-wheels
mkdir -p "$WHEELS_CACHE"
"$VPY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$WHEELS_CACHE" "${KIT_PACKAGES[@]}"
for spec in "${KIT_PACKAGES[@]}"; do
    name=${spec%%==*}; ver=${spec#*==}
    w=$(ls "$WHEELS_CACHE"/"${name}"-"${ver}"-*.whl 2>/dev/null | head -n 1)
    [ -n "$w" ] || { echo "error: no wheel of $spec in $WHEELS_CACHE" >&2; exit 1; }
    cp "$w" "$STAGE/wheels/"
    note "$(basename "$w")"
done
tools closure "$STAGE" "${GPU_MACHINE_HAS[@]}"

phase "5/5 info and manifest"
{
    echo "made: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
    echo "llama-cpp-python==$LLAMA_VERSION CMAKE_ARGS=$PORTABLE_CMAKE_ARGS"
    echo "wheel: $(basename "$WHEEL")"
    sed 's/^/cuda: /' "$(dirname "$MODULE")/info.txt"
    sed 's/^/cuda: /' "$(dirname "$MODULE")/build-time.txt"
    echo "python wheels: ${KIT_PACKAGES[*]}"
} >"$STAGE/info.txt"
tools manifest "$STAGE" | sed 's/^/    /'
size=$(tools size "$STAGE" | cut -d' ' -f1)
if [ "$size" -gt "$MAX_BYTES" ]; then
    echo "error: the kit is $size bytes, over the $MAX_BYTES limit" >&2
    exit 1
fi
rm -rf "$KIT" "$STAGE.site"
mv "$STAGE" "$KIT"
trap - EXIT
(cd "$KIT" && find . -type f | sort | xargs du -h) | sed 's/^/    /'
phase "kit: $KIT, $(tools size "$KIT")"
echo "on a lent GPU machine: scripts/gpu_check.sh --offline gpu-kit   (device tool: carry [\"gpu-kit\"])"
