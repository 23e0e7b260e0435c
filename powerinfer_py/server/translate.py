"""Chat completions under other APIs' shapes: what OpenAI's Responses API (responses_api.py) and
Anthropic's Messages API (messages_api.py) read of a chat completion, whole or chunk by chunk:
its text, its tool calls, why it finished and its token counts.

Both APIs run on the chat completions engine unchanged (the same slots, streams, cancellation
and errors): their requests become a CreateChatCompletionRequest, and its answer is read here.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Tuple

from pydantic import ValidationError

from .errors import APIError
from .streaming import ChunkEvents
from .types import CreateChatCompletionRequest

__all__ = ["ChatAnswer", "ChatStreamEvents", "chat_request", "model_name", "new_id", "stop_sequence_of", "usage_of"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def model_name(request: Any, requested: Optional[str]) -> str:
    """The model an answer names: the request's, else the served model's alias (or path)."""
    settings = request.app.state.powerinfer.model_settings[0]
    return requested or settings.model_alias or settings.model


def chat_request(fields: Dict[str, Any], param_names: Dict[str, str]) -> CreateChatCompletionRequest:
    """The chat completion request of another API's request; a field the chat request refuses
    is a 400 naming the other API's field (`param_names`: chat field -> the API's name)."""
    try:
        return CreateChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        name = param_names.get(loc[0], loc[0]) if loc else None
        where = ".".join([name, *loc[1:]]) if name else ""
        raise APIError(400, f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid"),
                       param=name, code="invalid_value") from None


def usage_of(llama: Any) -> Tuple[int, int]:
    """(prompt tokens, completion tokens) of the generation that runs or ran last on `llama`
    (0, 0 on an engine that does not record them)."""
    finish = getattr(llama, "_last_finish", None) or {}
    return int(finish.get("prompt_tokens", 0)), int(finish.get("completion_tokens", 0))


def stop_sequence_of(llama: Any) -> Optional[str]:
    """The stop string that ended the last generation on `llama`, if one did."""
    return (getattr(llama, "_last_finish", None) or {}).get("stop_sequence")


class ChatAnswer:
    """A chat completion's answer: its text, its tool calls ({"id", "name", "arguments"}, the
    arguments a JSON string) and its finish reason ("stop", "length", "tool_calls")."""

    def __init__(self) -> None:
        self.text = ""
        self.tool_calls: List[Dict[str, str]] = []
        self.finish_reason: Optional[str] = None

    @classmethod
    def of_result(cls, result: Dict[str, Any]) -> "ChatAnswer":
        answer = cls()
        choice = (result.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        answer.text = message.get("content") or ""
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            answer.tool_calls.append({"id": call.get("id") or new_id("call"), "name": function.get("name") or "",
                                      "arguments": function.get("arguments") or ""})
        answer.finish_reason = choice.get("finish_reason")
        return answer


class ChatStreamEvents(ChunkEvents):
    """A stream of chat chunks followed delta by delta into a ChatAnswer (`answer`), for APIs
    that send events of their own: a subclass writes them in its hooks, each returning the
    bytes of its events. `llama` is the Llama the generation runs on (its token counts)."""

    def __init__(self, llama: Any):
        self.llama = llama
        self.answer = ChatAnswer()
        self.started = False
        self._tool_rows: Dict[int, int] = {}  # a chunk's tool call index -> answer.tool_calls row

    # ---- the hooks -----------------------------------------------------------------------

    def on_start(self) -> bytes:
        """Before anything else (the first chunk, or the end of a stream with none)."""
        return b""

    def on_text(self, delta: str) -> bytes:
        return b""

    def on_tool_call(self, call: Dict[str, str]) -> bytes:
        """A new tool call (its id and name; arguments follow in on_tool_arguments)."""
        return b""

    def on_tool_arguments(self, call: Dict[str, str], delta: str) -> bytes:
        return b""

    def on_end(self) -> bytes:
        """After the last chunk: `answer` is complete."""
        return b""

    # ---- ChunkEvents ----------------------------------------------------------------------

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return self.on_start()

    def chunk(self, chunk: Any) -> bytes:
        out = [self._start()]
        choice = (chunk.get("choices") or [{}])[0]
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            self.answer.text += content
            out.append(self.on_text(content))
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function") or {}
            index = piece.get("index", 0)
            row = self._tool_rows.get(index)
            if row is None:
                row = self._tool_rows[index] = len(self.answer.tool_calls)
                call = {"id": piece.get("id") or new_id("call"), "name": function.get("name") or "", "arguments": ""}
                self.answer.tool_calls.append(call)
                out.append(self.on_tool_call(call))
            call = self.answer.tool_calls[row]
            arguments = function.get("arguments")
            if arguments:
                call["arguments"] += arguments
                out.append(self.on_tool_arguments(call, arguments))
        if choice.get("finish_reason"):
            self.answer.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def end(self) -> bytes:
        return self._start() + self.on_end()

    def interrupted(self) -> bytes:
        return self.end()
