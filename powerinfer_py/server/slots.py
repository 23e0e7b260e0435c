"""llama-server's slot routes: GET /slots (each slot's state) and, with --slot_save_path DIR,
POST /slots/{id_slot}?action=save|restore|erase (a slot's prompt cache to a file and back).

A slot is one of --n_parallel sequences of a ParallelLlama (the model itself without
--n_parallel). Its cache is saved with Llama.save_state (a slot saves its own sequence of the
shared KV cache, powerinfer_state_seq_save) and restored with Llama.load_state: the restored
slot holds the same tokens and keys/values, so the next request that starts with them
continues exactly as it would have on the slot that saved them. A busy slot's action waits
until its request ends, as llama-server defers it.

A slot file: the magic b"PWRSLOT1", a little-endian uint32 n and n bytes of a JSON header
(the model file's sha256 and name, the slot's n_ctx, the number of tokens, the seed, the
state's size), the tokens (int32 LE), then the core's state bytes. Restore refuses a file of another
model file or context size, or one whose parts do not add up, before touching the slot.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

import numpy as np
from fastapi import Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from .engine import ServerState
from .errors import APIError, json_response

__all__ = ["SlotActionRequest", "get_slots", "slot_action", "check_filename"]

_MAGIC = b"PWRSLOT1"
_HEADER_MAX = 1 << 16
_NAME_MAX = 255


class SlotActionRequest(BaseModel):
    filename: Optional[str] = Field(default=None, description="A file name in --slot_save_path (save, restore).")


def _state(request: Request) -> ServerState:
    return request.app.state.powerinfer


def get_slots(request: Request, fail_on_no_slot: Optional[bool] = Query(default=None)) -> Response:
    """llama-server's GET /slots: per slot its id, n_ctx, whether it is processing, its running
    (or last) task's id and parameters, next_token (n_decoded, n_remain), and n_past (tokens
    its cache holds). `?fail_on_no_slot=1`: 503 when every slot is busy."""
    state = _state(request)
    state.require_proxy()
    out: List[Dict[str, Any]] = []
    for slot_id, llama in enumerate(state.engine.slots()):
        task = state.slot_tasks.get(slot_id) or {}
        processing = bool(task.get("is_processing"))
        params = dict(task.get("params") or {})
        n_predict = params.get("n_predict", -1)
        n_decoded = int(task.get("n_decoded", 0))
        out.append({
            "id": slot_id,
            "id_task": task.get("id_task", -1),
            "n_ctx": llama.n_ctx() if llama is not None else 0,
            "speculative": getattr(llama, "_drafter", None) is not None,
            "is_processing": processing,
            "params": params,
            "next_token": {"has_next_token": processing, "n_remain": max(n_predict - n_decoded, 0) if n_predict > 0 else -1,
                           "n_decoded": n_decoded},
            "n_past": int(llama.n_tokens) if llama is not None else 0,
        })  # fmt: skip
    if fail_on_no_slot and out and all(s["is_processing"] for s in out):
        raise APIError(503, "no slot available", type="unavailable_error", code="no_slot_available")
    return json_response(out)


def check_filename(name: Any) -> str:
    """A slot file's name: a plain file name, inside --slot_save_path (400 otherwise)."""
    if not isinstance(name, str) or not name:
        raise APIError(400, "filename is required: a file name in --slot_save_path", param="filename")
    bad = (len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX or "/" in name or "\\" in name or ".." in name
           or name in (".",) or name != name.strip() or any(ord(c) < 32 or ord(c) == 127 for c in name))
    if bad:
        raise APIError(400, f"invalid filename {name!r}: a plain file name is needed (no path separators, no '..', "
                       f"no control characters, at most {_NAME_MAX} bytes)", param="filename", code="invalid_value")
    return name


# Model file -> (size, mtime, sha256): the identity a slot file records, hashed once.
_MODEL_HASHES: Dict[str, Tuple[int, float, str]] = {}


def _model_identity(path: str) -> Dict[str, str]:
    st = os.stat(path)
    known = _MODEL_HASHES.get(path)
    if known is None or known[:2] != (st.st_size, st.st_mtime):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        known = _MODEL_HASHES[path] = (st.st_size, st.st_mtime, digest.hexdigest())
    return {"model_sha256": known[2], "model_file": os.path.basename(path)}


def _save(llama: Any, path: Path, model_path: str) -> Tuple[int, int]:
    """Write the slot's cache to `path` (through a temporary file: never a half-written one)."""
    state = llama.save_state()
    n_tokens = int(state.n_tokens)
    data = bytes(state.llama_state)[: state.llama_state_size]
    header = json.dumps({"format": 1, **_model_identity(model_path), "n_ctx": llama.n_ctx(), "n_tokens": n_tokens,
                         "seed": int(state.seed), "state_bytes": len(data)}).encode()
    tokens = np.asarray(state.input_ids[:n_tokens], dtype="<i4").tobytes()
    blob = _MAGIC + struct.pack("<I", len(header)) + header + tokens + data
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n_tokens, len(blob)


def _bad_file(name: str, why: str) -> APIError:
    return APIError(400, f"{name} is not a slot file of this server: {why}", param="filename", code="invalid_slot_file")


def _restore(llama: Any, path: Path, model_path: str) -> Tuple[int, int]:
    """Load `path` into the slot: every check first, then Llama.load_state."""
    from ..llama import LlamaState

    name = path.name
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise APIError(404, f"no slot file {name} in --slot_save_path", param="filename", code="file_not_found") from None
    if len(blob) < len(_MAGIC) + 4 or not blob.startswith(_MAGIC):
        raise _bad_file(name, "no slot file header")
    (n_header,) = struct.unpack_from("<I", blob, len(_MAGIC))
    start = len(_MAGIC) + 4
    if n_header > _HEADER_MAX or start + n_header > len(blob):
        raise _bad_file(name, "its header is cut short")
    try:
        header = json.loads(blob[start : start + n_header])
    except ValueError:
        raise _bad_file(name, "its header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != 1:
        raise _bad_file(name, "an unknown format")
    identity = _model_identity(model_path)
    if header.get("model_sha256") != identity["model_sha256"]:
        raise APIError(400, f"{name} was saved from another model ({header.get('model_file')!r}); this server runs "
                       f"{identity['model_file']!r}", param="filename", code="model_mismatch")
    n_ctx = llama.n_ctx()
    if header.get("n_ctx") != n_ctx:
        raise APIError(400, f"{name} was saved from a slot of n_ctx {header.get('n_ctx')}; this server's slots have "
                       f"{n_ctx}", param="filename", code="context_mismatch")
    n_tokens, n_state, seed = header.get("n_tokens"), header.get("state_bytes"), header.get("seed")
    if not all(isinstance(v, int) for v in (n_tokens, n_state, seed)) or not 0 <= n_tokens <= n_ctx \
            or not 0 <= seed < 2**32 or n_state < 0:
        raise _bad_file(name, "its token count, seed or size is out of range")
    body = start + n_header
    if len(blob) != body + 4 * n_tokens + n_state:
        raise _bad_file(name, f"it is {len(blob)} bytes, its header says {body + 4 * n_tokens + n_state}")
    tokens = np.frombuffer(blob, dtype="<i4", count=n_tokens, offset=body)
    if n_tokens and (tokens.min() < 0 or tokens.max() >= llama.n_vocab()):
        raise _bad_file(name, "it holds tokens outside the vocabulary")
    input_ids = np.zeros(n_ctx, dtype=np.intc)
    input_ids[:n_tokens] = tokens
    data = blob[body + 4 * n_tokens :]
    state = LlamaState(input_ids=input_ids, scores=np.zeros((0, llama.n_vocab()), dtype=np.single), n_tokens=n_tokens,
                       llama_state=data, llama_state_size=len(data), seed=seed)
    try:
        llama.load_state(state)
    except ValueError as exc:  # the core's checks (PowerInferError is one): another configuration, too large
        raise _bad_file(name, str(exc)) from None
    return n_tokens, len(blob)


def _erase(llama: Any) -> int:
    n = int(llama.n_tokens)
    llama.reset()
    return n


async def slot_action(request: Request, id_slot: int, action: Literal["save", "restore", "erase"] = Query(),
                      body: Optional[SlotActionRequest] = None) -> Response:
    """llama-server's POST /slots/{id_slot}?action=save|restore|erase."""
    state = _state(request)
    save_dir = state.settings.slot_save_path
    if save_dir is None:
        raise APIError(501, "This server does not support slots action: start it with --slot_save_path DIR",
                       type="not_supported_error")
    state.require_proxy()
    path: Optional[Path] = None
    if action != "erase":
        path = Path(save_dir) / check_filename(body.filename if body is not None else None)
    model_path = state.proxy_model_path()
    llama, release = await state.acquire_slot(id_slot)
    t0 = time.perf_counter()
    try:
        if action == "save":
            n, n_bytes = await state.run_on_slot(lambda: _save(llama, path, model_path))
        elif action == "restore":
            n, n_bytes = await state.run_on_slot(lambda: _restore(llama, path, model_path))
        else:
            n = await state.run_on_slot(lambda: _erase(llama))
    except (IsADirectoryError, NotADirectoryError):
        raise APIError(400, f"{path.name} in --slot_save_path is not a file", param="filename") from None
    finally:
        release()
    ms = (time.perf_counter() - t0) * 1000
    if action == "save":
        return json_response({"id_slot": id_slot, "filename": path.name, "n_saved": n, "n_written": n_bytes,
                              "timings": {"save_ms": ms}})
    if action == "restore":
        return json_response({"id_slot": id_slot, "filename": path.name, "n_restored": n, "n_read": n_bytes,
                              "timings": {"restore_ms": ms}})
    return json_response({"id_slot": id_slot, "n_erased": n})
