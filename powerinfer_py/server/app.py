"""The FastAPI app of `powerinfer_py.server`: OpenAI-compatible routes over one Llama.

Routes and request bodies follow `llama_cpp.server` 0.3.36. All model work runs on one
model thread (_ModelThread) while the request holds the app's model lock, so requests are
served one at a time, in arrival order; a streaming response holds the lock until its
generator is closed, and a client that disconnects mid-stream closes it. With
--n_parallel > 1 completions run on the slots of a ParallelLlama instead, whose engine
thread computes every step.

One thread, not a pool of them: libgomp keeps an OpenMP worker pool for every thread that
has run a graph, and once there are more of them than CPUs its barriers sleep instead of
spinning, which makes every graph 2-3x slower (a stream whose first token came from one
worker thread and the rest from another ran at 37 instead of 90 tokens/s).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import json
import os
import queue
import re
import sys
import threading
import time
import traceback
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple, Union

try:
    import anyio
    import numpy as np
    import pydantic_settings  # noqa: F401  (settings.py)
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import Response
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from pydantic import BaseModel
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"powerinfer_py.server needs the 'server' extra ({e.name or e} is missing):\n"
        "    pip install 'powerinfer-py[server]'   # fastapi, uvicorn, pydantic-settings"
    ) from e

from .. import __version__
from .._core import CancelCheck, release_threads
from .model import ModelProxy
from .settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
from .types import (
    CreateChatCompletionChunk,
    CreateChatCompletionRequest,
    CreateChatCompletionResponse,
    CreateCompletionRequest,
    CreateCompletionResponse,
    CreateEmbeddingRequest,
    CreateEmbeddingResponse,
    DetokenizeInputRequest,
    DetokenizeInputResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    PropsResponse,
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


# One encoder for every response: json.dumps(obj, default=...) builds a new JSONEncoder per
# call (per streamed chunk). Same output as json.dumps.
_ENCODER = json.JSONEncoder(default=_json_default)


def _dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


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


def _raised_by_chat_template(exc: BaseException) -> bool:
    """Whether `exc` comes from rendering a Jinja2 chat template: the template could not
    format the request's messages or tools (content null or a list where it concatenates
    strings, a role order it rejects with raise_exception, ...)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - jinja2 comes with llama-cpp-python
        return False
    if isinstance(exc, TemplateError):
        return True
    tb = exc.__traceback__
    innermost = None
    while tb is not None:
        innermost, tb = tb, tb.tb_next
    # Jinja2 compiles templates made from strings (the GGUF's) to code named "<template>".
    return innermost is not None and innermost.tb_frame.f_code.co_filename == "<template>"


def _error_from_exception(exc: BaseException, body: Any = None) -> APIError:
    """Map an exception raised by the model to an API error (4xx for bad requests)."""
    if isinstance(exc, APIError):
        return exc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OverflowError):
        # A number of the request that does not fit the C type it is passed as.
        return APIError(400, f"A number in the request is out of range: {text}", code="invalid_value")
    if isinstance(body, CreateChatCompletionRequest) and _raised_by_chat_template(exc):
        return APIError(
            400,
            f"The model's chat template cannot format these messages: {text}",
            param="messages",
            code="chat_template_error",
        )
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
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return APIError(400, "The request needs a JSON object body", code="invalid_value")
    param = ".".join(loc) or None
    messages = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        messages.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", "invalid"))
    return APIError(400, "; ".join(messages), param=param, code="invalid_value")


# ---------------------------------------------------------------------------- model lock


class _ModelThread:
    """The thread that runs model work, one job at a time (see the module docstring).

    A daemon thread, as the stream threads were: a job stuck on a gone client never
    holds the process up at exit. With release_after (a server whose steps run on a
    ParallelLlama's engine) each job hands back the OpenMP pool it made, if it computed
    (embeddings on the base Llama), so that the engine's stays the only one."""

    def __init__(self, release_after: bool = False):
        self._jobs: "queue.SimpleQueue[Tuple[concurrent.futures.Future, Callable[..., Any], tuple]]" = queue.SimpleQueue()
        self._release_after = release_after
        self._thread = threading.Thread(target=self._work, name="powerinfer-model", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                _complete(future, fn, *args)
            finally:
                if self._release_after:
                    release_threads()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the thread; like run_in_threadpool, a cancelled request still
        waits for it (the model lock must not be released while the model works)."""
        future = self.submit(fn, *args)
        with anyio.CancelScope(shield=True):
            return await asyncio.wrap_future(future)


def _complete(future: concurrent.futures.Future, fn: Callable[..., Any], *args: Any) -> None:
    """Run fn(*args) for a running future: its result, or its exception for the awaiter."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


def _start_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """fn() on a new daemon thread; the future completes when it returns."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    threading.Thread(target=_complete, args=(future, fn), name=name, daemon=True).start()
    return future


class ServerState:
    """What the routes share: settings, the model proxy, the slots and the lock.

    With n_parallel = 1 every model use holds the model lock, an anyio semaphore of one
    (not an anyio Lock: a streaming response releases it from the task that runs the
    stream, not the one that acquired it); waiters are served first come, first served.
    With n_parallel > 1 completions run on the slots of a ParallelLlama (continuous
    batching, docs/parallel.md), admitted by a semaphore of n_parallel; the other model
    uses (embeddings, tokenizer) still take the lock, on the loaded Llama.

    The model loads in the constructor, or with `background` in a thread: until it is
    loaded the model routes and /health answer 503.
    """

    def __init__(
        self,
        server_settings: ServerSettings,
        model_settings: List[ModelSettings],
        llama: Any = None,
        background: bool = False,
        on_load_error: Optional[Callable[[BaseException], None]] = None,
    ):
        self.settings = server_settings
        self.model_settings = model_settings
        self.n_parallel = server_settings.n_parallel
        if self.n_parallel > 1 and len(model_settings) > 1:
            raise ValueError("--n_parallel > 1 serves one model; the config names several")
        self.proxy: Optional[ModelProxy] = None
        self.pool: Any = None
        self.model_thread = _ModelThread(release_after=self.n_parallel > 1)
        self.load_error: Optional[BaseException] = None
        self.started = time.time()
        self._lock = anyio.Semaphore(1, max_value=1)
        self._slots = anyio.Semaphore(self.n_parallel, max_value=self.n_parallel) if self.n_parallel > 1 else None
        # Streams by how they ended, and chunks sent: what tests and operators can check.
        self.stats: Dict[str, int] = {
            "streams_completed": 0,
            "streams_disconnected": 0,
            "streams_interrupted": 0,
            "streams_failed": 0,
            "chunks_streamed": 0,
            # Non-streamed generations stopped because their client went away.
            "generations_cancelled": 0,
        }
        self.last_stream: Dict[str, Any] = {}
        if background:
            def load() -> None:
                try:
                    self._load(llama)
                except BaseException as exc:  # reported by on_load_error / 503s
                    self.load_error = exc
                    if on_load_error is not None:
                        on_load_error(exc)

            threading.Thread(target=load, name="powerinfer-load", daemon=True).start()
        else:
            self._load(llama)

    def _load(self, llama: Any) -> None:
        # Slots batch their steps: the packed kernels (Q4_0/Q4_1/Q8_0 weights) compute each
        # batch column alone and a 4-token step for little more than one token; other types
        # stay unrepacked, whose kernels also keep each column's rounding that of a lone one
        # (docs/parallel.md). Either way each stream equals its solo run.
        overrides = {"repack": False, "pack_dense": True} if self.n_parallel > 1 else {}
        proxy = ModelProxy(self.model_settings, llama=llama, overrides=overrides)
        if self.n_parallel > 1:
            from ..parallel import ParallelLlama

            self.pool = ParallelLlama(proxy.current, n_parallel=self.n_parallel)
        self.proxy = proxy

    def require_proxy(self) -> ModelProxy:
        if self.proxy is None:
            if self.load_error is not None:
                raise APIError(500, f"the model failed to load: {self.load_error}", type="internal_server_error")
            raise APIError(503, "Loading model", type="unavailable_error", code="loading")
        return self.proxy

    def requests_waiting(self) -> int:
        sem = self._slots if self._slots is not None else self._lock
        return sem.statistics().tasks_waiting

    async def acquire(self) -> Callable[[], None]:
        """Wait for the model lock; returns the (idempotent) release function."""
        return await self._acquire(self._lock, None)

    async def acquire_generation(self, model: Optional[str]) -> Tuple[Any, Callable[[], None]]:
        """The Llama a completion runs on (a free slot with n_parallel > 1) and its release."""
        proxy = self.require_proxy()
        if self.pool is None:
            release = await self.acquire()
            try:
                return await self.model_thread.run(proxy, model), release
            except BaseException:
                release()
                raise
        assert self._slots is not None
        slot = None

        def give_back() -> None:
            if slot is not None:
                self.pool.release(slot)

        release = await self._acquire(self._slots, give_back)
        slot = self.pool.acquire(timeout=0)  # the semaphore admitted us: a slot is free
        return slot, release

    async def _acquire(self, sem: Any, before_release: Optional[Callable[[], None]]) -> Callable[[], None]:
        await sem.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                try:
                    if before_release is not None:
                        before_release()
                finally:
                    sem.release()

        return release

    async def run_generation(self, fn: Callable[[], Any]) -> Any:
        """A completion's work: on the model thread, or with slots on a worker thread of
        its own (slots step together; their decodes run on the pool's engine)."""
        if self.pool is None:
            return await self.model_thread.run(fn)
        return await run_in_threadpool(fn)

    def start_pump(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """A stream's pump loop: on the model thread, or with slots on a thread of its own."""
        if self.pool is None:
            return self.model_thread.submit(fn)
        return _start_thread(fn, "powerinfer-stream")

    def record_stream(self, outcome: str, chunks: int) -> None:
        self.stats[f"streams_{outcome}"] += 1
        self.stats["chunks_streamed"] += chunks
        self.last_stream = {"outcome": outcome, "chunks": chunks}


def _state(request: Request) -> ServerState:
    return request.app.state.powerinfer


async def _get_llama(state: ServerState, model: Optional[str]):
    # The proxy may load a model (seconds): do it off the event loop.
    return await state.model_thread.run(state.require_proxy(), model)


# ---------------------------------------------------------------------------- request -> kwargs


def _prepare_kwargs(
    llama: Any,
    body: Union[CreateCompletionRequest, CreateChatCompletionRequest],
    kwargs: Dict[str, Any],
    cancelled: Optional[threading.Event] = None,
) -> None:
    """What llama_cpp.server's prepare_request_resources does: logit bias, grammar, min_tokens;
    and, given `cancelled`, a logits processor that stops the generation once it is set."""
    if isinstance(body, CreateCompletionRequest):
        _empty_prompt_as_bos(llama, kwargs)
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
    elif isinstance(body, CreateChatCompletionRequest):
        grammar = _json_schema_grammar(body)
        if grammar is not None:
            kwargs["grammar"] = grammar
    processors: List[Callable[..., Any]] = []
    if body.min_tokens > 0:
        from ..llama import MinTokensLogitsProcessor

        processors.append(MinTokensLogitsProcessor(body.min_tokens, llama.token_eos()))
    if cancelled is not None:
        # Ends the generation at its next token once set: the one hook into the token loop
        # that create_completion and create_chat_completion both take (a slot's generation
        # sampled in the core runs it before handing over each token).
        processors.append(CancelCheck(cancelled, _GenerationCancelled))
    if processors:
        from .. import LogitsProcessorList

        kwargs["logits_processor"] = LogitsProcessorList(processors)


def _empty_prompt_as_bos(llama: Any, kwargs: Dict[str, Any]) -> None:
    """An empty text prompt with logprobs becomes the prompt [BOS], which is what the model
    reads for "" anyway: Llama's own empty-prompt path puts that BOS among the completion's
    tokens, which misaligns the logprobs (and fails in a stream past its first token)."""
    if kwargs.get("prompt") != "" or kwargs.get("logprobs") is None or kwargs.get("suffix") is not None:
        return
    bos = llama.token_bos()
    if bos >= 0:
        kwargs["prompt"] = [bos]


def _json_schema_grammar(body: CreateChatCompletionRequest) -> Any:
    """The grammar of response_format {"type": "json_schema", ...}, made here so that a
    schema the converter cannot handle is the client's 400 (the converter fails on many
    shapes with TypeError, AttributeError, KeyError, ...); None for other formats."""
    response_format = body.response_format
    if response_format is None or response_format.type != "json_schema":
        return None
    from ..llama_grammar import JSON_GBNF, LlamaGrammar

    spec = response_format.json_schema
    schema = spec.schema_ if spec is not None else None
    if schema is None:
        return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
    try:
        return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    except Exception as exc:
        raise APIError(
            400,
            f"response_format.json_schema.schema is not a JSON schema this server can follow: "
            f"{type(exc).__name__}: {exc}",
            param="response_format",
            code="invalid_value",
        ) from None


class _GenerationCancelled(Exception):
    """Raised inside the model's sampling loop to stop a generation nobody waits for."""


def _null_penalties_as_default(kwargs: Dict[str, Any]) -> None:
    # The schema allows null (OpenAI's "use the default"); Llama wants a number.
    for name in ("presence_penalty", "frequency_penalty"):
        if kwargs.get(name) is None:
            kwargs[name] = 0.0


def _completion_kwargs(body: CreateCompletionRequest) -> Dict[str, Any]:
    kwargs = body.model_dump(exclude={"n", "best_of", "logit_bias_type", "user", "min_tokens"})
    _null_penalties_as_default(kwargs)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) > 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        kwargs["prompt"] = prompt[0]
    elif isinstance(prompt, list) and not prompt:
        kwargs["prompt"] = ""
    if body.echo:
        if isinstance(kwargs["prompt"], list):
            # Token-id prompts are this server's addition; Llama echoes only text.
            raise APIError(400, "echo needs a text prompt, not token ids", param="echo")
        if kwargs["prompt"] == "":
            # Nothing to echo; Llama's echo path fails on an empty prompt with logprobs.
            kwargs["echo"] = False
    return kwargs


_TOOL_FIELDS = ("functions", "function_call", "tools", "tool_choice")


def _chat_kwargs(body: CreateChatCompletionRequest) -> Dict[str, Any]:
    kwargs = body.model_dump(
        exclude={"n", "logit_bias_type", "user", "min_tokens", "max_completion_tokens", "response_format", *_TOOL_FIELDS}
    )
    for name in _TOOL_FIELDS:  # as sent, without the nulls of optional keys left out
        value = getattr(body, name)
        if isinstance(value, list):
            kwargs[name] = [item.model_dump(exclude_none=True) for item in value]
        elif isinstance(value, BaseModel):
            kwargs[name] = value.model_dump(exclude_none=True)
        else:
            kwargs[name] = value
    _null_penalties_as_default(kwargs)
    if body.max_tokens is None and body.max_completion_tokens is not None:
        kwargs["max_tokens"] = body.max_completion_tokens
    kwargs["response_format"] = (
        body.response_format.model_dump(by_alias=True, exclude_none=True)
        if body.response_format is not None
        else None
    )
    return kwargs


# ---------------------------------------------------------------------------- streaming


class _StreamPump:
    """Runs a stream's generator off the event loop (on the model thread, or with slots on
    a thread of its own: ServerState.start_pump) and hands its chunks to the loop through
    a queue, so a generation never waits for the event loop to ask for its next chunk:
    with several streams batched together, a slot queues its next token as soon as it has
    sampled the last one, instead of after a round trip through the loop (a thread hop
    each way per token, behind every other stream's chunks). The loop takes every chunk
    that has arrived at once and sends them in one write.

    The generator is only ever advanced and closed by the pump's loop. cancel() (from the
    event loop: the client left) sets the pump's cancel flag, which the pump reads before
    each chunk, and wakes take(); stop() waits for the pump to close the generator: a
    stream stops at most one token after its client left.
    """

    _QUEUE = 64  # chunks a slow reader may fall behind before the generation waits for it

    def __init__(self, iterator: Iterator[Any], start: Callable[[Callable[[], Any]], concurrent.futures.Future]):
        self._it = iterator
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._cond = threading.Condition()
        self._items: Deque[Tuple[str, Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._waiting = False  # the loop waits for items (under _cond)
        self._done = False
        self._finished = start(self._run)  # ServerState.start_pump

    def _put(self, kind: str, value: Any) -> None:
        with self._cond:
            while len(self._items) >= self._QUEUE and not self._cancelled.is_set():
                self._cond.wait()
            self._items.append((kind, value))
            wake, self._waiting = self._waiting, False
        if wake:
            self._notify()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _run(self) -> None:
        try:
            while not self._cancelled.is_set():
                chunk = next(self._it, _END)
                if chunk is _END:
                    self._put("end", None)
                    break
                self._put("chunk", chunk)
        except BaseException as exc:  # reported in the stream
            self._put("error", exc)
        finally:
            try:
                close = getattr(self._it, "close", None)
                if close is not None:
                    close()
            except Exception as exc:  # never let cleanup keep the slot
                print(f"powerinfer_py.server: closing a stream failed: {exc!r}", file=sys.stderr)
            with self._cond:
                self._done = True
                wake, self._waiting = self._waiting, False
            if wake:
                self._notify()

    async def take(self) -> List[Tuple[str, Any]]:
        """Every item that has arrived, waiting for one; [] once the pump has ended, was
        cancelled, or poke() woke it."""
        with self._cond:
            wait = not self._items and not self._done and not self._cancelled.is_set()
            if wait:
                self._waiting = True
                self._wake.clear()
        if wait:
            await self._wake.wait()
        with self._cond:
            self._waiting = False
            if self._cancelled.is_set() or not self._items:
                return []
            items = list(self._items)
            self._items.clear()
            if len(items) >= self._QUEUE:
                self._cond.notify_all()  # the pump may wait for room
            return items

    def poke(self) -> None:
        """From the event loop: make a waiting take() return (with what has arrived, if anything)."""
        self._wake.set()

    @property
    def ended(self) -> bool:
        """The generator is closed and every item taken."""
        with self._cond:
            return self._done and not self._items

    def cancel(self) -> None:
        """From the event loop: stop the generation at its next chunk and wake take()."""
        self._cancelled.set()
        with self._cond:
            self._cond.notify_all()
        self._wake.set()

    async def stop(self) -> None:
        """Cancel and wait until the pump has closed the generator."""
        self.cancel()
        if not self._finished.done():
            with anyio.CancelScope(shield=True):
                await asyncio.wrap_future(self._finished)


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
_SSE_DONE = b"data: [DONE]\n\n"
_PING_INTERVAL_S = 15.0  # a comment line when nothing else was sent for this long


class _EventStream(Response):
    """The text/event-stream response of a streamed completion, on ASGI directly.

    Per chunk this costs one JSON encoding and one ASGI send for every batch of chunks that
    arrived together; the disconnect is watched by one task reading `receive` (the body is
    read already, so the next message is the disconnect) instead of polling per chunk.
    (sse-starlette, used before, polled Request.is_disconnected and opened an anyio cancel
    scope per send: with 4 streams its event loop held the GIL more than every other
    thread together.) `close` runs when the response ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, state: "ServerState", body: Any, first: Any, iterator: Iterator[Any],
                 close: Callable[[], None], on_handover: Callable[[], None]):
        super().__init__(status_code=200)
        self._state, self._body, self._first, self._iterator = state, body, first, iterator
        self._close, self._on_handover = close, on_handover

    def _event(self, chunk: Any) -> bytes:
        return b"data: " + _dumps(chunk).encode() + b"\n\n"

    async def __call__(self, scope: Any, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        state = self._state
        sent, outcome = 0, "disconnected"
        pump: Optional[_StreamPump] = None
        client_left = False
        ping_due = False
        tasks: List["asyncio.Task[None]"] = []

        async def watch_disconnect() -> None:
            nonlocal client_left
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    client_left = True
                    if pump is not None:
                        pump.cancel()
                    return

        async def ping() -> None:
            nonlocal ping_due
            while True:
                await asyncio.sleep(_PING_INTERVAL_S)
                ping_due = True
                if pump is not None:
                    pump.poke()

        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            if self._first is _END:
                outcome = "completed"
                await send({"type": "http.response.body", "body": _SSE_DONE, "more_body": False})
                return
            await send({"type": "http.response.body", "body": self._event(self._first), "more_body": True})
            sent = 1
            self._on_handover()
            pump = _StreamPump(self._iterator, state.start_pump)
            tasks.append(asyncio.ensure_future(watch_disconnect()))
            if not state.settings.disable_ping_events:
                tasks.append(asyncio.ensure_future(ping()))
            while True:
                if client_left:
                    print(f"powerinfer_py.server: client {scope.get('client')} disconnected; stream stopped",
                          file=sys.stderr)
                    return
                if state.settings.interrupt_requests and state.requests_waiting():
                    outcome = "interrupted"
                    await send({"type": "http.response.body", "body": _SSE_DONE, "more_body": False})
                    return
                items = await pump.take()
                out: List[bytes] = []
                if ping_due:
                    ping_due = False
                    out.append(b": ping\n\n")
                for kind, value in items:
                    if kind == "chunk":
                        out.append(self._event(value))
                        sent += 1
                    elif kind == "end":
                        outcome = "completed"
                        out.append(_SSE_DONE)
                    else:  # headers are sent: report in the stream, as OpenAI does, and end it
                        outcome = "failed"
                        out.append(self._event({"error": _error_from_exception(value, self._body).body}))
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": outcome == "disconnected"})
                if outcome != "disconnected":
                    return
                if not items and pump.ended:
                    return  # ended without an end item (cancelled): nothing more will come
        finally:
            for task in tasks:
                task.cancel()
            if pump is not None:
                await pump.stop()
            state.record_stream(outcome, sent)
            self._close()


async def _stream_response(
    request: Request,
    body: Union[CreateCompletionRequest, CreateChatCompletionRequest],
    kwargs: Dict[str, Any],
    method: str,
) -> Response:
    """Start a streamed completion under the model lock (or on a slot).

    The generator is created and its first chunk computed before the response starts,
    so a request the model rejects (context too long, bad grammar) still gets a 4xx; the
    rest comes through a _StreamPump.
    """
    state = _state(request)
    try:
        llama, release = await state.acquire_generation(body.model)
    except Exception as exc:
        return _error_response(_error_from_exception(exc, body))
    iterator: Optional[Iterator[Any]] = None
    handed_over = False  # the pump owns the iterator from then on

    def handover() -> None:
        nonlocal handed_over
        handed_over = True

    def close() -> None:
        # Before the pump starts: close the (idle) generator here and free the model.
        try:
            if not handed_over and iterator is not None and hasattr(iterator, "close"):
                iterator.close()
        except Exception as exc:  # never let cleanup keep the lock
            print(f"powerinfer_py.server: closing a stream failed: {exc!r}", file=sys.stderr)
        finally:
            release()

    try:
        if await request.is_disconnected():
            raise APIError(400, "Client closed request")
        # No cancel check: the pump checks its cancel flag between chunks, one
        # token apart (a Python processor would also copy every logits row).
        _prepare_kwargs(llama, body, kwargs)

        def start() -> Tuple[Iterator[Any], Any]:
            # The generator and its first chunk in one hop to the worker thread. A generator
            # that raises here is finished: nothing is left to close.
            result = getattr(llama, method)(**kwargs)
            if isinstance(result, dict):
                raise RuntimeError(f"Llama.{method}(stream=True) returned a complete response, not chunks")
            chunks = iter(result)
            return chunks, next(chunks, _END)

        iterator, first = await state.run_generation(start)
    except BaseException as exc:
        close()
        if isinstance(exc, Exception):
            return _error_response(_error_from_exception(exc, body))
        raise
    return _EventStream(state, body, first, iterator, close, handover)


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
    """A whole (non-streamed) completion. If the client disconnects meanwhile (its timeout,
    say), the generation stops at its next token and frees the model for the queue,
    instead of running on to max_tokens or the end of the context for nobody."""
    state = _state(request)
    try:
        llama, release = await state.acquire_generation(body.model)
    except Exception as exc:
        return _error_response(_error_from_exception(exc, body))
    cancelled = threading.Event()
    try:
        if await request.is_disconnected():
            raise APIError(400, "Client closed request")
        _prepare_kwargs(llama, body, kwargs, cancelled)
        result = await _run_until_disconnect(request, cancelled, lambda: getattr(llama, method)(**kwargs))
    except _GenerationCancelled:
        state.stats["generations_cancelled"] += 1
        print(f"powerinfer_py.server: client {request.client} disconnected; generation stopped", file=sys.stderr)
        return _error_response(APIError(400, "Client closed request"))
    except Exception as exc:
        return _error_response(_error_from_exception(exc, body))
    finally:
        release()
    return _json_response(result)


async def _run_until_disconnect(request: Request, cancelled: threading.Event, fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread, with `cancelled` set if the client disconnects meanwhile."""
    error: Optional[Exception] = None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_set_on_disconnect, request, cancelled)
        try:
            result = await _state(request).run_generation(fn)
        except Exception as exc:  # raised below, not as an ExceptionGroup of the task group
            error = exc
        tasks.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def _set_on_disconnect(request: Request, event: threading.Event) -> None:
    """Set `event` when the client disconnects (the body is read: what the server
    receives next is the disconnect); cancelled when the response is ready first."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            event.set()
            return


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
            for alias in (m.model_alias or m.model for m in _state(request).model_settings)
        ],
    }


async def health(request: Request) -> Response:
    # Answers while a generation runs (it does not take the model lock); 503 while loading.
    state = _state(request)
    if state.proxy is None:
        status = "error: the model failed to load" if state.load_error is not None else "loading model"
        return _json_response({"status": status, "engine": None, "requests_waiting": 0}, 503)
    llama = state.proxy.current
    return _json_response({
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
        "build_info": f"powerinfer-py {__version__}",
    }


async def metrics(request: Request) -> Response:
    """Prometheus text: tokens and throughput, queue length, slot use, the sparse active share."""
    return Response(_metrics_text(_state(request)), media_type="text/plain; version=0.0.4")


def _metrics_text(state: ServerState) -> str:
    rows: List[Tuple[str, str, str, float]] = []

    def add(name: str, kind: str, help_text: str, value: Optional[float]) -> None:
        if value is not None:
            rows.append((f"powerinfer_{name}", kind, help_text, float(value)))

    add("model_loaded", "gauge", "1 once the model is loaded", 0 if state.proxy is None else 1)
    add("requests_waiting", "gauge", "Requests queued for a slot (or the model lock)", state.requests_waiting())
    add("slots_total", "gauge", "Parallel slots (--n_parallel)", state.n_parallel)
    for name, value in state.stats.items():
        add(f"{name}_total", "counter", f"Server count: {name.replace('_', ' ')}", value)
    llama = state.proxy.current if state.proxy is not None else None
    if state.pool is not None:
        pool = state.pool
        st = pool.stats
        add("slots_busy", "gauge", "Slots serving a request", pool.slots_busy)
        add("tokens_generated_total", "counter", "Tokens generated (one-token decode steps)", st["tokens_generated"])
        add("prompt_tokens_total", "counter", "Prompt tokens computed", st["tokens_prompt"])
        add("prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prompt cache", st["prompt_tokens_reused"])
        add("decode_steps_total", "counter", "Batches computed", st["steps"])
        add("busy_seconds_total", "counter", "Seconds spent computing batches", st["busy_seconds"])
        add("decode_steps_restarted_total", "counter", "Batches interrupted to take in a new request, then computed again",
            st["steps_restarted"])
        add("restart_seconds_total", "counter", "Seconds of interrupted batches, thrown away", st["restart_seconds"])
        add("tokens_per_second", "gauge", "Tokens computed per busy second, all slots together",
            (st["tokens_generated"] + st["tokens_prompt"]) / st["busy_seconds"] if st["busy_seconds"] else 0.0)
        add("kv_cells_used", "gauge", "KV cache cells in use", pool.kv_cells_used())
        add("sparse_active_fraction", "gauge", "Share of FFN neurons the sparse steps computed", pool.sparse_active_fraction())
    elif llama is not None and getattr(llama, "_fallback", None) is None:
        t = llama.timings()
        add("slots_busy", "gauge", "Slots serving a request", 1 - state._lock.value)
        add("tokens_generated_total", "counter", "Tokens generated (one-token decode steps)", t["n_eval"])
        add("prompt_tokens_total", "counter", "Prompt tokens computed", t["n_prompt"])
        add("busy_seconds_total", "counter", "Seconds spent computing", (t["t_eval_ms"] + t["t_prompt_ms"]) / 1000)
        add("tokens_per_second", "gauge", "Generated tokens per second of generation",
            t["n_eval"] / t["t_eval_ms"] * 1000 if t["t_eval_ms"] else 0.0)
        add("sparse_active_fraction", "gauge", "Share of FFN neurons the sparse steps computed", llama.sparse_stats()["active"])
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
    return "\n".join(out) + "\n"


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
    load_in_background: bool = False,
    on_load_error: Optional[Callable[[BaseException], None]] = None,
) -> FastAPI:
    """The app, with its first model loaded (llama_cpp.server.app.create_app's signature).

    Args:
        settings: Server and model settings in one; default: from the environment.
        server_settings, model_settings: The same, split (a config file's shape).
        llama: An already loaded Llama to serve as the first model (embedding the server
            in a program or a test); the settings then only name it.
        load_in_background: Load the model in a thread and answer 503 (/health included)
            until it is loaded, as llama.cpp's server does; `on_load_error` is called if
            loading fails. Otherwise the model is loaded here and errors raise.

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
    app.state.powerinfer = ServerState(
        server_settings, model_settings, llama=llama, background=load_in_background, on_load_error=on_load_error
    )

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
        response = _json_response(
            {"error": {"message": message, "type": error_type, "param": None, "code": None}},
            exc.status_code,
        )
        # E.g. the Allow header of a 405, which RFC 9110 requires.
        response.headers.update(exc.headers or {})
        return response

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
    app.add_api_route("/health", health, methods=["GET"], summary="Health", response_model=HealthResponse)
    app.add_api_route("/props", props, methods=["GET"], dependencies=auth, summary="Server properties")
    # Prometheus text, not JSON: outside the OpenAPI document.
    app.add_api_route("/metrics", metrics, methods=["GET"], dependencies=auth, include_in_schema=False)
    extras = ["Extras"]
    app.add_api_route("/extras/tokenize", tokenize, methods=["POST"], dependencies=auth, tags=extras, summary="Tokenize")
    app.add_api_route(
        "/extras/tokenize/count", count_query_tokens, methods=["POST"], dependencies=auth, tags=extras, summary="Tokenize Count"
    )
    app.add_api_route("/extras/detokenize", detokenize, methods=["POST"], dependencies=auth, tags=extras, summary="Detokenize")
    _document_responses(app, server_settings.api_key is not None)
    return app


# ---------------------------------------------------------------------------- OpenAPI schema


# The 200 answer of each route (FastAPI infers only the annotated return types), and the
# event of the routes that stream with stream=true.
_OK_MODELS: Dict[str, type] = {
    "/v1/completions": CreateCompletionResponse,
    "/v1/chat/completions": CreateChatCompletionResponse,
    "/v1/embeddings": CreateEmbeddingResponse,
    "/v1/models": ModelList,
    "/health": HealthResponse,
    "/props": PropsResponse,
}
_STREAM_EVENT_MODELS: Dict[str, type] = {
    "/v1/completions": CreateCompletionResponse,
    "/v1/chat/completions": CreateChatCompletionChunk,
}


def _ref(model: type) -> Dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _stream_event_schema(chunk: type) -> Dict[str, Any]:
    """One server-sent event of a streamed completion: a chunk, an error after the stream
    started (the status is already 200), or the final "[DONE]"."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
                    },
                ]
            }
        },
    }


def _document_responses(app: FastAPI, api_key_required: bool) -> None:
    """Make /openapi.json say what the routes answer, which FastAPI's defaults do not:
    errors are 400 (and 401 for a wrong API key) with OpenAI's error body, never 422; the
    bearer key is required only when the server has one; completions are JSON, or with
    stream=true server-sent events, each described."""
    generate = app.openapi
    models = [ErrorResponse, *_OK_MODELS.values(), *_STREAM_EVENT_MODELS.values()]

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from pydantic.json_schema import models_json_schema

        schema = generate()  # FastAPI's (cached on app.openapi_schema, edited in place)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        _, definitions = models_json_schema(
            [(model, "serialization") for model in dict.fromkeys(models)],
            ref_template="#/components/schemas/{model}",
        )
        for name, definition in definitions.get("$defs", {}).items():
            schemas.setdefault(name, definition)
        error = {"content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if "requestBody" in operation:
                    responses["400"] = {"description": "Invalid request", **error}
                if api_key_required and operation.get("security"):
                    responses["401"] = {"description": "Missing or wrong API key", **error}
                else:
                    operation.pop("security", None)
                ok = responses.setdefault("200", {"description": "Successful Response"})
                if path in _OK_MODELS:
                    ok["content"] = {"application/json": {"schema": _ref(_OK_MODELS[path])}}
                if path in _STREAM_EVENT_MODELS:
                    ok["description"] = "The completion; with stream=true, server-sent events"
                    ok["content"]["text/event-stream"] = {"schema": _stream_event_schema(_STREAM_EVENT_MODELS[path])}
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        if not api_key_required:
            components.pop("securitySchemes", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
