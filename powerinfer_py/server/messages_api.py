"""POST /v1/messages: Anthropic's Messages API over the chat completions engine.

A request (`system` as text or text blocks, `messages` with text or content blocks, the
required `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools`, `stream`)
becomes a chat completion request; its answer becomes a Message (text and tool_use blocks,
stop_reason end_turn, max_tokens, stop_sequence or tool_use, usage), and its stream
Anthropic's events: message_start, content_block_start, ping, content_block_delta (text_delta,
input_json_delta), content_block_stop, message_delta (stop_reason, usage), message_stop.
Every error of these routes, validation included, is Anthropic's error body
({"type": "error", "error": {"type", "message"}}) with a 4xx or 5xx status.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError, anthropic_error_body, anthropic_error_response
from .requests import chat_kwargs
from .routes import run_model
from .streaming import sse_event, stream_response
from .translate import ChatAnswer, ChatStreamEvents, chat_request, model_name, new_id, stop_sequence_of, usage_of
from .types import INT32_MAX

__all__ = ["CreateMessageRequest", "create_message", "is_messages_route"]

# Content blocks a client may send back that carry nothing for the model here.
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


def is_messages_route(path: str) -> bool:
    """Whether `path` is one of the Messages API's routes (their errors take its shape)."""
    return path.rstrip("/").endswith("/v1/messages")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class CreateMessageRequest(BaseModel):
    """The fields of Anthropic's POST /v1/messages this server reads; others are ignored."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = Field(default=None, description="The model to use (any name: the loaded one).")
    max_tokens: int = Field(ge=1, le=INT32_MAX, description="The most tokens to generate (required).")
    messages: List[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0, le=INT32_MAX)
    stream: bool = False
    tools: Optional[List[Dict[str, Any]]] = Field(
        default=None, description='Client tools: {"name", "description", "input_schema"}.')
    tool_choice: Optional[Dict[str, Any]] = Field(default=None, description='{"type": "auto" | "any" | "tool" | "none"}')
    metadata: Optional[Dict[str, Any]] = None


def _block_text(block: Dict[str, Any], where: str) -> str:
    if block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    raise APIError(400, f"{where}: content blocks of type {block.get('type')!r} are not supported here (text)",
                   param=where)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    return "".join(_block_text(b, f"{where}[{k}]") for k, b in enumerate(content) if isinstance(b, dict))


def _messages(body: CreateMessageRequest) -> List[Dict[str, Any]]:
    """The request's system prompt and messages as chat messages."""
    out: List[Dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: List[str] = []
        calls: List[Dict[str, Any]] = []
        for k, block in enumerate(message.content):
            kind = block.get("type")
            if kind == "text":
                texts.append(_block_text(block, f"{where}[{k}]"))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": block.get("id") or new_id("toolu"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and message.role == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(block.get("content", ""), f"{where}[{k}].content")})
            elif kind not in _SKIPPED_BLOCKS:
                raise APIError(400, f"{where}[{k}]: content blocks of type {kind!r} are not supported (text, "
                               "tool_use, tool_result)", param="messages")
        if texts or calls or not message.content:
            entry: Dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _chat_tools(body: CreateMessageRequest) -> Optional[List[Dict[str, Any]]]:
    if not body.tools:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported",
                           param="tools")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _chat_tool_choice(choice: Optional[Dict[str, Any]]) -> Any:
    kind = (choice or {}).get("type")
    if kind is None:
        return None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}", param="tool_choice")
    return mapped


def to_chat(body: CreateMessageRequest):
    fields: Dict[str, Any] = {
        "model": body.model, "messages": _messages(body), "max_tokens": body.max_tokens, "stop": body.stop_sequences,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stream": body.stream,
        "tools": _chat_tools(body), "tool_choice": _chat_tool_choice(body.tool_choice),
    }  # fmt: skip
    return chat_request(fields, {"stop": "stop_sequences"})


# ---------------------------------------------------------------------------- the answer


def _stop_reason(answer: ChatAnswer, llama: Any) -> Dict[str, Optional[str]]:
    if answer.tool_calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if answer.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    stop = stop_sequence_of(llama)
    return {"stop_reason": "stop_sequence" if stop is not None else "end_turn", "stop_sequence": stop}


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return {}


def _message(message_id: str, model: str, content: List[Dict[str, Any]], usage: Dict[str, int],
             stop: Dict[str, Optional[str]]) -> Dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content, **stop,
            "usage": usage}


class _MessageEvents(ChatStreamEvents):
    """A chat stream as Anthropic's events."""

    def __init__(self, llama: Any, model: str):
        super().__init__(llama)
        self.model = model
        self.blocks = 0  # content blocks started
        self.open: Optional[str] = None  # the kind of the block being written

    def on_start(self) -> bytes:
        n_in, _ = usage_of(self.llama)
        message = _message(new_id("msg"), self.model, [], {"input_tokens": n_in, "output_tokens": 0},
                           {"stop_reason": None, "stop_sequence": None})
        return sse_event({"type": "message_start", "message": message}, "message_start")

    def _start_block(self, kind: str, block: Dict[str, Any]) -> bytes:
        out = self._stop_block()
        self.open = kind
        out += sse_event({"type": "content_block_start", "index": self.blocks, "content_block": block},
                         "content_block_start")
        if self.blocks == 0:
            out += sse_event({"type": "ping"}, "ping")
        self.blocks += 1
        return out

    def _stop_block(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return sse_event({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop")

    def _delta(self, delta: Dict[str, Any]) -> bytes:
        return sse_event({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta},
                         "content_block_delta")

    def on_text(self, delta: str) -> bytes:
        out = self._start_block("text", {"type": "text", "text": ""}) if self.open != "text" else b""
        return out + self._delta({"type": "text_delta", "text": delta})

    def on_tool_call(self, call: Dict[str, str]) -> bytes:
        return self._start_block("tool_use", {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}})

    def on_tool_arguments(self, call: Dict[str, str], delta: str) -> bytes:
        return self._delta({"type": "input_json_delta", "partial_json": delta})

    def on_end(self) -> bytes:
        out = b"" if self.blocks else self._start_block("text", {"type": "text", "text": ""})
        out += self._stop_block()
        n_in, n_out = usage_of(self.llama)
        delta = {"type": "message_delta", "delta": _stop_reason(self.answer, self.llama),
                 "usage": {"input_tokens": n_in, "output_tokens": n_out}}
        return out + sse_event(delta, "message_delta") + sse_event({"type": "message_stop"}, "message_stop")

    def error(self, error: APIError) -> bytes:
        return sse_event(anthropic_error_body(error.status_code, error.body["message"]), "error")

    def shutdown(self, error: APIError) -> bytes:
        return self.error(error)


async def create_message(request: Request, body: CreateMessageRequest) -> Response:
    try:
        chat = to_chat(body)
    except APIError as exc:
        return anthropic_error_response(exc)
    kwargs = chat_kwargs(chat)
    model = model_name(request, body.model)
    if chat.stream:
        return await stream_response(request, chat, kwargs, "create_chat_completion",
                                     events=lambda llama: _MessageEvents(llama, model),
                                     render_error=anthropic_error_response)

    def convert(result: Dict[str, Any], llama: Any) -> Dict[str, Any]:
        answer = ChatAnswer.of_result(result)
        content: List[Dict[str, Any]] = []
        if answer.text or not answer.tool_calls:
            content.append({"type": "text", "text": answer.text})
        content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": _tool_input(c["arguments"])}
                    for c in answer.tool_calls]
        usage = result.get("usage") or {}
        return _message(new_id("msg"), model, content, {"input_tokens": usage.get("prompt_tokens", 0),
                                                        "output_tokens": usage.get("completion_tokens", 0)},
                        _stop_reason(answer, llama))

    return await run_model(request, chat, kwargs, "create_chat_completion", convert=convert,
                           render_error=anthropic_error_response)
