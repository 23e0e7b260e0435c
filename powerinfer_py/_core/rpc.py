"""The RPC worker's core call (rpc_worker.c): this host's CPU served as a ggml-rpc device."""

from __future__ import annotations

from .bindings import lib
from .errors import core_error


def can_cap_memory() -> bool:
    """Whether this build can cap a worker's memory (libpowerinfer built with ggml-backend-impl.h)."""
    return bool(lib.powerinfer_rpc_can_cap_memory())


def serve(host: str, port: int, mem_bytes: int = 0, n_threads: int = 1) -> None:
    """Serve until the process ends; raises PowerInferError if the worker cannot start (the
    port is taken, ggml has no RPC backend, a cap this build cannot impose)."""
    lib.powerinfer_rpc_serve(host.encode(), int(port), int(mem_bytes), int(n_threads))
    raise core_error(f"powerinfer rpc-server on {host}:{port}")
