#!/usr/bin/env bash
# Build ggml's Vulkan backend as a loadable backend module (libggml-vulkan.so) from the
# llama-cpp-python sdist's ggml sources, linked against the installed wheel's
# libggml-base.so, into a cache folder; reuse it when it is there. The CPU wheel (the
# parity tests' reference) is not rebuilt or changed. A process loads the module with
# ggml_backend_load(path); its devices then appear in ggml's device list. Recipe, times,
# the patch and lavapipe's caveats: docs/hybrid.md#vulkan.
#
# Usage: scripts/build_vulkan.sh               build (or reuse) and print the module path last
#        scripts/build_vulkan.sh --print-path  print the cached module's path; exit 1 (and
#                                              build nothing) when it is not built
#
# Environment:
#   POWERINFER_CACHE           cache root (default ~/.cache/powerinfer-py); the module goes
#                              to $POWERINFER_CACHE/vulkan-<key>/libggml-vulkan.so
#   POWERINFER_VULKAN_CFLAGS   C/C++ flags of the build (default: those of the llama wheel,
#                              no AMX codegen on x86_64; part of <key>)
#   PYTHON                     interpreter whose site-packages hold llama-cpp-python
#                              (default .venv/bin/python)
#
# <key> hashes the llama-cpp-python version and sdist sha256, the flags, the Vulkan header
# version, glslc's version, vendor/ggml/vulkan/ (CMake glue and patches) and this script's
# build recipe version: a change to any of them builds another module beside the old one.
#
# Packages (Debian/Ubuntu, installed when missing and running as root):
#   libvulkan-dev glslc spirv-headers mesa-vulkan-drivers vulkan-tools
# Running on Mesa's software Vulkan (lavapipe) needs, like llama.cpp's own CI:
#   GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_F16=1 GGML_VK_DISABLE_COOPMAT=1
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

PRINT_PATH=0
for arg in "$@"; do
    case $arg in
        --print-path) PRINT_PATH=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

phase() { [ "$PRINT_PATH" = 1 ] || printf '\n==> %s\n' "$*"; }
note() { [ "$PRINT_PATH" = 1 ] || printf '    %s\n' "$*"; }

# Bumped when the recipe below changes in a way that changes the module.
RECIPE=1
LLAMA_VERSION=$(sed -n 's/^llama-cpp-python==//p' vendor/ggml/PIN)
# sha256 of its sdist (also in scripts/setup.sh and powerinfer_py/assets/models.py).
LLAMA_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE=${POWERINFER_CACHE:-$HOME/.cache/powerinfer-py}
SDIST=$CACHE/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz
GLUE=$ROOT/vendor/ggml/vulkan
PATCHES=("$GLUE"/patches/*.patch)
JOBS=$(nproc 2>/dev/null || echo 2)
VPY=${PYTHON:-$ROOT/.venv/bin/python}
CMAKE=cmake
[ -x "$ROOT/.venv/bin/cmake" ] && CMAKE=$ROOT/.venv/bin/cmake

if [ -n "${POWERINFER_VULKAN_CFLAGS+x}" ]; then
    VK_CFLAGS=$POWERINFER_VULKAN_CFLAGS
elif [ "$(uname -m)" = x86_64 ]; then
    VK_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # as the llama wheel (setup.sh)
else
    VK_CFLAGS=""
fi

# --------------------------------------------------------------------------- packages
APT_PKGS=(libvulkan-dev glslc spirv-headers mesa-vulkan-drivers vulkan-tools)
vk_header() {
    local h
    for h in ${VULKAN_SDK:+"$VULKAN_SDK/include/vulkan/vulkan_core.h"} /usr/include/vulkan/vulkan_core.h; do
        [ -f "$h" ] && { echo "$h"; return 0; }
    done
    return 1
}
have_tools() {
    vk_header >/dev/null && command -v glslc >/dev/null &&
        { [ -f /usr/include/spirv/unified1/spirv.hpp ] || [ -n "${VULKAN_SDK:-}" ] ||
          find /usr/share /usr/lib -name 'SPIRV-HeadersConfig.cmake' -print -quit 2>/dev/null | grep -q .; } &&
        # a Vulkan driver to run on (lavapipe, mesa-vulkan-drivers, when there is no GPU's)
        { [ -n "${VULKAN_SDK:-}" ] || compgen -G '/usr/share/vulkan/icd.d/*.json' >/dev/null ||
          compgen -G '/etc/vulkan/icd.d/*.json' >/dev/null; }
}
if ! have_tools; then
    if [ "$PRINT_PATH" = 1 ]; then
        exit 1
    fi
    phase "Vulkan build tools: ${APT_PKGS[*]}"
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${APT_PKGS[@]}"
    else
        echo "error: the Vulkan headers, glslc and SPIRV-Headers are missing; install" \
             "${APT_PKGS[*]} (or a Vulkan SDK with VULKAN_SDK set)" >&2
        exit 1
    fi
fi
VK_HEADER_VERSION=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' "$(vk_header)")
GLSLC_VERSION=$(glslc --version 2>/dev/null | sed -n 1p)  # not head: with pipefail its early exit can fail glslc (SIGPIPE)

# --------------------------------------------------------------------------- key
KEY=$( {
    printf 'recipe=%s\nllama-cpp-python==%s\nsdist=%s\nCFLAGS=%s\nVK_HEADER_VERSION=%s\nglslc=%s\n' \
        "$RECIPE" "$LLAMA_VERSION" "$LLAMA_SDIST_SHA256" "$VK_CFLAGS" "$VK_HEADER_VERSION" "$GLSLC_VERSION"
    cat "$GLUE/CMakeLists.txt" "${PATCHES[@]}"
} | sha256sum | cut -c1-12)
OUT=$CACHE/vulkan-$KEY
MODULE=$OUT/libggml-vulkan.so

if [ "$PRINT_PATH" = 1 ]; then
    [ -f "$MODULE" ] && { echo "$MODULE"; exit 0; }
    exit 1
fi

phase "ggml Vulkan backend module: $OUT"
note "llama-cpp-python $LLAMA_VERSION, Vulkan headers 1.x.$VK_HEADER_VERSION, $GLSLC_VERSION"
note "CFLAGS=CXXFLAGS='$VK_CFLAGS'"
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

start=$(date +%s)
tmp=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The sdist's ggml (sha256-checked), our patches applied.
if ! printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status 2>/dev/null; then
    mkdir -p "$(dirname "$SDIST")"
    "$VPY" -m pip download --no-deps --no-binary :all: -d "$(dirname "$SDIST")" "llama-cpp-python==$LLAMA_VERSION"
    printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status || {
        echo "error: $SDIST does not have the sha256 $LLAMA_SDIST_SHA256; delete it and run again" >&2; exit 1; }
fi
SRC=$tmp/llama_cpp_python-$LLAMA_VERSION
tar -xzf "$SDIST" -C "$tmp" "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/ggml"
for p in "${PATCHES[@]}"; do
    note "patch: $(basename "$p")"
    patch -d "$SRC" -p1 --forward --quiet <"$p"
done
GGML_SRC=$SRC/vendor/llama.cpp/ggml

# ABI check: the public headers we compile against are the wheel's (ggml-rpc.h differs by
# our RPC patch, which the module does not use), so the structs and GGML_BACKEND_API_VERSION
# match the installed libggml-base; ggml_backend_load refuses a module whose API differs.
for h in ggml.h ggml-backend.h ggml-alloc.h ggml-vulkan.h; do
    cmp -s "$GGML_SRC/include/$h" "$SITE_LIB/../include/$h" || {
        echo "error: $h of the sdist differs from the installed wheel's ($SITE_LIB/../include)" >&2; exit 1; }
done

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
{
    CFLAGS="$VK_CFLAGS" CXXFLAGS="$VK_CFLAGS" "$CMAKE" -S "$GLUE" -B "$tmp/build" "${GEN[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_SOURCE_DIR="$GGML_SRC" -DGGML_BASE_LIBRARY="$GGML_BASE"
    "$CMAKE" --build "$tmp/build" -j "$JOBS"
} 2>&1 | tee "$OUT/build.log"
built=$tmp/build/bin/libggml-vulkan.so
[ -f "$built" ] || { echo "error: the build produced no $built (log: $OUT/build.log)" >&2; exit 1; }
strip --strip-unneeded "$built" 2>/dev/null || true
mv "$built" "$MODULE.tmp" && mv "$MODULE.tmp" "$MODULE"
rm -rf "$tmp"
trap - EXIT

secs=$(( $(date +%s) - start ))
printf 'built in %d min %02d s on %d cores\n' $((secs / 60)) $((secs % 60)) "$JOBS" >"$OUT/build-time.txt"
printf 'recipe=%s\nllama-cpp-python==%s\nCFLAGS=%s\nVK_HEADER_VERSION=%s\nglslc=%s\nggml-base=%s\n' \
    "$RECIPE" "$LLAMA_VERSION" "$VK_CFLAGS" "$VK_HEADER_VERSION" "$GLSLC_VERSION" "$GGML_BASE" >"$OUT/info.txt"
note "$(cat "$OUT/build-time.txt"), $(du -h "$MODULE" | cut -f1)"
echo "$MODULE"
