"""The devices placement can use, as the installed ggml sees them."""

from __future__ import annotations

from .bindings import ffi, lib


def gpu_count() -> int:
    """GPUs and integrated GPUs in the installed ggml's backend registry (CUDA, ROCm, Vulkan,
    Metal builds; RPC workers are not counted: they come with rpc_servers). 0: hybrid
    placement has no local device, and `emulate_device=True` stands one in."""
    return int(lib.powerinfer_gpu_count())


def buffer_type_names() -> list:
    """Each device's buffer type name in ggml's registry ("CPU", "Vulkan0", ...): what
    llama.cpp's --override-tensor can name."""
    n = lib.powerinfer_buffer_type_names(ffi.NULL, 0)
    buf = ffi.new("char[]", n + 1)
    lib.powerinfer_buffer_type_names(buf, n + 1)
    return [t for t in ffi.string(buf).decode().split(", ") if t]


def buffer_type_address(name: str) -> int:
    """The ggml_backend_buffer_type_t of that name, as an address (0: none by that name)."""
    buft = lib.powerinfer_buffer_type_by_name(name.encode())
    return 0 if buft == ffi.NULL else int(ffi.cast("uintptr_t", buft))
