"""The routes: OpenAI's (completions, chat, embeddings, models), llama.cpp server's
(/health, /props, /metrics) and llama_cpp.server's extras (tokenize, detokenize). Each is
a thin handler over ServerState: request bodies become Llama keyword arguments
(requests.py), completions run on the engine (engine.py), streams through streaming.py."""

from __future__ import annotations

import base64
import sys
from typing import Any, Callable, Dict, Optional

import numpy as np
from fastapi import Depends, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .. import __version__
from .._core.bindings import kernel_level
from .engine import ServerState
from .errors import APIError, error_from_exception, error_response, json_response
from .metrics import metrics_text
from .._core import CancelEvent
from .requests import (GenerationCancelled, chat_kwargs, completion_kwargs, draft_overrides, prepare_kwargs,
                       run_until_disconnect)
from .streaming import stream_response
from .types import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
    CreateEmbeddingRequest,
    DetokenizeInputRequest,
    DetokenizeInputResponse,
    TokenizeInputCountResponse,
    TokenizeInputRequest,
    TokenizeInputResponse,
)

bearer_scheme = HTTPBearer(auto_error=False)


def _state(request: Request) -> ServerState:
    return request.app.state.powerinfer


async def _get_llama(state: ServerState, model: Optional[str]):
    # The proxy may load a model (seconds): do it off the event loop.
    return await state.model_thread.run(state.require_proxy(), model)


async def authenticate(
    request: Request,
    authorization: Optional[HTTPAuthorizationCredentials] = Depends(bearer_scheme),
) -> bool:
    api_key = _state(request).settings.api_key
    if api_key is None:
        return True
    if authorization is not None and authorization.credentials == api_key:
        return True
    if request.headers.get("x-api-key") == api_key:  # Anthropic's clients send the key so
        return True
    raise APIError(401, "Invalid API key", code="invalid_api_key")


async def create_completion(request: Request, body: CreateCompletionRequest) -> Response:
    kwargs = completion_kwargs(body)
    if body.stream:
        return await stream_response(request, body, kwargs, "create_completion")
    return await run_model(request, body, kwargs, "create_completion")


async def create_chat_completion(request: Request, body: CreateChatCompletionRequest) -> Response:
    kwargs = chat_kwargs(body)
    if body.stream:
        return await stream_response(request, body, kwargs, "create_chat_completion")
    return await run_model(request, body, kwargs, "create_chat_completion")


async def run_model(request: Request, body: Any, kwargs: Dict[str, Any], method: str,
                    convert: Optional[Callable[[Any, Any], Any]] = None,
                    render_error: Callable[[APIError], Response] = error_response) -> Response:
    """A whole (non-streamed) completion. If the client disconnects meanwhile (its timeout,
    say), the generation stops at its next prompt slice or token and frees the model for the
    queue, instead of running on to max_tokens or the end of the context for nobody; so does a
    server shutting down (503).

    `convert(result, llama)` turns the result into another API's answer, before the slot is
    given back; `render_error` answers errors in that API's shape."""
    state = _state(request)
    try:
        llama, release = await state.acquire_generation(body.model, draft_overrides(body), body)
    except Exception as exc:
        return render_error(error_from_exception(exc, body))
    cancelled = CancelEvent()
    try:
        with state.stopped_at_shutdown(cancelled.set):
            if await request.is_disconnected():
                raise APIError(400, "Client closed request")
            prepare_kwargs(llama, body, kwargs, cancelled)
            result = await run_until_disconnect(request, cancelled, state.run_generation,
                                                lambda: getattr(llama, method)(**kwargs))
            if convert is not None:
                result = convert(result, llama)
    except GenerationCancelled:
        if state.shutting_down:
            return render_error(state.shutdown_error())
        state.stats["generations_cancelled"] += 1
        print(f"powerinfer_py.server: client {request.client} disconnected; generation stopped", file=sys.stderr)
        return render_error(APIError(400, "Client closed request"))
    except Exception as exc:
        return render_error(error_from_exception(exc, body))
    finally:
        release()
    return json_response(result)


def _embedding_to_base64(embedding: Any) -> Any:
    if embedding and isinstance(embedding[0], (list, tuple)):  # one vector per token
        return [_embedding_to_base64(row) for row in embedding]
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(request: Request, body: CreateEmbeddingRequest) -> Response:
    state = _state(request)
    state.require_proxy()
    release = await state.acquire()
    try:
        llama = await _get_llama(state, body.model)
        if not getattr(getattr(llama, "context_params", None), "embeddings", True):
            raise APIError(
                400,
                "This server's model was loaded without embeddings: start it with --embedding true "
                "to use /v1/embeddings",
                code="embeddings_disabled",
            )
        result = await state.model_thread.run(lambda: llama.create_embedding(input=body.input, model=body.model))
    except Exception as exc:
        return error_response(error_from_exception(exc, body))
    finally:
        release()
    if body.encoding_format == "base64":
        for item in result["data"]:
            item["embedding"] = _embedding_to_base64(item["embedding"])
    return json_response(result)


async def get_models(request: Request) -> Dict[str, Any]:
    # Only the configured aliases: no need to wait for the model lock.
    return {
        "object": "list",
        "data": [
            {"id": alias, "object": "model", "owned_by": "me", "permissions": []}
            for alias in (m.model_alias or m.model for m in _state(request).model_settings)
        ],
    }


async def health(request: Request) -> Response:
    # Answers while a generation runs (it does not take the model lock); 503 while loading.
    state = _state(request)
    if state.proxy is None:
        status = "error: the model failed to load" if state.load_error is not None else "loading model"
        return json_response({"status": status, "engine": None, "requests_waiting": 0}, 503)
    llama = state.proxy.current
    return json_response({
        "status": "ok" if llama is not None else "no model loaded",
        "engine": getattr(llama, "engine", None),
        "requests_waiting": state.requests_waiting(),
    })


async def props(request: Request) -> Dict[str, Any]:
    """llama.cpp server's /props, the fields clients read (lm-eval's gguf backend: total_slots)."""
    state = _state(request)
    proxy = state.require_proxy()
    llama = proxy.current
    settings = state.model_settings[0]
    n_ctx = llama.n_ctx() if llama is not None else settings.n_ctx
    return {
        "total_slots": state.n_parallel,
        "model_path": settings.model,
        "model_alias": settings.model_alias,
        "chat_template": (getattr(llama, "metadata", None) or {}).get("tokenizer.chat_template", ""),
        "default_generation_settings": {"n_ctx": n_ctx, "model": settings.model_alias or settings.model},
        "engine": getattr(llama, "engine", None),
        "sparse_mode": llama.sparse_mode_in_use() if llama is not None else None,
        "sparse_kernels": kernel_level() if getattr(llama, "engine", None) == "powerinfer" else None,
        "build_info": f"powerinfer-py {__version__}",
    }


async def metrics(request: Request) -> Response:
    """Prometheus text: tokens and throughput, queue length, slot use, the sparse active
    share. It reads counters only, so a scrape never waits for a step of the model."""
    return Response(metrics_text(_state(request)), media_type="text/plain; version=0.0.4")


async def tokenize(request: Request, body: TokenizeInputRequest) -> TokenizeInputResponse:
    tokens = await _with_model(request, body.model, lambda llama: llama.tokenize(body.input.encode("utf-8"), special=True))
    return TokenizeInputResponse(tokens=tokens)


async def count_query_tokens(request: Request, body: TokenizeInputRequest) -> TokenizeInputCountResponse:
    tokens = await _with_model(request, body.model, lambda llama: llama.tokenize(body.input.encode("utf-8"), special=True))
    return TokenizeInputCountResponse(count=len(tokens))


async def detokenize(request: Request, body: DetokenizeInputRequest) -> DetokenizeInputResponse:
    def run(llama: Any) -> str:
        n_vocab = llama.n_vocab()
        outside = [t for t in body.tokens if t >= n_vocab]
        if outside:
            raise APIError(
                400,
                f"tokens {outside[:8]} are outside the vocabulary [0, {n_vocab})",
                param="tokens",
                code="invalid_value",
            )
        return llama.detokenize(body.tokens).decode("utf-8", errors="replace")

    return DetokenizeInputResponse(text=await _with_model(request, body.model, run))


async def _with_model(request: Request, model: Optional[str], fn: Callable[[Any], Any]) -> Any:
    state = _state(request)
    state.require_proxy()
    release = await state.acquire()
    try:
        llama = await _get_llama(state, model)
        return await state.model_thread.run(fn, llama)
    except APIError:
        raise
    except Exception as exc:
        raise error_from_exception(exc) from exc
    finally:
        release()


