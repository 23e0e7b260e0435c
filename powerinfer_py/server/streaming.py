"""Streamed completions: the pump that runs a stream's generator off the event loop, and
the text/event-stream response of our own that sends what it pumps."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import sys
import threading
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple, Union

import anyio
from fastapi import Request
from fastapi.responses import Response

from .._core import CancelEvent
from .engine import ServerState
from .errors import APIError, dumps, error_from_exception, error_response
from .requests import GenerationCancelled, draft_overrides, prepare_kwargs, run_until_disconnect
from .types import CreateChatCompletionRequest, CreateCompletionRequest

__all__ = ["ChunkEvents", "sse_event", "stream_response"]

_END = object()  # sentinel of next(iterator, _END)


class StreamPump:
    """Runs a stream's generator off the event loop (on the model thread, or with slots on
    a thread of its own: ServerState.start_pump) and hands its chunks to the loop through
    a queue, so a generation never waits for the event loop to ask for its next chunk:
    with several streams batched together, a slot queues its next token as soon as it has
    sampled the last one, instead of after a round trip through the loop (a thread hop
    each way per token, behind every other stream's chunks). The loop takes every chunk
    that has arrived at once and sends them in one write.

    The generator is only ever advanced and closed by the pump's loop. cancel() (from the
    event loop: the client left) sets the pump's cancel flag, which the pump reads before
    each chunk, and wakes take(), and sets the generation's own cancel event (`cancelled`),
    which stops a generation waiting in the core at once; stop() waits for the pump to close
    the generator: a stream stops at most one token after its client left.
    """

    _QUEUE = 64  # chunks a slow reader may fall behind before the generation waits for it

    def __init__(self, iterator: Iterator[Any], start: Callable[[Callable[[], Any]], concurrent.futures.Future],
                 cancelled: Optional[threading.Event] = None):
        self._it = iterator
        self._cancelled = threading.Event()
        self._generation_cancelled = cancelled
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
        if self._generation_cancelled is not None:
            self._generation_cancelled.set()
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


def sse_event(data: Any, event: Optional[str] = None) -> bytes:
    """One server-sent event: `event: NAME` (if named) and `data: JSON`."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + dumps(data).encode() + b"\n\n"


class ChunkEvents:
    """How a stream's chunks become server-sent events. This one is OpenAI's completions and
    chat completions: each chunk a `data:` event, `data: [DONE]` at the end, an error as
    `data: {"error": ...}`. The Responses and Messages APIs translate the same chat chunks into
    events of their own (subclasses in responses.py and messages.py); one object per stream."""

    def chunk(self, chunk: Any) -> bytes:
        return sse_event(chunk)

    def end(self) -> bytes:
        """After the last chunk (or with no chunk at all)."""
        return _SSE_DONE

    def error(self, error: APIError) -> bytes:
        """A failure after the response started; the stream ends."""
        return sse_event({"error": error.body})

    def shutdown(self, error: APIError) -> bytes:
        """The server is shutting down: the last events of the stream."""
        return self.error(error) + _SSE_DONE

    def interrupted(self) -> bytes:
        """Ended early for a waiting request (--interrupt_requests)."""
        return _SSE_DONE

    def ping(self) -> bytes:
        return b": ping\n\n"


class EventStream(Response):
    """The text/event-stream response of a streamed completion, on ASGI directly.

    Per chunk this costs one JSON encoding and one ASGI send for every batch of chunks that
    arrived together; the disconnect is watched by one task reading `receive` (the body is
    read already, so the next message is the disconnect) instead of polling per chunk.
    (sse-starlette, used before, polled Request.is_disconnected and opened an anyio cancel
    scope per send: with 4 streams its event loop held the GIL more than every other
    thread together.) `close` runs when the response ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, state: ServerState, body: Any, first: Any, iterator: Iterator[Any],
                 close: Callable[[], None], on_handover: Callable[[], None], cancelled: threading.Event,
                 events: ChunkEvents, task: Optional[Dict[str, Any]] = None):
        super().__init__(status_code=200)
        self._state, self._body, self._first, self._iterator = state, body, first, iterator
        self._close, self._on_handover, self._cancelled = close, on_handover, cancelled
        self._events = events
        self._task = task if task is not None else {}  # its slot's task record (GET /slots): n_decoded

    async def __call__(self, scope: Any, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        state, events = self._state, self._events
        sent, outcome = 0, "disconnected"
        pump: Optional[StreamPump] = None
        client_left = False
        shutdown = False  # the server is shutting down: the stream ends with an error event
        ping_due = False
        tasks: List["asyncio.Task[None]"] = []

        def on_shutdown() -> None:
            nonlocal shutdown
            shutdown = True
            self._cancelled.set()
            if pump is not None:
                pump.cancel()

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

        state.stream_started(self)
        try:
            with state.stopped_at_shutdown(on_shutdown):
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                if self._first is _END:
                    outcome = "completed"
                    await send({"type": "http.response.body", "body": events.end(), "more_body": False})
                    return
                await send({"type": "http.response.body", "body": events.chunk(self._first), "more_body": True})
                sent = 1
                self._on_handover()
                pump = StreamPump(self._iterator, state.start_pump, self._cancelled)
                tasks.append(asyncio.ensure_future(watch_disconnect()))
                if not state.settings.disable_ping_events:
                    tasks.append(asyncio.ensure_future(ping()))
                while True:
                    if shutdown:
                        outcome = "shutdown"
                        await send({"type": "http.response.body", "body": events.shutdown(state.shutdown_error()),
                                    "more_body": False})
                        return
                    if client_left:
                        print(f"powerinfer_py.server: client {scope.get('client')} disconnected; stream stopped",
                              file=sys.stderr)
                        return
                    if state.should_interrupt(self):
                        outcome = "interrupted"
                        await send({"type": "http.response.body", "body": events.interrupted(), "more_body": False})
                        return
                    items = await pump.take()
                    out: List[bytes] = []
                    if ping_due:
                        ping_due = False
                        out.append(events.ping())
                    for kind, value in items:
                        if kind == "chunk":
                            out.append(events.chunk(value))
                            sent += 1
                        elif kind == "end":
                            outcome = "completed"
                            out.append(events.end())
                        else:  # headers are sent: report in the stream, as OpenAI does, and end it
                            outcome = "failed"
                            out.append(events.error(error_from_exception(value, self._body)))
                    self._task["n_decoded"] = sent
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
            self._close()  # frees the slot or the model lock first: a waiting request takes it
            state.stream_ended(self, outcome, sent)


async def stream_response(
    request: Request,
    body: Union[CreateCompletionRequest, CreateChatCompletionRequest],
    kwargs: Dict[str, Any],
    method: str,
    events: Optional[Callable[[Any], ChunkEvents]] = None,
    render_error: Callable[[APIError], Response] = error_response,
) -> Response:
    """Start a streamed completion under the model lock (or on a slot).

    The generator is created and its first chunk computed before the response starts,
    so a request the model rejects (context too long, bad grammar) still gets a 4xx; the
    rest comes through a StreamPump. The generation's cancel check is set if the client
    disconnects or the server shuts down meanwhile, which stops the prompt at its next
    slice; later the pump sets it.

    `events(llama)` makes the stream's ChunkEvents (default: OpenAI's chunks), given the Llama
    the generation runs on; `render_error` answers an error before the stream starts (another
    API's error body).
    """
    state: ServerState = request.app.state.powerinfer
    try:
        llama, release = await state.acquire_generation(body.model, draft_overrides(body), body)
    except Exception as exc:
        return render_error(error_from_exception(exc, body))
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

    cancelled = CancelEvent()
    try:
        if await request.is_disconnected():
            raise APIError(400, "Client closed request")
        # The cancel check is no logits processor (the logits are not copied for it) and a
        # slot's generation still runs ahead in the core.
        prepare_kwargs(llama, body, kwargs, cancelled)

        def start() -> Tuple[Iterator[Any], Any]:
            # The generator and its first chunk in one hop to the worker thread. A generator
            # that raises here is finished: nothing is left to close.
            result = getattr(llama, method)(**kwargs)
            if isinstance(result, dict):
                raise RuntimeError(f"Llama.{method}(stream=True) returned a complete response, not chunks")
            chunks = iter(result)
            return chunks, next(chunks, _END)

        with state.stopped_at_shutdown(cancelled.set):
            iterator, first = await run_until_disconnect(request, cancelled, state.run_generation, start)
    except BaseException as exc:
        close()
        if isinstance(exc, GenerationCancelled):
            if state.shutting_down:
                return render_error(state.shutdown_error())
            state.stats["generations_cancelled"] += 1
            print(f"powerinfer_py.server: client {request.client} disconnected; generation stopped", file=sys.stderr)
            return render_error(APIError(400, "Client closed request"))
        if isinstance(exc, Exception):
            return render_error(error_from_exception(exc, body))
        raise
    return EventStream(state, body, first, iterator, close, handover, cancelled,
                       events(llama) if events is not None else ChunkEvents(), state.task_of(llama))

