#!/usr/bin/env bash
# Cross-build the kernels' C test drivers for aarch64 (64-bit ARM Linux) on an x86-64 machine,
# so that tests/test_input_sparse.py and tests/test_sparse_ops.py also run every aarch64 kernel
# level (scalar: armv8-a, dotprod: armv8.2-a+dotprod) under qemu-aarch64 user emulation.
#
#  1. ggml (ggml-base, ggml-cpu, ggml; no libllama, no RPC, no OpenMP) from the pinned
#     llama-cpp-python sdist's sources, for a generic armv8-a CPU (GGML_NATIVE=OFF), into
#     $POWERINFER_CACHE/aarch64-ggml-<key>/ (built once, about 2 min on 2 busy cores; then reused);
#  2. our drivers test-input-sparse-<level> and test-sparse-ops-<level> for every aarch64
#     level, in build-aarch64/ (cmake/aarch64-linux-gnu.cmake; vendor/ggml/find_ggml.cmake
#     pointed at that ggml by POWERINFER_GGML_ROOT). Neither the library nor `main` is built.
# tests/kernel_levels.py finds build-aarch64/ and runs its drivers as
#   qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu <a CPU of that level> build-aarch64/bin/<driver>
#
# Usage: scripts/build_aarch64.sh    build (or reuse) and print the drivers' folder last
#
# Environment:
#   POWERINFER_CACHE   cache root (default ~/.cache/powerinfer-py)
#   AARCH64_SYSROOT    the target's libc (default /usr/aarch64-linux-gnu: libc6-dev-arm64-cross)
#   PYTHON             interpreter used to download the sdist if it is not cached
#                      (default .venv/bin/python)
#
# <key> hashes the recipe version below, the llama-cpp-python version and sdist sha256, the
# cross compiler's version, ggml's CMake options and the toolchain file.
#
# Packages (Debian/Ubuntu, installed when missing and running as root):
#   qemu-user (or qemu-user-static), gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

for arg in "$@"; do
    case $arg in
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

phase() { printf '\n==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { echo "error: build_aarch64: $*" >&2; exit 1; }

# Bumped when the recipe below changes in a way that changes the built ggml.
RECIPE=1
LLAMA_VERSION=$(sed -n 's/^llama-cpp-python==//p' vendor/ggml/PIN)
# sha256 of its sdist (also in scripts/setup.sh and powerinfer_py/assets/models.py).
LLAMA_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE=${POWERINFER_CACHE:-$HOME/.cache/powerinfer-py}
SDIST=$CACHE/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz
SYSROOT=${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
TOOLCHAIN=$ROOT/cmake/aarch64-linux-gnu.cmake
BUILD=$ROOT/build-aarch64
JOBS=$(nproc 2>/dev/null || echo 2)
VPY=${PYTHON:-$ROOT/.venv/bin/python}
CMAKE=cmake
[ -x "$ROOT/.venv/bin/cmake" ] && CMAKE=$ROOT/.venv/bin/cmake
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
# A generic armv8-a ggml: it runs on every aarch64 CPU qemu emulates, so each of our levels
# is tested on a CPU that has only that level's features (tests/kernel_levels.py).
GGML_ARGS=(-DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8-a -DGGML_OPENMP=OFF
           -DGGML_RPC=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF
           -DCMAKE_BUILD_TYPE=Release)

[ "$(uname -m)" = x86_64 ] || die "this cross-builds on x86-64 (on an aarch64 machine the ordinary build/ has these levels)"

# --------------------------------------------------------------------------- packages
qemu_bin() { command -v qemu-aarch64 || command -v qemu-aarch64-static; }
have_tools() {
    qemu_bin >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null &&
        command -v aarch64-linux-gnu-g++ >/dev/null && [ -f "$SYSROOT/lib/libc.so.6" ]
}
if ! have_tools; then
    APT_PKGS=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu)
    qemu_bin >/dev/null || APT_PKGS+=(qemu-user)
    phase "cross tools: ${APT_PKGS[*]}"
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT_PKGS[@]}"; then
            # some releases ship only the static emulators
            APT_PKGS=("${APT_PKGS[@]/qemu-user/qemu-user-static}")
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT_PKGS[@]}" ||
                die "apt-get could not install ${APT_PKGS[*]}"
        fi
    else
        die "qemu-aarch64 and the aarch64 cross compilers are missing: install qemu-user (or qemu-user-static), gcc-aarch64-linux-gnu and g++-aarch64-linux-gnu (as root)"
    fi
    have_tools || die "still missing after apt-get: qemu-aarch64, aarch64-linux-gnu-gcc/g++ or $SYSROOT/lib/libc.so.6"
fi
QEMU=$(qemu_bin)
CC_VERSION=$(aarch64-linux-gnu-gcc --version | sed -n 1p)

# --------------------------------------------------------------------------- ggml, cached
KEY=$( {
    printf 'recipe=%s\nllama-cpp-python==%s\nsdist=%s\ncc=%s\nargs=%s\n' \
        "$RECIPE" "$LLAMA_VERSION" "$LLAMA_SDIST_SHA256" "$CC_VERSION" "${GGML_ARGS[*]}"
    cat "$TOOLCHAIN"
} | sha256sum | cut -c1-12)
GGML=$CACHE/aarch64-ggml-$KEY
phase "ggml for aarch64: $GGML"
note "$CC_VERSION; $($QEMU --version | sed -n 1p)"
mkdir -p "$CACHE"

# Serialize concurrent builds on the same cache.
if command -v flock >/dev/null; then
    exec 9>"$GGML.lock"
    flock 9
fi

if [ -f "$GGML/lib/cmake/ggml/ggml-config.cmake" ] && [ -f "$GGML/build-time.txt" ]; then
    note "cached ($(cat "$GGML/build-time.txt"))"
else
    note "building from the llama-cpp-python $LLAMA_VERSION sdist; about 2 min on 2 cores, once"
    start=$(date +%s)
    if ! printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status 2>/dev/null; then
        [ -x "$VPY" ] || die "$SDIST is not cached and there is no $VPY to download it: run scripts/setup.sh first"
        mkdir -p "$(dirname "$SDIST")"
        "$VPY" -m pip download --no-deps --no-binary :all: -d "$(dirname "$SDIST")" "llama-cpp-python==$LLAMA_VERSION"
        printf '%s  %s\n' "$LLAMA_SDIST_SHA256" "$SDIST" | sha256sum -c --status ||
            die "$SDIST does not have the sha256 $LLAMA_SDIST_SHA256; delete it and run again"
    fi
    rm -rf "$GGML"
    tmp=$(mktemp -d "$CACHE/.aarch64-ggml.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    tar -xzf "$SDIST" -C "$tmp" "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/ggml"
    SRC=$tmp/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/ggml
    # The sdist leaves out ggml.pc.in, which ggml's standalone build configures: an empty one.
    [ -f "$SRC/ggml.pc.in" ] || : >"$SRC/ggml.pc.in"
    LOG=$tmp/build.log
    if ! { "$CMAKE" -S "$SRC" -B "$tmp/build" "${GEN[@]}" -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" \
                -DCMAKE_INSTALL_PREFIX="$tmp/install" "${GGML_ARGS[@]}" >"$LOG" 2>&1 &&
           "$CMAKE" --build "$tmp/build" -j "$JOBS" 2>&1 | tee -a "$LOG" | grep --line-buffered -E '^\[[0-9]+/[0-9]+\]' |
               sed -u 's/^/    /' &&
           "$CMAKE" --install "$tmp/build" >>"$LOG" 2>&1; }; then
        cp "$LOG" "$CACHE/aarch64-ggml-$KEY.failed.log"
        tail -30 "$LOG" >&2
        die "the aarch64 ggml build failed (whole log: $CACHE/aarch64-ggml-$KEY.failed.log)"
    fi
    secs=$(( $(date +%s) - start ))
    printf 'built in %d min %02d s on %d cores' $((secs / 60)) $((secs % 60)) "$JOBS" >"$tmp/install/build-time.txt"
    cp "$LOG" "$tmp/install/build.log"
    mv "$tmp/install" "$GGML"
    rm -rf "$tmp" "$CACHE/aarch64-ggml-$KEY.failed.log"
    trap - EXIT
    note "$(cat "$GGML/build-time.txt")"
fi
if command -v flock >/dev/null; then
    flock -u 9
fi

# --------------------------------------------------------------------------- our drivers
phase "aarch64 test drivers: $BUILD"
CONF_LOG=$(mktemp)
configure() {
    "$CMAKE" -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" -DAARCH64_SYSROOT="$SYSROOT" \
        -DPOWERINFER_GGML_ROOT="$GGML" -DCMAKE_BUILD_TYPE=Release >"$CONF_LOG" 2>&1
}
# A build folder of another generator, ggml or toolchain is made anew.
if [ -f "$BUILD/CMakeCache.txt" ] &&
   ! { grep -qx "POWERINFER_GGML_ROOT:[A-Z]*=$GGML" "$BUILD/CMakeCache.txt" &&
       grep -qx "CMAKE_TOOLCHAIN_FILE:[A-Z]*=$TOOLCHAIN" "$BUILD/CMakeCache.txt"; }; then
    note "stale configuration: configuring anew"
    rm -rf "$BUILD"
fi
if ! configure; then
    rm -rf "$BUILD"
    configure || { cat "$CONF_LOG" >&2; die "configuring $BUILD failed (its output is above)"; }
fi
mv "$CONF_LOG" "$BUILD/configure.log"
LEVELS=$(sed -n 's/^PI_KERNEL_LEVELS:INTERNAL=//p' "$BUILD/CMakeCache.txt" | tr ';' ' ')
[ -n "$LEVELS" ] || die "no PI_KERNEL_LEVELS in $BUILD/CMakeCache.txt"
TARGETS=()
for level in $LEVELS; do
    TARGETS+=("test-input-sparse-$level" "test-sparse-ops-$level")
done
note "levels: $LEVELS"
if ! "$CMAKE" --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" 2>&1 | sed -u 's/^/    /'; then
    # no stale drivers: the tests must not pass on binaries of older sources
    for t in "${TARGETS[@]}"; do rm -f "$BUILD/bin/$t"; done
    die "building ${TARGETS[*]} for aarch64 failed (see the compiler's messages above)"
fi

# Each driver starts under qemu (its usage line): the ggml libraries and the libc are found.
for t in "${TARGETS[@]}"; do
    out=$("$QEMU" -L "$SYSROOT" "$BUILD/bin/$t" 2>&1 || true)
    case $out in
        *usage*) ;;
        *) die "$BUILD/bin/$t does not start under $QEMU: $out" ;;
    esac
done
note "built and starting under qemu: ${TARGETS[*]}"
echo "$BUILD"
