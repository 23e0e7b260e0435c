"""OpenAI-compatible HTTP server over `powerinfer_py.Llama`: `python -m powerinfer_py.server`.

A drop-in for `python -m llama_cpp.server` (same flags, routes and request bodies), on
FastAPI + uvicorn: install them with `pip install 'powerinfer-py[server]'`.
`create_app` builds the ASGI app (`uvicorn --factory powerinfer_py.server.app:create_app`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any):
    """See powerinfer_py.server.app.create_app (imported on first use: it needs the extra)."""
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
