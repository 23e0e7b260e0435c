"""LangChain integration: `PowerInferLLM`, `ChatPowerInfer` and `PowerInferEmbeddings`.

They run `powerinfer_py.Llama` in-process, on langchain-core's base classes, with the
fields of langchain-community's `LlamaCpp`, `ChatLlamaCpp` and `LlamaCppEmbeddings`
(plus `vram_budget`, `sparse_mode`, `sparse_threshold`). Install the extra with
`pip install 'powerinfer-py[langchain]'`.

Concurrency. A Llama is not thread-safe and LangChain runs batches on a thread pool, so
the calls on one Llama (through any number of wrappers) take turns:

- a call (`invoke`, `batch` items, embeddings) holds the Llama while it runs;
- a stream holds it only while it computes its next chunk. Between chunks it stays
  *open*: the Llama's state belongs to it until it is exhausted, closed or collected;
- a call from another thread or asyncio task waits until the open stream ends, so
  concurrent streams and calls are served one after another, each complete;
- a call from the thread or task that is consuming the open stream (or whose consumer
  thread or task has ended) cannot be waiting for that stream to progress, so it
  cancels the stream instead of deadlocking: the call runs at once, and the cancelled
  stream raises `StreamCancelledError` (a RuntimeError) if it is resumed. To keep two
  generations going at once, use two Llama instances. To end a stream early, `close()`
  it (a `for` loop left by `break` closes it when it is garbage-collected, which the
  next call does not need to wait for either).

The async methods (`ainvoke`, `astream`, ...) wait for their turn in the event loop,
not in an executor thread, and count as their asyncio task.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import weakref
from operator import itemgetter
from typing import (Any, AsyncIterator, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Type,
                    Union)

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.embeddings import Embeddings
    from langchain_core.language_models import LanguageModelInput
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.language_models.llms import LLM
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.output_parsers.openai_tools import make_invalid_tool_call, parse_tool_call
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, GenerationChunk
    from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
    from langchain_core.tools import BaseTool
    from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
    from langchain_core.utils.pydantic import is_basemodel_subclass
    from pydantic import BaseModel, ConfigDict, Field, model_validator
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"powerinfer_py.langchain needs the 'langchain' extra (langchain-core; {e}): "
        "pip install 'powerinfer-py[langchain]'"
    ) from e

__all__ = ["PowerInferLLM", "ChatPowerInfer", "PowerInferEmbeddings", "StreamCancelledError"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# ---------------------------------------------------------------------------- shared


class _Task:
    """An asyncio task as a consumer, with the task that started it (as far as our async
    methods saw: each records its task in a context variable, which tasks started
    afterwards inherit), so that a call from a task that the stream's own task is
    awaiting counts as that task's."""

    __slots__ = ("task", "parent")

    def __init__(self, task: "asyncio.Task[Any]", parent: "Optional[_Task]"):
        self.task, self.parent = task, parent

    def lineage(self) -> Iterator["asyncio.Task[Any]"]:
        node: Optional[_Task] = self
        while node is not None:
            yield node.task
            node = node.parent


_consumer_var: "contextvars.ContextVar[Optional[_Task]]" = contextvars.ContextVar(
    "powerinfer_langchain_task", default=None
)


def _consumer() -> Any:
    """Who is calling: the asyncio task when running in an event loop; in a worker thread
    that LangChain runs an async call in (its run_in_executor copies the context), the
    task that our async method recorded; otherwise the thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop running in this thread
        task = None
    recorded = _consumer_var.get()
    if task is None:
        return recorded if recorded is not None else threading.current_thread()
    if recorded is not None and recorded.task is task:
        return recorded
    return _Task(task, recorded)


def _same_consumer(owner: Any, caller: Any) -> bool:
    """Whether `caller` is the stream owner itself, or a task started by the owner task."""
    if owner is caller:
        return True
    if isinstance(owner, _Task) and isinstance(caller, _Task):
        return any(t is owner.task for t in caller.lineage())
    return False


def _alive(consumer: Any) -> bool:
    """Whether a stream's consumer (a thread or an asyncio task) can still step it."""
    if isinstance(consumer, threading.Thread):
        return consumer.is_alive()
    if isinstance(consumer, _Task):
        return not consumer.task.done()
    return True


class StreamCancelledError(RuntimeError):
    """Raised by a stream resumed after another call from the same thread or task used its
    model: the model's state has moved on, so the stream cannot continue."""


class _OpenStream:
    """A stream that has started and not finished: it reserves its Llama between steps."""

    __slots__ = ("consumer", "iterator", "cancelled", "abandoned")

    def __init__(self, consumer: Any):
        self.consumer = consumer
        self.iterator: Any = None
        self.cancelled = False  # closed by a later call of the same consumer
        self.abandoned = False  # closed or garbage-collected while suspended, not yet cleaned up

    def close_iterator(self) -> None:
        close = getattr(self.iterator, "close", None)
        self.iterator = None
        if close is not None:
            close()


class _Gate:
    """The use of one Llama, shared by every wrapper around it.

    `busy` is held while a call or one step of a stream runs; a suspended stream does not
    hold it, but stays `open` (the Llama's state belongs to it) until it ends. A caller
    waits while the Llama is busy, or while another thread's or task's stream is open;
    an open stream of the caller's own thread or task (which the caller is evidently
    not consuming) is cancelled instead, and so is one that was abandoned. So a kept
    stream can never block its own thread, and every wait is for work that another
    thread or task is doing.

    Cleanup of a stream closed by garbage collection never blocks: the finalizer may run
    in the middle of any code, even in a thread inside this gate, so it only marks the
    stream abandoned (and cleans up at once when it can take the gate without waiting);
    waiters re-check every 0.25 s."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._busy = False
        self._open: Optional[_OpenStream] = None
        self._reserved: Any = None  # an async caller admitted in the event loop, on its way to acquire()

    def _admits(self, consumer: Any) -> bool:  # under the mutex
        if self._busy:
            return False
        r = self._reserved
        if r is not None and not _same_consumer(r, consumer) and _alive(r):
            return False
        s = self._open
        return s is None or s.abandoned or _same_consumer(s.consumer, consumer) or not _alive(s.consumer)

    def acquire(self, consumer: Any) -> None:
        """Take the Llama for a new call or stream of `consumer`."""
        stale = None
        with self._cond:
            while not self._admits(consumer):
                self._cond.wait(0.25)
            self._busy = True
            self._reserved = None
            if self._open is not None:
                stale, self._open = self._open, None
                stale.cancelled = not stale.abandoned
        if stale is not None:
            try:
                stale.close_iterator()  # the Llama's generator: clears its sampler
            except Exception:  # pragma: no cover - closing a generator does not raise
                pass

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    async def wait_async(self, consumer: Any) -> None:
        """Wait in the event loop until `consumer` is admitted, and reserve the Llama for
        it until its worker thread calls acquire(): the async paths must not wait in
        executor threads, which the steps of the stream they wait for need."""
        delay = 0.002
        while True:
            with self._mutex:
                if self._admits(consumer):
                    self._reserved = consumer
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def unreserve(self, consumer: Any) -> None:
        """Drop a reservation that acquire() did not take (the call failed or was cancelled)."""
        with self._cond:
            if self._reserved is consumer:
                self._reserved = None
                self._cond.notify_all()

    def open(self, stream: _OpenStream) -> None:
        with self._mutex:
            self._open = stream

    def resume(self, stream: _OpenStream) -> None:
        """Take the Llama again for the next step of `stream`, for whoever steps it now."""
        consumer = _consumer()
        with self._cond:
            stream.consumer = consumer
            while not stream.cancelled and self._busy:
                self._cond.wait(0.25)
            if stream.cancelled:
                raise StreamCancelledError(
                    "this stream was cancelled: another call on the same model was made from the thread or task "
                    "that had started it before the stream was finished (consume or close() a stream before the "
                    "next call)"
                )
            self._busy = True

    def finish(self, stream: _OpenStream) -> None:
        """The stream ended while stepping (busy is held): close it, free the Llama."""
        try:
            stream.close_iterator()
        finally:
            with self._cond:
                if self._open is stream:
                    self._open = None
                self._busy = False
                self._cond.notify_all()

    def abandon(self, stream: _OpenStream) -> None:
        """The stream was closed while suspended (close(), or garbage collection). Never blocks."""
        if stream.cancelled:
            return
        stream.abandoned = True
        if not self._mutex.acquire(blocking=False):
            return  # a later caller (or a waiter's re-check) cleans up
        try:
            if self._busy or self._open is not stream:
                return
            self._busy = True
            self._open = None
        finally:
            self._mutex.release()
        try:
            stream.close_iterator()
        finally:
            self.release()


_gates: "weakref.WeakKeyDictionary[Any, _Gate]" = weakref.WeakKeyDictionary()
_gates_guard = threading.Lock()


def _gate_for(client: Any) -> _Gate:
    with _gates_guard:
        gate = _gates.get(client)
        if gate is None:
            gate = _gates[client] = _Gate()
        return gate


@contextlib.contextmanager
def _using(client: Any) -> Iterator[None]:
    """Hold the client's Llama for one whole call."""
    gate = _gate_for(client)
    gate.acquire(_consumer())
    try:
        yield
    finally:
        gate.release()


def _locked_stream(client: Any, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """Iterate start(), holding the client's Llama during each step only (see _Gate)."""
    gate = _gate_for(client)
    stream = _OpenStream(_consumer())
    gate.acquire(stream.consumer)
    stepping = True
    try:
        stream.iterator = start()
        gate.open(stream)
        while True:
            try:
                item = next(stream.iterator)
            except StopIteration:
                return
            stepping = False
            gate.release()
            yield item
            gate.resume(stream)
            stepping = True
    finally:
        if stepping:
            gate.finish(stream)
        else:
            gate.abandon(stream)


async def _in_task(client: Any, call: Callable[[], Any]) -> Any:
    """Run an async LangChain method as the current task (recorded for the worker threads
    it uses), after waiting in the event loop until the model is free for it."""
    me = _consumer()
    token = _consumer_var.set(me)
    gate = _gate_for(client)
    try:
        await gate.wait_async(me)
        return await call()
    finally:
        gate.unreserve(me)
        _consumer_var.reset(token)


async def _astream_in_task(client: Any, agen_factory: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
    me = _consumer()
    # Set without a reset: an async generator runs in its consumer task's context, and
    # tasks that this one starts while it keeps the stream must inherit it (see _Task).
    _consumer_var.set(me)
    gate = _gate_for(client)
    try:
        await gate.wait_async(me)
        async for item in agen_factory():
            yield item
    finally:
        gate.unreserve(me)


class _LlamaFields(BaseModel):
    """How to load the Llama (langchain-community's LlamaCpp fields), or an existing one."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), populate_by_name=True)

    client: Any = None
    """An already loaded powerinfer_py.Llama; model_path and the load fields are then unused."""
    model_path: str = ""
    """Path to the GGUF model."""
    n_ctx: int = 512
    """Token context window."""
    n_batch: Optional[int] = 512
    """Largest number of prompt tokens evaluated at once."""
    n_threads: Optional[int] = None
    """Decode threads; None: half the cores."""
    n_gpu_layers: Optional[int] = None
    """Layers placed on the GPU (passed on when set)."""
    seed: int = LLAMA_DEFAULT_SEED
    """Sampler seed; -1 or LLAMA_DEFAULT_SEED: random."""
    vram_budget: Optional[float] = None
    """Device memory budget for hot neurons, in GiB; None: automatic."""
    sparse_mode: Optional[Literal["auto", "dense", "gate", "predictor"]] = None
    """How FFN sparsity is used; None: the Llama default."""
    sparse_threshold: Optional[float] = None
    """Predictor activation threshold; None: the model's."""
    chat_format: Optional[str] = None
    """Chat format name; None: the GGUF's chat template."""
    verbose: bool = True
    """Print the engine's log and timings to stderr."""
    model_kwargs: Dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments for powerinfer_py.Llama."""

    def _load_client(self, **extra: Any) -> Any:
        from . import Llama

        params: Dict[str, Any] = {
            "n_ctx": self.n_ctx,
            "seed": self.seed,
            "verbose": self.verbose,
        }
        for name in ("n_batch", "n_threads", "n_gpu_layers", "vram_budget", "sparse_mode", "sparse_threshold", "chat_format"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        params.update(extra)
        params.update(self.model_kwargs)
        if not self.model_path:
            raise ValueError("model_path is required unless an existing Llama is passed as client")
        return Llama(model_path=self.model_path, **params)


def _stop_list(own: Optional[List[str]], call: Optional[List[str]]) -> List[str]:
    return list(dict.fromkeys([*(own or []), *(call or [])]))


# ---------------------------------------------------------------------------- LLM


class PowerInferLLM(_LlamaFields, LLM):
    """Text completion with powerinfer_py.Llama (the counterpart of LlamaCpp).

    Example:
        .. code-block:: python

            from powerinfer_py.langchain import PowerInferLLM
            llm = PowerInferLLM(model_path="model.gguf", temperature=0, max_tokens=64)
            llm.invoke("Once upon a time")
    """

    suffix: Optional[str] = None
    max_tokens: Optional[int] = 256
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    logprobs: Optional[int] = None
    echo: bool = False
    stop: Optional[List[str]] = None
    """Stop sequences, joined with those given per call."""
    grammar: Optional[Any] = None
    """A GBNF grammar (text or LlamaGrammar) constraining the output."""
    streaming: bool = True
    """Generate through the streaming API, so callbacks see each token (as LlamaCpp)."""

    @model_validator(mode="after")
    def _load(self) -> "PowerInferLLM":
        if self.client is None:
            self.client = self._load_client()
        return self

    @property
    def _llm_type(self) -> str:
        return "powerinfer"

    @property
    def _default_params(self) -> Dict[str, Any]:
        params = {
            "suffix": self.suffix,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "logprobs": self.logprobs,
            "echo": self.echo,
        }
        if self.grammar is not None:
            params["grammar"] = _as_grammar(self.grammar)
        return params

    @property
    def _identifying_params(self) -> Dict[str, Any]:
        return {"model_path": self.model_path, **{k: v for k, v in self._default_params.items() if k != "grammar"}}

    def _params(self, stop: Optional[List[str]], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        return {**self._default_params, "stop": _stop_list(self.stop, stop), **kwargs}

    def _call(
        self,
        prompt: str,
        stop: Optional[List[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> str:
        if self.streaming:
            return "".join(chunk.text for chunk in self._stream(prompt, stop, run_manager, **kwargs))
        params = self._params(stop, kwargs)
        with _using(self.client):
            result = self.client.create_completion(prompt, **params)
        return result["choices"][0]["text"]

    def _stream(
        self,
        prompt: str,
        stop: Optional[List[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        params = self._params(stop, kwargs)
        for part in _locked_stream(self.client, lambda: self.client.create_completion(prompt, stream=True, **params)):
            choice = part["choices"][0]
            logprobs = choice.get("logprobs")
            chunk = GenerationChunk(
                text=choice["text"],
                generation_info={"finish_reason": choice.get("finish_reason"), "logprobs": logprobs},
            )
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk, verbose=self.verbose, log_probs=logprobs)
            yield chunk

    async def _acall(
        self,
        prompt: str,
        stop: Optional[List[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> str:
        base = super(PowerInferLLM, self)._acall
        return await _in_task(self.client, lambda: base(prompt, stop, run_manager, **kwargs))

    async def _astream(
        self,
        prompt: str,
        stop: Optional[List[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        base = super(PowerInferLLM, self)._astream
        async for chunk in _astream_in_task(self.client, lambda: base(prompt, stop, run_manager, **kwargs)):
            yield chunk

    def get_num_tokens(self, text: str) -> int:
        return len(self.client.tokenize(text.encode("utf-8")))


def _as_grammar(grammar: Any) -> Any:
    if isinstance(grammar, str):
        from .llama_grammar import LlamaGrammar

        return LlamaGrammar.from_string(grammar)
    return grammar


# ---------------------------------------------------------------------------- chat model


def _tool_calls_from_openai(raw_calls: Sequence[Dict[str, Any]]) -> tuple:
    tool_calls, invalid = [], []
    for raw in raw_calls:
        try:
            parsed = parse_tool_call(raw, return_id=True)
        except Exception as e:
            invalid.append(make_invalid_tool_call(raw, str(e)))
            continue
        if parsed is not None:
            tool_calls.append(parsed)
    return tool_calls, invalid


def _usage_metadata(usage: Optional[Mapping[str, int]]) -> Optional[Dict[str, int]]:
    if not usage:
        return None
    return {
        "input_tokens": int(usage.get("prompt_tokens", 0)),
        "output_tokens": int(usage.get("completion_tokens", 0)),
        "total_tokens": int(usage.get("total_tokens", 0)),
    }


class ChatPowerInfer(_LlamaFields, BaseChatModel):
    """Chat with powerinfer_py.Llama (the counterpart of ChatLlamaCpp): the GGUF's chat
    template, tools, `with_structured_output`, streaming.

    Example:
        .. code-block:: python

            from powerinfer_py.langchain import ChatPowerInfer
            chat = ChatPowerInfer(model_path="model.gguf", temperature=0)
            chat.invoke([("system", "Be brief."), ("human", "What is 2 + 2?")])
    """

    max_tokens: Optional[int] = 256
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    logprobs: Optional[bool] = None
    stop: Optional[List[str]] = None
    grammar: Optional[Any] = None

    @model_validator(mode="after")
    def _load(self) -> "ChatPowerInfer":
        if self.client is None:
            self.client = self._load_client()
        return self

    @property
    def _llm_type(self) -> str:
        return "powerinfer-chat"

    @property
    def _default_params(self) -> Dict[str, Any]:
        params: Dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
        }
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        if self.grammar is not None:
            params["grammar"] = _as_grammar(self.grammar)
        return params

    @property
    def _identifying_params(self) -> Dict[str, Any]:
        return {"model_path": self.model_path, **{k: v for k, v in self._default_params.items() if k != "grammar"}}

    def _params(self, stop: Optional[List[str]], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        params = {**self._default_params, **kwargs}
        stops = _stop_list(self.stop, stop)
        if stops:
            params["stop"] = stops
        return params

    def _generate(
        self,
        messages: List[BaseMessage],
        stop: Optional[List[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        params = self._params(stop, kwargs)
        with _using(self.client):
            response = self.client.create_chat_completion(messages=convert_to_openai_messages(messages), **params)
        generations = []
        for choice in response["choices"]:
            raw = choice["message"]
            tool_calls, invalid = _tool_calls_from_openai(raw.get("tool_calls") or [])
            additional = {"tool_calls": raw["tool_calls"]} if raw.get("tool_calls") else {}
            message = AIMessage(
                content=raw.get("content") or "",
                tool_calls=tool_calls,
                invalid_tool_calls=invalid,
                additional_kwargs=additional,
                usage_metadata=_usage_metadata(response.get("usage")),
                response_metadata={"finish_reason": choice.get("finish_reason"), "model_name": response.get("model")},
            )
            generations.append(
                ChatGeneration(message=message, generation_info={"finish_reason": choice.get("finish_reason")})
            )
        return ChatResult(generations=generations, llm_output={"token_usage": response.get("usage")})

    def _stream(
        self,
        messages: List[BaseMessage],
        stop: Optional[List[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        params = self._params(stop, kwargs)
        openai_messages = convert_to_openai_messages(messages)
        parts = _locked_stream(
            self.client,
            lambda: self.client.create_chat_completion(messages=openai_messages, stream=True, **params),
        )
        for part in parts:
            if not part.get("choices"):
                continue
            choice = part["choices"][0]
            delta = choice.get("delta") or {}
            tool_call_chunks = [
                {
                    "name": (tc.get("function") or {}).get("name"),
                    "args": (tc.get("function") or {}).get("arguments"),
                    "id": tc.get("id"),
                    "index": tc.get("index"),
                }
                for tc in delta.get("tool_calls") or []
            ]
            finish_reason = choice.get("finish_reason")
            message = AIMessageChunk(
                content=delta.get("content") or "",
                tool_call_chunks=tool_call_chunks,
                response_metadata={"finish_reason": finish_reason} if finish_reason else {},
            )
            chunk = ChatGenerationChunk(
                message=message,
                generation_info={"finish_reason": finish_reason} if finish_reason else None,
            )
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(
        self,
        messages: List[BaseMessage],
        stop: Optional[List[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        base = super(ChatPowerInfer, self)._agenerate
        return await _in_task(self.client, lambda: base(messages, stop, run_manager, **kwargs))

    async def _astream(
        self,
        messages: List[BaseMessage],
        stop: Optional[List[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        base = super(ChatPowerInfer, self)._astream
        async for chunk in _astream_in_task(self.client, lambda: base(messages, stop, run_manager, **kwargs)):
            yield chunk

    def bind_tools(
        self,
        tools: Sequence[Union[Dict[str, Any], Type[BaseModel], Callable, BaseTool]],
        *,
        tool_choice: Optional[Union[Dict[str, Any], str, bool]] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, BaseMessage]:
        """Bind tools in OpenAI format.

        tool_choice: a tool name, an OpenAI {"type": "function", ...} dict, "auto",
        "none", or "any"/"required"/True. The engine forces a call only to one named
        tool, so "any" with a single tool forces that tool and with several means "auto".
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        names = [tool["function"]["name"] for tool in formatted]
        if tool_choice is True or tool_choice in ("any", "required"):
            tool_choice = names[0] if len(names) == 1 else "auto"
        if tool_choice is False:
            tool_choice = None
        if isinstance(tool_choice, str) and tool_choice not in ("auto", "none"):
            if tool_choice not in names:
                raise ValueError(f"tool_choice {tool_choice!r} is not one of the tools {names}")
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        if isinstance(tool_choice, dict) and tool_choice.get("function", {}).get("name") not in names:
            raise ValueError(f"tool_choice {tool_choice!r} names none of the tools {names}")
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: Optional[Union[Dict[str, Any], Type[Any]]] = None,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Union[Dict[str, Any], BaseModel]]:
        """Outputs that follow `schema` (a Pydantic class, TypedDict or JSON schema).

        function_calling (default, as ChatLlamaCpp): a forced tool call. json_schema:
        response_format with the schema, enforced by a grammar. json_mode: any JSON
        object (the prompt must describe it; schema is optional).
        """
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema must be specified when method is 'function_calling'")
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "json_schema":
            if schema is None:
                raise ValueError("schema must be specified when method is 'json_schema'")
            response_format = {"type": "json_object", "schema": convert_to_json_schema(schema)}
        elif method == "json_mode":
            response_format = {"type": "json_object"}
        else:
            raise ValueError(f"unknown method {method!r}: function_calling, json_schema or json_mode")
        llm = self.bind(response_format=response_format)
        parser: Runnable = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return llm | parser
        parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")

    def get_num_tokens(self, text: str) -> int:
        return len(self.client.tokenize(text.encode("utf-8")))


# ---------------------------------------------------------------------------- embeddings


class PowerInferEmbeddings(_LlamaFields, Embeddings):
    """Embeddings with powerinfer_py.Llama (the counterpart of LlamaCppEmbeddings).

    Example:
        .. code-block:: python

            from powerinfer_py.langchain import PowerInferEmbeddings
            emb = PowerInferEmbeddings(model_path="model.gguf")
            emb.embed_query("hello")
    """

    @model_validator(mode="after")
    def _load(self) -> "PowerInferEmbeddings":
        if self.client is None:
            self.client = self._load_client(embedding=True)
        return self

    def embed_documents(self, texts: List[str]) -> List[List[float]]:
        if not texts:
            return []
        with _using(self.client):
            response = self.client.create_embedding(list(texts))
        return [_pooled(item["embedding"]) for item in response["data"]]

    def embed_query(self, text: str) -> List[float]:
        with _using(self.client):
            embedding = self.client.embed(text)
        return _pooled(embedding)

    async def aembed_documents(self, texts: List[str]) -> List[List[float]]:
        base = super(PowerInferEmbeddings, self).aembed_documents
        return await _in_task(self.client, lambda: base(texts))

    async def aembed_query(self, text: str) -> List[float]:
        base = super(PowerInferEmbeddings, self).aembed_query
        return await _in_task(self.client, lambda: base(text))


def _pooled(embedding: Any) -> List[float]:
    """One vector per text. A model without pooling gives one per token; then the last
    token's is used, as it has attended to the whole text (LlamaCppEmbeddings returns
    the first token's from embed_query and every token's from embed_documents)."""
    if getattr(embedding, "ndim", 1) == 2 or (len(embedding) and isinstance(embedding[0], (list, tuple))):
        embedding = embedding[-1]
    return [float(x) for x in embedding]
