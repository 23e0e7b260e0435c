"""LangChain integration: `PowerInferLLM`, `ChatPowerInfer` and `PowerInferEmbeddings`.

They run `powerinfer_py.Llama` in-process, on langchain-core's base classes, with the
fields of langchain-community's `LlamaCpp`, `ChatLlamaCpp` and `LlamaCppEmbeddings`
(plus `vram_budget`, `sparse_mode`, `sparse_threshold`). Install the extra with
`pip install 'powerinfer-py[langchain]'`.

A Llama is not thread-safe and LangChain runs batches on a thread pool, so every call
holds a lock per Llama instance (a stream holds it until it is exhausted or closed).
"""

from __future__ import annotations

import threading
import weakref
from operator import itemgetter
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Type, Union

try:
    from langchain_core.callbacks import CallbackManagerForLLMRun
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

__all__ = ["PowerInferLLM", "ChatPowerInfer", "PowerInferEmbeddings"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# ---------------------------------------------------------------------------- shared


_locks: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _lock_for(client: Any) -> threading.Lock:
    """The lock of one Llama, shared by every wrapper around it. A plain Lock, not an
    RLock: LangChain's async paths step a stream from different executor threads."""
    with _locks_guard:
        lock = _locks.get(client)
        if lock is None:
            lock = _locks[client] = threading.Lock()
        return lock


def _locked_stream(client: Any, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """Iterate start() while holding the client's lock; released when the stream ends or
    is closed (an abandoned stream is closed when it is garbage-collected)."""
    lock = _lock_for(client)
    with lock:
        iterator = start()
        try:
            yield from iterator
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


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
        with _lock_for(self.client):
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
        with _lock_for(self.client):
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
        with _lock_for(self.client):
            response = self.client.create_embedding(list(texts))
        return [_pooled(item["embedding"]) for item in response["data"]]

    def embed_query(self, text: str) -> List[float]:
        with _lock_for(self.client):
            embedding = self.client.embed(text)
        return _pooled(embedding)


def _pooled(embedding: Any) -> List[float]:
    """One vector per text. A model without pooling gives one per token; then the last
    token's is used, as it has attended to the whole text (LlamaCppEmbeddings returns
    the first token's from embed_query and every token's from embed_documents)."""
    if getattr(embedding, "ndim", 1) == 2 or (len(embedding) and isinstance(embedding[0], (list, tuple))):
        embedding = embedding[-1]
    return [float(x) for x in embedding]
