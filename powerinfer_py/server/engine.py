"""Where the server's model work runs: the model thread, the two engines (one request at a
time, or slots), and `ServerState`, what the routes share.

One thread, not a pool of them: libgomp keeps an OpenMP worker pool for every thread that
has run a graph, and once there are more of them than CPUs its barriers sleep instead of
spinning, which makes every graph 2-3x slower (a stream whose first token came from one
worker thread and the rest from another ran at 37 instead of 90 tokens/s).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import anyio
from starlette.concurrency import run_in_threadpool

from .._core import release_threads
from .errors import APIError
from .model import ModelProxy
from .settings import ModelSettings, ServerSettings

__all__ = ["ServerState"]


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


def _speculative_counters(st: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """Llama.speculative_stats as metrics (none before the first verify step)."""
    if not st["verify_steps"]:
        return {}
    return {
        "draft_verify_steps_total": st["verify_steps"],
        "draft_tokens_total": st["drafted"],
        "draft_tokens_accepted_total": st["accepted"],
        "draft_acceptance_rate": st["acceptance_rate"],
        "draft_tokens_per_step": st["tokens_per_step"],
    }


# A request's fields that GET /slots shows as its task's "params", under llama-server's names.
_TASK_PARAMS = (("max_tokens", "n_predict"), ("seed", "seed"), ("temperature", "temperature"), ("top_k", "top_k"),
                ("top_p", "top_p"), ("min_p", "min_p"), ("repeat_penalty", "repeat_penalty"),
                ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                ("mirostat_mode", "mirostat"), ("mirostat_tau", "mirostat_tau"), ("mirostat_eta", "mirostat_eta"),
                ("stop", "stop"), ("stream", "stream"), ("grammar", "grammar"))


def _task_params(body: Any) -> Dict[str, Any]:
    params = {name: getattr(body, field) for field, name in _TASK_PARAMS if hasattr(body, field)}
    if "n_predict" in params:
        params["n_predict"] = params["n_predict"] or -1  # 0 or null: until the context is full
        params["max_tokens"] = params["n_predict"]
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return params


def _start_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """fn() on a new daemon thread; the future completes when it returns."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    threading.Thread(target=_complete, args=(future, fn), name=name, daemon=True).start()
    return future


async def _acquire(sem: Any, before_release: Optional[Callable[[], None]] = None) -> Callable[[], None]:
    """Wait for `sem`; returns the (idempotent) release function."""
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


class _SerialEngine:
    """One request at a time (llama_cpp.server's way): a completion holds the model lock
    and runs on the model thread, a stream until it ends."""

    def __init__(self, state: "ServerState"):
        self._state = state

    def load(self, proxy: ModelProxy) -> None:
        pass

    async def acquire_generation(self, model: Optional[str]) -> Tuple[Any, Callable[[], None]]:
        state = self._state
        proxy = state.require_proxy()
        release = await state.acquire()
        try:
            return await state.model_thread.run(proxy, model), release
        except BaseException:
            release()
            raise

    async def run_generation(self, fn: Callable[[], Any]) -> Any:
        return await self._state.model_thread.run(fn)

    def start_pump(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        return self._state.model_thread.submit(fn)

    def requests_waiting(self) -> int:
        return self._state.lock_waiting()

    # ---- slots (one: the model itself) --------------------------------------------------

    def slot_id(self, llama: Any) -> int:
        return 0

    def slots(self) -> List[Any]:
        proxy = self._state.proxy
        return [proxy.current if proxy is not None else None]

    async def acquire_slot(self, slot_id: int) -> Tuple[Any, Callable[[], None]]:
        """The model, for work on its cache (a slot's save or restore), under the model lock."""
        return await self.acquire_generation(None)

    async def run_on_slot(self, fn: Callable[[], Any]) -> Any:
        return await self._state.model_thread.run(fn)

    def counters(self) -> Dict[str, Any]:
        """The metrics of the loaded Llama's counters; read without the model lock (they are
        plain counters: a scrape never waits for a generation)."""
        proxy = self._state.proxy
        llama = proxy.current if proxy is not None else None
        if llama is None or getattr(llama, "_fallback", None) is not None:
            return {}
        t = llama.timings()
        sparse = llama.sparse_stats()
        return {
            "slots_busy": self._state.lock_busy(),
            "tokens_generated_total": t["n_eval"],
            "prompt_tokens_total": t["n_prompt"],
            "busy_seconds_total": (t["t_eval_ms"] + t["t_prompt_ms"]) / 1000,
            "tokens_per_second": t["n_eval"] / t["t_eval_ms"] * 1000 if t["t_eval_ms"] else 0.0,
            "sparse_active_fraction": sparse["active"],
            "sparse_layers": sparse["counts"],
            **_speculative_counters(llama.speculative_stats()),
        }

    def close(self) -> None:
        pass


class _SlotEngine:
    """`n_parallel` slots of a ParallelLlama (continuous batching, docs/parallel.md): a
    completion takes a free slot (a semaphore of n_parallel admits it) and runs on a worker
    thread; the pool's batcher thread computes every step."""

    def __init__(self, state: "ServerState", n_parallel: int):
        self._state = state
        self.n_parallel = n_parallel
        self._slots = anyio.Semaphore(n_parallel, max_value=n_parallel)
        self.pool: Any = None

    def load(self, proxy: ModelProxy) -> None:
        from ..parallel import ParallelLlama

        self.pool = ParallelLlama(proxy.current, n_parallel=self.n_parallel)

    def _reload(self, proxy: ModelProxy) -> None:
        if self.pool is None or not self.pool.failed:
            return  # another request reloaded it meanwhile
        old, self.pool = self.pool, None
        old.close()
        proxy()  # loads the model again (ModelProxy sees the failed one)
        self.load(proxy)

    async def acquire_generation(self, model: Optional[str]) -> Tuple[Any, Callable[[], None]]:
        proxy = self._state.require_proxy()
        if self.pool is not None and self.pool.failed:
            # An RPC worker of the model stopped answering: a new model and pool (the running
            # requests on the old one end with an error).
            await self._state.model_thread.run(self._reload, proxy)
        slot = None

        def give_back() -> None:
            if slot is not None:
                self.pool.release(slot)

        release = await _acquire(self._slots, give_back)
        slot = self.pool.acquire(timeout=0)  # the semaphore admitted us: a slot is free
        return slot, release

    async def run_generation(self, fn: Callable[[], Any]) -> Any:
        return await run_in_threadpool(fn)

    def start_pump(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        return _start_thread(fn, "powerinfer-stream")

    # ---- slots ----------------------------------------------------------------------------

    def slot_id(self, llama: Any) -> int:
        return self.pool.slot_id(llama)

    def slots(self) -> List[Any]:
        return list(self.pool.slots) if self.pool is not None else [None] * self.n_parallel

    async def acquire_slot(self, slot_id: int) -> Tuple[Any, Callable[[], None]]:
        """Slot `slot_id`, once it is free (llama-server defers a busy slot's action the same
        way), admitted like a request: a request admitted meanwhile finds another slot free."""
        self._state.require_proxy()
        slot = None

        def give_back() -> None:
            if slot is not None:
                self.pool.release(slot)

        release = await _acquire(self._slots, give_back)
        try:
            slot = await run_in_threadpool(self.pool.acquire, None, slot_id)
        except BaseException:
            release()
            raise
        return slot, release

    async def run_on_slot(self, fn: Callable[[], Any]) -> Any:
        return await run_in_threadpool(fn)

    def requests_waiting(self) -> int:
        return self._slots.statistics().tasks_waiting

    def counters(self) -> Dict[str, Any]:
        """The pool's counters, as of its last step (they never wait for a step)."""
        pool = self.pool
        if pool is None:
            return {}
        st = pool.stats
        return {
            "slots_busy": pool.slots_busy,
            "tokens_generated_total": st["tokens_generated"],
            "prompt_tokens_total": st["tokens_prompt"],
            "prompt_chunks_total": st["prompt_chunks"],
            "prompt_tokens_cached_total": st["prompt_tokens_reused"],
            "decode_steps_total": st["steps"],
            "busy_seconds_total": st["busy_seconds"],
            "step_seconds_max": st["step_seconds_max"],
            "decode_steps_restarted_total": st["steps_restarted"],
            "restart_seconds_total": st["restart_seconds"],
            "tokens_per_second": (st["tokens_generated"] + st["tokens_prompt"]) / st["busy_seconds"]
            if st["busy_seconds"] else 0.0,
            "kv_cells_used": st["kv_cells_used"],
            "sparse_active_fraction": st["sparse_active"] / st["sparse_total"] if st["sparse_total"] else None,
            "sparse_layers": pool.sparse_layer_counts(),
            **_speculative_counters(pool.speculative_stats()),
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class ServerState:
    """What the routes share: settings, the model proxy, the engine and the model lock.

    The engine runs completions: with n_parallel = 1 one at a time under the model lock, an
    anyio semaphore of one (not an anyio Lock: a streaming response releases it from the
    task that runs the stream, not the one that acquired it), first come, first served; with
    n_parallel > 1 on the slots of a ParallelLlama. The other model uses (embeddings, the
    tokenizer) take the lock in both, on the loaded Llama.

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
        self.model_thread = _ModelThread(release_after=self.n_parallel > 1)
        self.engine: Any = _SlotEngine(self, self.n_parallel) if self.n_parallel > 1 else _SerialEngine(self)
        self.load_error: Optional[BaseException] = None
        self.started = time.time()
        self._lock = anyio.Semaphore(1, max_value=1)
        # Streams by how they ended, and chunks sent: what tests and operators can check.
        self.stats: Dict[str, int] = {
            "streams_completed": 0,
            "streams_disconnected": 0,
            "streams_interrupted": 0,
            "streams_failed": 0,
            "streams_shutdown": 0,  # ended by the server shutting down (SIGTERM, SIGINT)
            "chunks_streamed": 0,
            # Non-streamed generations stopped because their client went away.
            "generations_cancelled": 0,
        }
        self.last_stream: Dict[str, Any] = {}
        # Per slot id, its running (or last) task, for GET /slots: id_task, params, n_decoded...
        self.slot_tasks: Dict[int, Dict[str, Any]] = {}
        self._task_ids = itertools.count()
        # Running streams, oldest first, and those told to end for a waiting request
        # (--interrupt_requests); touched on the event loop only.
        self._streams: List[object] = []
        self._interrupting: Set[object] = set()
        # begin_shutdown (SIGTERM, SIGINT): what stops each running generation and open stream;
        # touched on the event loop only.
        self.shutting_down = False
        self._on_shutdown: Set[Callable[[], None]] = set()
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

    @property
    def pool(self) -> Any:
        """The ParallelLlama of a server with slots (None otherwise, or until loaded)."""
        return getattr(self.engine, "pool", None)

    def _load(self, llama: Any) -> None:
        # Slots batch their steps: the packed kernels (Q4_0/Q4_1/Q8_0 weights) compute each
        # batch column alone and a 4-token step for little more than one token; other types
        # stay unrepacked, whose kernels also keep each column's rounding that of a lone one
        # (docs/parallel.md). Either way each stream equals its solo run.
        overrides = {"repack": False, "pack_dense": True} if self.n_parallel > 1 else {}
        proxy = ModelProxy(self.model_settings, llama=llama, overrides=overrides)
        self.engine.load(proxy)
        self.proxy = proxy

    def require_proxy(self) -> ModelProxy:
        if self.proxy is None:
            if self.load_error is not None:
                raise APIError(500, f"the model failed to load: {self.load_error}", type="internal_server_error")
            raise APIError(503, "Loading model", type="unavailable_error", code="loading")
        return self.proxy

    # ---- the model lock (and the engine's admission) ----------------------------------

    def requests_waiting(self) -> int:
        """Requests waiting for the engine (the model lock, or a slot)."""
        return self.engine.requests_waiting()

    def lock_waiting(self) -> int:
        return self._lock.statistics().tasks_waiting

    def lock_busy(self) -> int:
        return 1 - self._lock.value

    async def acquire(self) -> Callable[[], None]:
        """Wait for the model lock; returns the (idempotent) release function."""
        return await _acquire(self._lock)

    async def acquire_generation(self, model: Optional[str], draft: Optional[Dict[str, Any]] = None,
                                 body: Any = None) -> Tuple[Any, Callable[[], None]]:
        """The Llama a completion runs on (a free slot with n_parallel > 1) and its release;
        `draft`: drafting parameters for this request (Llama's draft_max, draft_min,
        draft_p_min), in force until the release; `body`: the request, whose parameters GET
        /slots shows while it runs. 503 once the server is shutting down (a request that waited
        for a slot meanwhile too)."""
        if self.shutting_down:
            raise self.shutdown_error()
        llama, release = await self.engine.acquire_generation(model)
        if self.shutting_down:
            release()
            raise self.shutdown_error()
        release = self._track_task(llama, body, release)
        if not draft or getattr(llama, "_fallback", None) is not None:
            return llama, release
        try:
            restore = llama._override_draft(**draft)
        except BaseException:
            release()
            raise

        def release_and_restore() -> None:
            try:
                restore()
            finally:
                release()

        return llama, release_and_restore

    def _track_task(self, llama: Any, body: Any, release: Callable[[], None]) -> Callable[[], None]:
        """Record the request as its slot's task (GET /slots) until `release`, which is returned
        wrapped: the record stays, not processing, as the slot's last task."""
        slot_id = self.engine.slot_id(llama)
        task = {"id_task": next(self._task_ids), "is_processing": True, "n_decoded": 0,
                "stream": bool(getattr(body, "stream", False)), "params": _task_params(body)}
        self.slot_tasks[slot_id] = task

        def release_and_record() -> None:
            task["is_processing"] = False
            release()

        return release_and_record

    def task_of(self, llama: Any) -> Optional[Dict[str, Any]]:
        """The task record of the slot `llama` is (None for a Llama that is no slot)."""
        try:
            return self.slot_tasks.get(self.engine.slot_id(llama))
        except ValueError:
            return None

    async def run_generation(self, fn: Callable[[], Any]) -> Any:
        """A completion's work: on the model thread, or with slots on a worker thread of
        its own (slots step together; their decodes run on the pool's engine)."""
        return await self.engine.run_generation(fn)

    def start_pump(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """A stream's pump loop: on the model thread, or with slots on a thread of its own."""
        return self.engine.start_pump(fn)

    async def acquire_slot(self, slot_id: int) -> Tuple[Any, Callable[[], None]]:
        """Slot `slot_id` (the model itself without --n_parallel) once it is free, for work on its
        cache, and its release; 503 once the server is shutting down."""
        if self.shutting_down:
            raise self.shutdown_error()
        if not 0 <= slot_id < self.n_parallel:
            raise APIError(400, f"Invalid slot id {slot_id}: this server has slots 0 to {self.n_parallel - 1}",
                           param="id_slot", code="invalid_value")
        return await self.engine.acquire_slot(slot_id)

    async def run_on_slot(self, fn: Callable[[], Any]) -> Any:
        """Work on a slot acquired with acquire_slot: on the model thread, or a worker thread."""
        return await self.engine.run_on_slot(fn)

    def proxy_model_path(self) -> str:
        """The file of the model being served."""
        path = self.require_proxy().current_path
        if path is None:
            raise APIError(503, "no model is loaded", type="unavailable_error", code="loading")
        return path

    def close(self) -> None:
        """At shutdown: stop the engine (a pool's batcher; the model stays with the proxy)."""
        self.engine.close()

    # ---- shutdown -----------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """On SIGTERM or SIGINT (called on the event loop): running generations stop at their
        next prompt slice or token, open streams end with an error event and [DONE], and
        requests still to come get 503. uvicorn waits for every response to end before it
        exits: without this, an open stream kept the process alive until its generation ended."""
        if self.shutting_down:
            return
        self.shutting_down = True
        for stop in list(self._on_shutdown):
            stop()

    @contextlib.contextmanager
    def stopped_at_shutdown(self, stop: Callable[[], None]) -> Iterator[None]:
        """Call `stop` (on the event loop; it must not block) if the server begins shutting
        down while the block runs, or at once if it has."""
        self._on_shutdown.add(stop)
        try:
            if self.shutting_down:
                stop()
            yield
        finally:
            self._on_shutdown.discard(stop)

    @staticmethod
    def shutdown_error() -> APIError:
        return APIError(503, "the server is shutting down", type="unavailable_error", code="shutting_down")

    # ---- streams ------------------------------------------------------------------------

    def stream_started(self, stream: object) -> None:
        self._streams.append(stream)

    def stream_ended(self, stream: object, outcome: str, chunks: int) -> None:
        if stream in self._streams:
            self._streams.remove(stream)
        self._interrupting.discard(stream)
        self.stats[f"streams_{outcome}"] += 1
        self.stats["chunks_streamed"] += chunks
        self.last_stream = {"outcome": outcome, "chunks": chunks}

    def should_interrupt(self, stream: object) -> bool:
        """--interrupt_requests: while requests wait for the engine, the oldest running
        streams end, one per waiting request (with slots, the others keep streaming)."""
        if not self.settings.interrupt_requests or stream in self._interrupting:
            return False
        n = self.requests_waiting() - len(self._interrupting)
        if n <= 0 or stream not in [s for s in self._streams if s not in self._interrupting][:n]:
            return False
        self._interrupting.add(stream)
        return True
