"""The server's errors: OpenAI's error body, which exceptions are the client's fault (4xx)
and which are ours (500, logged with their traceback), and the JSON encoding every response
uses."""

from __future__ import annotations

import json
import re
import sys
import traceback
from typing import Any, Dict, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from .._core import PowerInferError
from .types import CreateChatCompletionRequest

__all__ = ["APIError", "dumps", "json_response", "error_response", "error_from_exception", "validation_error",
           "anthropic_error_body", "anthropic_error_response"]

# PowerInferError statuses that mean the request, not the server, is at fault (a grammar no
# token can satisfy is INVALID_ARG).
_CLIENT_ERROR_STATUSES = {
    "POWERINFER_ERR_UNSUPPORTED",
    "POWERINFER_ERR_INVALID_ARG",
    "POWERINFER_ERR_CONTEXT_FULL",
}


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


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(dumps(content), status_code=status_code, media_type="application/json")


def error_response(error: APIError) -> Response:
    return json_response({"error": error.body}, error.status_code)


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status_code: int, message: str) -> Dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(error: APIError) -> Response:
    """An error of the Anthropic Messages API's routes, in its shape (same status)."""
    return json_response(anthropic_error_body(error.status_code, error.body["message"]), error.status_code)


def context_length_error(
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


def error_from_exception(exc: BaseException, body: Any = None) -> APIError:
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
        return context_length_error(
            int(match.group(1)),
            int(match.group(2)),
            getattr(body, "max_tokens", None),
            isinstance(body, CreateChatCompletionRequest),
        )
    if isinstance(exc, PowerInferError):
        if exc.status_name in _CLIENT_ERROR_STATUSES:
            return APIError(400, text)
        if exc.status_name == "POWERINFER_ERR_IO":
            # An RPC worker went away mid-generation: the server loads the model again on the
            # next request (ModelProxy); this one is lost.
            print(f"powerinfer_py.server: {text}", file=sys.stderr)
            return APIError(503, text, type="unavailable_error", code="backend_unavailable")
    elif isinstance(exc, NotImplementedError):
        return APIError(400, text, code="unsupported_parameter")
    elif isinstance(exc, ValueError):
        return APIError(400, text)
    # Anything else is our fault: log it with its traceback, answer 500, keep serving.
    print(f"Exception: {text}", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return APIError(500, text, type="internal_server_error")


def validation_error(exc: RequestValidationError) -> APIError:
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


