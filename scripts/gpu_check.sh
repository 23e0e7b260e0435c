#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and the CUDA toolkit (nvcc): builds
# llama-cpp-python 0.3.36 with -DGGML_CUDA=on for this machine's GPU architecture only,
# builds this project against it, runs the GPU tests (hybrid placement on a real device)
# and the hybrid benchmark. Sized for ~10 minutes on 16 cores.
#
# Usage: scripts/gpu_check.sh [--bench-model small|7b]
#   small (default): the synthetic "small" preset, made in seconds;
#   7b: the 7B-shaped synthetic pair (made once, ~3.8 GB, minutes; cached).
# The machine needs what scripts/setup.sh needs (PyPI, or a wheelhouse through
# PIP_FIND_LINKS=... PIP_NO_INDEX=1). Results: $OUT (default ./gpu-check-out).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BENCH_MODEL=small
[ "${1:-}" = "--bench-model" ] && BENCH_MODEL=${2:?small or 7b}
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
t0=$(date +%s)
step() { printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }

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
