"""The FastAPI app of `powerinfer_py.server`: OpenAI-compatible routes over one Llama.

Routes and request bodies follow `llama_cpp.server` 0.3.36. All model work runs in worker
threads while the request holds the app's model lock, so requests are served one at a
time, in arrival order; a streaming response holds the lock until its generator is
closed, and a client that disconnects mid-stream closes it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

try:
    import anyio
    import numpy as np
    import pydantic_settings  # noqa: F401  (settings.py)
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import Response
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from sse_starlette.sse import EventSourceResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"powerinfer_py.server needs the 'server' extra ({e.name or e} is missing):\n"
        "    pip install 'powerinfer-py[server]'   # fastapi, uvicorn, sse-starlette, pydantic-settings"
    ) from e

from .. import __version__
from .model import ModelProxy
from .settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
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

__all__ = ["create_app", "ServerState"]

_END = object()  # sentinel of next(iterator, _END)

# PowerInferError statuses that mean the request, not the server, is at fault.
_CLIENT_ERROR_STATUSES = {
    "POWERINFER_ERR_UNSUPPORTED",
    "POWERINFER_ERR_INVALID_ARG",
    "POWERINFER_ERR_CONTEXT_FULL",
}


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.body = {"message": message, "type": type, "param": param, "code": code}


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays (logprobs, embeddings) -> plain numbers and lists.
    tolist = getattr(obj, "tolist", None)
    if tolist is not None:
        return tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=_json_default)


def _json_response(content: Any, status_code: int = 200) -> Response:
    return Response(_dumps(content), status_code=status_code, media_type="application/json")


def _error_response(error: APIError) -> Response:
    return _json_response({"error": error.body}, error.status_code)


def _context_length_error(
    match_prompt: int, n_ctx: int, max_tokens: Optional[int], chat: bool
) -> APIError:
    # llama_cpp.server's wording, so clients that parse it keep working.
    if chat:
        message = (
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{(max_tokens or 0) + match_prompt} tokens ({match_prompt} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion."
        )
    else:
        message = (
            f"This model's maximum context length is {n_ctx} tokens, however you requested "
            f"{(max_tokens or 0) + match_prompt} tokens ({match_prompt} in your prompt; "
            f"{max_tokens} for the completion). Please reduce your prompt; or completion length."
        )
    return APIError(400, message, param="messages" if chat else "prompt", code="context_length_exceeded")


def _error_from_exception(exc: BaseException, body: Any = None) -> APIError:
    """Map an exception raised by the model to an API error (4xx for bad requests)."""
    if isinstance(exc, APIError):
        return exc
    text = str(exc) or type(exc).__name__
    match = re.search(r"Requested tokens \((\d+)\) exceed context window of (\d+)", text)
    if match is not None:
        return _context_length_error(
            int(match.group(1)),
            int(match.group(2)),
            getattr(body, "max_tokens", None),
            isinstance(body, CreateChatCompletionRequest),
        )
    from .. import PowerInferError

    if isinstance(exc, PowerInferError):
        if exc.status_name in _CLIENT_ERROR_STATUSES:
            return APIError(400, text)
    elif isinstance(exc, NotImplementedError):
        return APIError(400, text, code="unsupported_parameter")
    elif isinstance(exc, ValueError):
        return APIError(400, text)
    # Anything else is our fault: log it with its traceback, answer 500, keep serving.
    print(f"Exception: {text}", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return APIError(500, text, type="internal_server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"Invalid JSON body: {first.get('msg', '')}", code="invalid_json")
    param = ".".join(loc) or None
    messages = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        messages.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", "invalid"))
    return APIError(400, "; ".join(messages), param=param, code="invalid_value")


# ---------------------------------------------------------------------------- model lock


class ServerState:
    """What the routes share: settings, the model proxy, and the lock that serializes model use.

    The lock is an anyio semaphore of one, not an anyio Lock: a streaming response
    releases it from the task that runs the stream, not the one that acquired it.
    Waiters are served first come, first served.
    """

    def __init__(self, server_settings: ServerSettings, proxy: ModelProxy):
        self.settings = server_settings
        self.proxy = proxy
        self._lock = anyio.Semaphore(1, max_value=1)
        # Streams by how they ended, and chunks sent: what tests and operators can check.
        self.stats: Dict[str, int] = {
            "streams_completed": 0,
            "streams_disconnected": 0,
            "streams_interrupted": 0,
            "streams_failed": 0,
            "chunks_streamed": 0,
        }
        self.last_stream: Dict[str, Any] = {}

    def requests_waiting(self) -> int:
        return self._lock.statistics().tasks_waiting

    async def acquire(self) -> Callable[[], None]:
        """Wait for the model; returns the (idempotent) release function."""
        await self._lock.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._lock.release()

        return release

    def record_stream(self, outcome: str, chunks: int) -> None:
        self.stats[f"streams_{outcome}"] += 1
        self.stats["chunks_streamed"] += chunks
        self.last_stream = {"outcome": outcome, "chunks": chunks}


def _state(request: Request) -> ServerState:
    return request.app.state.powerinfer


async def _get_llama(state: ServerState, model: Optional[str]):
    # The proxy may load a model (seconds): do it off the event loop.
    return await run_in_threadpool(state.proxy, model)


# ---------------------------------------------------------------------------- request -> kwargs


def _prepare_kwargs(
    llama: Any, body: Union[CreateCompletionRequest, CreateChatCompletionRequest], kwargs: Dict[str, Any]
) -> None:
    """What llama_cpp.server's prepare_request_resources does: logit bias, grammar, min_tokens."""
    if body.logit_bias is not None:
        if body.logit_bias_type == "tokens":
            to_bias: Dict[str, float] = {}
            for token, score in body.logit_bias.items():
                for input_id in llama.tokenize(token.encode("utf-8"), add_bos=False, special=True):
                    to_bias[str(input_id)] = score
            kwargs["logit_bias"] = to_bias
        else:
            for key in body.logit_bias:
                if not key.lstrip("-").isdigit():
                    raise APIError(
                        400,
                        f"logit_bias keys must be token ids (got {key!r}); "
                        'use "logit_bias_type": "tokens" to bias by text',
                        param="logit_bias",
                    )
            kwargs["logit_bias"] = body.logit_bias
    if body.grammar is not None:
        from ..llama_grammar import LlamaGrammar

        kwargs["grammar"] = LlamaGrammar.from_string(body.grammar)
    if body.min_tokens > 0:
        from .. import LogitsProcessorList
        from ..llama import MinTokensLogitsProcessor

        kwargs["logits_processor"] = LogitsProcessorList(
            [MinTokensLogitsProcessor(body.min_tokens, llama.token_eos())]
        )


def _completion_kwargs(body: CreateCompletionRequest) -> Dict[str, Any]:
    kwargs = body.model_dump(exclude={"n", "best_of", "logit_bias_type", "user", "min_tokens"})
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) > 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        kwargs["prompt"] = prompt[0]
    elif isinstance(prompt, list) and not prompt:
        kwargs["prompt"] = ""
    return kwargs


def _chat_kwargs(body: CreateChatCompletionRequest) -> Dict[str, Any]:
    kwargs = body.model_dump(
        exclude={"n", "logit_bias_type", "user", "min_tokens", "max_completion_tokens", "response_format"}
    )
    if body.max_tokens is None and body.max_completion_tokens is not None:
        kwargs["max_tokens"] = body.max_completion_tokens
    kwargs["response_format"] = (
        body.response_format.model_dump(by_alias=True, exclude_none=True)
        if body.response_format is not None
        else None
    )
    return kwargs


# ---------------------------------------------------------------------------- streaming


class _ModelEventSourceResponse(EventSourceResponse):
    """An SSE response that runs `on_close` when it ends, however it ends: the stream's
    own cleanup normally has run already; this covers a stream that never started."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _stream_response(
    request: Request,
    body: Union[CreateCompletionRequest, CreateChatCompletionRequest],
    kwargs: Dict[str, Any],
    method: str,
) -> Response:
    """Start a streamed completion under the model lock.

    The generator is created and its first chunk computed before the response starts,
    so a request the model rejects (context too long, bad grammar) still gets a 4xx.
    """
    state = _state(request)
    release = await state.acquire()
    iterator: Optional[Iterator[Any]] = None
    closed = False

    def close() -> None:
        # Closing the generator runs its cleanup; it is idle here (every next() ran to
        # completion, as worker threads are not abandoned on cancellation).
        nonlocal closed
        if closed:
            return
        closed = True
        try:
            if iterator is not None and hasattr(iterator, "close"):
                iterator.close()
        except Exception as exc:  # never let cleanup keep the lock
            print(f"powerinfer_py.server: closing a stream failed: {exc!r}", file=sys.stderr)
        finally:
            release()

    try:
        if await request.is_disconnected():
            raise APIError(400, "Client closed request")
        llama = await _get_llama(state, body.model)
        _prepare_kwargs(llama, body, kwargs)
        result = await run_in_threadpool(lambda: getattr(llama, method)(**kwargs))
        if isinstance(result, dict):
            raise RuntimeError(f"Llama.{method}(stream=True) returned a complete response, not chunks")
        iterator = iter(result)
        first = await run_in_threadpool(next, iterator, _END)
    except BaseException as exc:
        close()
        if isinstance(exc, Exception):
            return _error_response(_error_from_exception(exc, body))
        raise

    async def events():
        chunk, sent, outcome = first, 0, "disconnected"
        try:
            while chunk is not _END:
                yield {"data": _dumps(chunk)}
                sent += 1
                if await request.is_disconnected():
                    print(
                        f"powerinfer_py.server: client {request.client} disconnected; stream stopped",
                        file=sys.stderr,
                    )
                    return
                if state.settings.interrupt_requests and state.requests_waiting():
                    outcome = "interrupted"
                    yield {"data": "[DONE]"}
                    return
                chunk = await run_in_threadpool(next, iterator, _END)
            outcome = "completed"
            yield {"data": "[DONE]"}
        except Exception as exc:
            # Headers are sent: report in the stream, as OpenAI does, and end it.
            outcome = "failed"
            yield {"data": _dumps({"error": _error_from_exception(exc, body).body})}
        finally:
            state.record_stream(outcome, sent)
            close()

    return _ModelEventSourceResponse(
        events(),
        sep="\n",
        # "Disabled" as a ping interval no stream outlives: ping=0 means "off" only in
        # recent sse-starlette releases.
        ping=2**31 if state.settings.disable_ping_events else None,
        on_close=close,
    )


# ---------------------------------------------------------------------------- routes


_bearer_scheme = HTTPBearer(auto_error=False)


async def authenticate(
    request: Request,
    authorization: Optional[HTTPAuthorizationCredentials] = Depends(_bearer_scheme),
) -> bool:
    api_key = _state(request).settings.api_key
    if api_key is None:
        return True
    if authorization is not None and authorization.credentials == api_key:
        return True
    raise APIError(401, "Invalid API key", code="invalid_api_key")


async def create_completion(request: Request, body: CreateCompletionRequest) -> Response:
    kwargs = _completion_kwargs(body)
    if body.stream:
        return await _stream_response(request, body, kwargs, "create_completion")
    return await _run_model(request, body, kwargs, "create_completion")


async def create_chat_completion(request: Request, body: CreateChatCompletionRequest) -> Response:
    kwargs = _chat_kwargs(body)
    if body.stream:
        return await _stream_response(request, body, kwargs, "create_chat_completion")
    return await _run_model(request, body, kwargs, "create_chat_completion")


async def _run_model(request: Request, body: Any, kwargs: Dict[str, Any], method: str) -> Response:
    state = _state(request)
    release = await state.acquire()
    try:
        if await request.is_disconnected():
            raise APIError(400, "Client closed request")
        llama = await _get_llama(state, body.model)
        _prepare_kwargs(llama, body, kwargs)
        result = await run_in_threadpool(lambda: getattr(llama, method)(**kwargs))
    except Exception as exc:
        return _error_response(_error_from_exception(exc, body))
    finally:
        release()
    return _json_response(result)


def _embedding_to_base64(embedding: Any) -> Any:
    if embedding and isinstance(embedding[0], (list, tuple)):  # one vector per token
        return [_embedding_to_base64(row) for row in embedding]
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(request: Request, body: CreateEmbeddingRequest) -> Response:
    state = _state(request)
    release = await state.acquire()
    try:
        llama = await _get_llama(state, body.model)
        result = await run_in_threadpool(lambda: llama.create_embedding(input=body.input, model=body.model))
    except Exception as exc:
        return _error_response(_error_from_exception(exc, body))
    finally:
        release()
    if body.encoding_format == "base64":
        for item in result["data"]:
            item["embedding"] = _embedding_to_base64(item["embedding"])
    return _json_response(result)


async def get_models(request: Request) -> Dict[str, Any]:
    # Only the configured aliases: no need to wait for the model lock.
    return {
        "object": "list",
        "data": [
            {"id": alias, "object": "model", "owned_by": "me", "permissions": []}
            for alias in _state(request).proxy
        ],
    }


async def health(request: Request) -> Dict[str, Any]:
    # Answers while a generation runs (it does not take the model lock).
    state = _state(request)
    llama = state.proxy.current
    return {
        "status": "ok" if llama is not None else "no model loaded",
        "engine": getattr(llama, "engine", None),
        "requests_waiting": state.requests_waiting(),
    }


async def tokenize(request: Request, body: TokenizeInputRequest) -> TokenizeInputResponse:
    tokens = await _with_model(request, body.model, lambda llama: llama.tokenize(body.input.encode("utf-8"), special=True))
    return TokenizeInputResponse(tokens=tokens)


async def count_query_tokens(request: Request, body: TokenizeInputRequest) -> TokenizeInputCountResponse:
    tokens = await _with_model(request, body.model, lambda llama: llama.tokenize(body.input.encode("utf-8"), special=True))
    return TokenizeInputCountResponse(count=len(tokens))


async def detokenize(request: Request, body: DetokenizeInputRequest) -> DetokenizeInputResponse:
    text = await _with_model(
        request, body.model, lambda llama: llama.detokenize(body.tokens).decode("utf-8", errors="replace")
    )
    return DetokenizeInputResponse(text=text)


async def _with_model(request: Request, model: Optional[str], fn: Callable[[Any], Any]) -> Any:
    state = _state(request)
    release = await state.acquire()
    try:
        llama = await _get_llama(state, model)
        return await run_in_threadpool(fn, llama)
    except APIError:
        raise
    except Exception as exc:
        raise _error_from_exception(exc) from exc
    finally:
        release()


# ---------------------------------------------------------------------------- app


def _settings_from_config_file(config_file: str) -> Tuple[ServerSettings, List[ModelSettings]]:
    if not os.path.exists(config_file):
        raise ValueError(f"Config file {config_file} not found!")
    with open(config_file, "rb") as f:
        if config_file.endswith((".yaml", ".yml")):
            import yaml

            config = ConfigFileSettings.model_validate_json(json.dumps(yaml.safe_load(f)))
        else:
            config = ConfigFileSettings.model_validate_json(f.read())
    return ServerSettings.model_validate(config.model_dump(exclude={"models"})), config.models


def create_app(
    settings: Optional[Settings] = None,
    server_settings: Optional[ServerSettings] = None,
    model_settings: Optional[List[ModelSettings]] = None,
    *,
    llama: Any = None,
) -> FastAPI:
    """The app, with its first model loaded (llama_cpp.server.app.create_app's signature).

    Args:
        settings: Server and model settings in one; default: from the environment.
        server_settings, model_settings: The same, split (a config file's shape).
        llama: An already loaded Llama to serve as the first model (embedding the server
            in a program or a test); the settings then only name it.

    The CONFIG_FILE environment variable, when set, overrides all of these.
    """
    config_file = os.environ.get("CONFIG_FILE")
    if config_file:
        server_settings, model_settings = _settings_from_config_file(config_file)
    if server_settings is None and model_settings is None:
        if settings is None:
            settings = Settings()  # type: ignore[call-arg]  # from the environment
        server_settings = ServerSettings.model_validate(settings.model_dump(include=set(ServerSettings.model_fields)))
        model_settings = [ModelSettings.model_validate(settings.model_dump(include=set(ModelSettings.model_fields)))]
    if server_settings is None or model_settings is None:
        raise ValueError("server_settings and model_settings must be provided together")

    app = FastAPI(
        title="PowerInfer-Py API (OpenAI-compatible)",
        version=__version__,
        root_path=server_settings.root_path,
    )
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_credentials=True,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.state.powerinfer = ServerState(server_settings, ModelProxy(model_settings, llama=llama))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        error_type = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return _json_response(
            {"error": {"message": message, "type": error_type, "param": None, "code": None}},
            exc.status_code,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return _error_response(_error_from_exception(exc))

    openai_v1 = ["OpenAI V1"]
    auth = [Depends(authenticate)]
    app.add_api_route("/v1/completions", create_completion, methods=["POST"], dependencies=auth, tags=openai_v1, summary="Completion")
    app.add_api_route(
        "/v1/engines/copilot-codex/completions",
        create_completion,
        methods=["POST"],
        dependencies=auth,
        include_in_schema=False,
    )
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], dependencies=auth, tags=openai_v1, summary="Chat")
    app.add_api_route("/v1/embeddings", create_embedding, methods=["POST"], dependencies=auth, tags=openai_v1, summary="Embedding")
    app.add_api_route("/v1/models", get_models, methods=["GET"], dependencies=auth, tags=openai_v1, summary="Models")
    app.add_api_route("/health", health, methods=["GET"], summary="Health")
    extras = ["Extras"]
    app.add_api_route("/extras/tokenize", tokenize, methods=["POST"], dependencies=auth, tags=extras, summary="Tokenize")
    app.add_api_route(
        "/extras/tokenize/count", count_query_tokens, methods=["POST"], dependencies=auth, tags=extras, summary="Tokenize Count"
    )
    app.add_api_route("/extras/detokenize", detokenize, methods=["POST"], dependencies=auth, tags=extras, summary="Detokenize")
    return app
