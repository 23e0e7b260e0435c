"""The devices placement can use, as the installed ggml sees them."""

from __future__ import annotations

from .bindings import lib


def gpu_count() -> int:
    """GPUs and integrated GPUs in the installed ggml's backend registry (CUDA, ROCm, Vulkan,
    Metal builds; RPC workers are not counted: they come with rpc_servers). 0: hybrid
    placement has no local device, and `emulate_device=True` stands one in."""
    return int(lib.powerinfer_gpu_count())
