"""The chat page at `/`: static files of the package (static/), no build step and nothing
fetched from elsewhere, so it works on a machine with no network. It chats over
/v1/chat/completions (streamed), names the model (/props), and shows tokens/s and the sparse
FFN share per layer, polled from /metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "index", "static_files"]

STATIC_DIR = Path(__file__).resolve().with_name("static")


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"cache-control": "no-cache"})


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)
