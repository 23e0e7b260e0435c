"""POST /v1/responses: OpenAI's Responses API over the chat completions engine.

A request (`input` as text or a list of items, `instructions`, `max_output_tokens`,
`temperature`, `top_p`, function `tools`, `text.format`, `stream`) becomes a chat completion
request; its answer becomes a Response object with a message item and function_call items,
and its stream the Responses API's events (response.created, response.output_item.added,
response.content_part.added, response.output_text.delta, ..., response.completed), each with
its sequence_number. Nothing is stored: `previous_response_id` and `store: true` retrieval are
not served. Errors are OpenAI's error body, as on every other OpenAI route.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .requests import chat_kwargs
from .routes import run_model
from .streaming import sse_event, stream_response
from .translate import ChatAnswer, ChatStreamEvents, chat_request, model_name, new_id, usage_of
from .types import INT32_MAX

__all__ = ["CreateResponseRequest", "create_response"]

# llama.cpp sampling fields a request may add (as llama-server takes them), passed on as sent.
_PASSTHROUGH = ("seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "stop",
                "logit_bias", "grammar", "min_tokens")


class CreateResponseRequest(BaseModel):
    """The fields of OpenAI's POST /v1/responses this server reads; others are ignored, and
    the llama.cpp sampling fields of chat completions (seed, top_k, min_p, repeat_penalty,
    stop, ...) are taken too."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = Field(default=None, description="The model to use (any name: the loaded one).")
    input: Union[str, List[Dict[str, Any]]] = Field(
        description="Text, or a list of input items: messages ({role, content}), function_call and "
        "function_call_output items.")
    instructions: Optional[str] = Field(default=None, description="A system message put before the input.")
    max_output_tokens: Optional[int] = Field(default=None, ge=1, le=INT32_MAX)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    tools: Optional[List[Dict[str, Any]]] = Field(
        default=None, description='Function tools: {"type": "function", "name", "description", "parameters"} '
        '(or the chat completions shape, {"type": "function", "function": {...}}).')
    tool_choice: Optional[Union[Literal["none", "auto", "required"], Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[Dict[str, Any]] = Field(default=None, description='{"format": {"type": "text" | "json_object" | '
                                           '"json_schema", "schema": ...}}')
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[Dict[str, Any]] = None


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise APIError(400, f"{where}.content[{k}]: content parts of type {kind!r} are not supported (only "
                           "input_text and output_text)", param=f"{where}.content", code="unsupported_parameter")
    return "".join(texts)


def _messages(body: CreateResponseRequest) -> List[Dict[str, Any]]:
    """The request's instructions and input as chat messages."""
    messages: List[Dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, not {role!r}",
                               param=f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise APIError(400, f"{where}: a function_call item needs a name and arguments (a JSON string)",
                               param=where)
            call = {"id": item.get("call_id") or new_id("call"), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output)", param="input", code="unsupported_parameter")
    return messages


def _chat_tools(tools: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (only function)",
                           param="tools", code="unsupported_parameter")
        if "function" in tool:  # already the chat completions shape
            out.append(tool)
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt["type"]}  # json_object, or what the chat request refuses


def to_chat(body: CreateResponseRequest):
    """The chat completion request of a Responses request (400 for what it cannot say)."""
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                       "conversation in input", param="previous_response_id", code="unsupported_parameter")
    extra = body.model_extra or {}
    fields: Dict[str, Any] = {
        "model": body.model, "messages": _messages(body), "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
        "tools": _chat_tools(body.tools), "tool_choice": _chat_tool_choice(body.tool_choice),
        "response_format": _response_format(body.text),
        **{name: extra[name] for name in _PASSTHROUGH if name in extra},
    }  # fmt: skip
    names = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
    return chat_request(fields, names)


# ---------------------------------------------------------------------------- the answer


def _message_item(item_id: str, text: str, status: str) -> Dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status != "in_progress" else []}


def _text_part(text: str) -> Dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: Dict[str, str], status: str) -> Dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["name"],
            "arguments": call["arguments"], "status": status}


class _Response:
    """The Response object of one request, as it is built."""

    def __init__(self, body: CreateResponseRequest, chat: Any, model: str):
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.body, self.chat, self.model = body, chat, model

    def object(self, status: str, output: List[Dict[str, Any]], answer: Optional[ChatAnswer] = None,
               counts: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
        """The Response; `counts`: (input tokens, output tokens) once it is done."""
        body, chat = self.body, self.chat
        incomplete = answer is not None and answer.finish_reason == "length"
        usage = None
        if counts is not None:
            n_in, n_out = counts
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": chat.temperature, "top_p": chat.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": body.metadata or {}, "store": False, "usage": usage,
        }  # fmt: skip

    def complete(self, result: Dict[str, Any], llama: Any) -> Dict[str, Any]:
        answer = ChatAnswer.of_result(result)
        output = []
        if answer.text or not answer.tool_calls:
            output.append(_message_item(new_id("msg"), answer.text, "completed"))
        output += [_call_item(new_id("fc"), call, "completed") for call in answer.tool_calls]
        usage = result.get("usage") or {}
        return self.object("completed", output, answer, (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)))


class _ResponseEvents(ChatStreamEvents):
    """A chat stream as the Responses API's events."""

    def __init__(self, llama: Any, response: _Response):
        super().__init__(llama)
        self.response = response
        self.seq = 0
        self.output: List[Dict[str, Any]] = []  # items done
        self.message: Optional[Dict[str, Any]] = None  # the message item being written
        self.calls: List[Dict[str, Any]] = []  # function_call items being written, by call

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(data, kind)

    def _index(self) -> int:
        return len(self.output) + (self.message is not None) + len(self.calls)

    def on_start(self) -> bytes:
        snapshot = self.response.object("in_progress", [])
        return self._event("response.created", response=snapshot) + \
            self._event("response.in_progress", response=snapshot)

    def on_text(self, delta: str) -> bytes:
        out = b""
        if self.message is None:
            index = self._index()
            self.message = {"id": new_id("msg"), "index": index, "text": ""}
            out += self._event("response.output_item.added", output_index=index,
                               item=_message_item(self.message["id"], "", "in_progress"))
            out += self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                               content_index=0, part=_text_part(""))
        self.message["text"] += delta
        return out + self._event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=self.message["index"], content_index=0, delta=delta, logprobs=[])

    def _close_message(self) -> bytes:
        m, self.message = self.message, None
        if m is None:
            return b""
        item = _message_item(m["id"], m["text"], "completed")
        self.output.append(item)
        return (self._event("response.output_text.done", item_id=m["id"], output_index=m["index"], content_index=0,
                            text=m["text"], logprobs=[])
                + self._event("response.content_part.done", item_id=m["id"], output_index=m["index"], content_index=0,
                              part=_text_part(m["text"]))
                + self._event("response.output_item.done", output_index=m["index"], item=item))

    def on_tool_call(self, call: Dict[str, str]) -> bytes:
        out = self._close_message()
        entry = {"id": new_id("fc"), "index": self._index(), "call": call}
        self.calls.append(entry)
        return out + self._event("response.output_item.added", output_index=entry["index"],
                                 item=_call_item(entry["id"], {**call, "arguments": ""}, "in_progress"))

    def on_tool_arguments(self, call: Dict[str, str], delta: str) -> bytes:
        entry = next(e for e in self.calls if e["call"] is call)
        return self._event("response.function_call_arguments.delta", item_id=entry["id"],
                           output_index=entry["index"], delta=delta)

    def on_end(self) -> bytes:
        out = b""
        if self.message is None and not self.output and not self.calls:
            out += self.on_text("")  # nothing generated: one empty message, as a whole response has
        out += self._close_message()
        for entry in self.calls:
            item = _call_item(entry["id"], entry["call"], "completed")
            self.output.append(item)
            out += self._event("response.function_call_arguments.done", item_id=entry["id"],
                               output_index=entry["index"], name=entry["call"]["name"],
                               arguments=entry["call"]["arguments"])
            out += self._event("response.output_item.done", output_index=entry["index"], item=item)
        self.calls = []
        final = self.response.object("completed", self.output, self.answer, usage_of(self.llama))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=final)

    def error(self, error: APIError) -> bytes:
        body = error.body
        failed = self.response.object("failed", self.output)
        failed["error"] = {"code": body["code"] or body["type"], "message": body["message"]}
        return (self._event("error", code=body["code"], message=body["message"], param=body["param"])
                + self._event("response.failed", response=failed))

    def shutdown(self, error: APIError) -> bytes:
        return self.error(error)


async def create_response(request: Request, body: CreateResponseRequest) -> Response:
    chat = to_chat(body)
    kwargs = chat_kwargs(chat)
    response = _Response(body, chat, model_name(request, body.model))
    if chat.stream:
        return await stream_response(request, chat, kwargs, "create_chat_completion",
                                     events=lambda llama: _ResponseEvents(llama, response))
    return await run_model(request, chat, kwargs, "create_chat_completion", convert=response.complete)
