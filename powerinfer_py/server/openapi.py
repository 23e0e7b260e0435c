"""The OpenAPI document (/openapi.json): what the routes really answer, which FastAPI's
defaults do not say."""

from __future__ import annotations

from typing import Any, Dict

from fastapi import FastAPI

from .types import (
    AnthropicErrorResponse,
    AnthropicMessageResponse,
    CreateChatCompletionChunk,
    CreateChatCompletionResponse,
    CreateCompletionResponse,
    CreateEmbeddingResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    PropsResponse,
    ResponseObject,
    SlotActionResponse,
    SlotsResponse,
)

__all__ = ["document_responses"]


# The 200 answer of each route (FastAPI infers only the annotated return types), and the
# event of the routes that stream with stream=true.
_OK_MODELS: Dict[str, type] = {
    "/v1/completions": CreateCompletionResponse,
    "/v1/chat/completions": CreateChatCompletionResponse,
    "/v1/embeddings": CreateEmbeddingResponse,
    "/v1/models": ModelList,
    "/health": HealthResponse,
    "/props": PropsResponse,
    "/v1/responses": ResponseObject,
    "/v1/messages": AnthropicMessageResponse,
    "/slots": SlotsResponse,
    "/slots/{id_slot}": SlotActionResponse,
}
_STREAM_EVENT_MODELS: Dict[str, type] = {
    "/v1/completions": CreateCompletionResponse,
    "/v1/chat/completions": CreateChatCompletionChunk,
}
# Routes whose streams are named events (`event: TYPE`, `data: {"type": TYPE, ...}`), not chunks.
_NAMED_EVENT_ROUTES = ("/v1/responses", "/v1/messages")
# Routes whose errors have another body than OpenAI's.
_ERROR_MODELS: Dict[str, type] = {"/v1/messages": AnthropicErrorResponse}
# Statuses a route answers besides 200, 400 and 401.
_MORE_STATUSES: Dict[str, Dict[str, str]] = {
    "/slots": {"503": "Every slot is busy (?fail_on_no_slot=1)"},
    "/slots/{id_slot}": {"404": "No such slot file (restore)", "501": "The server has no --slot_save_path"},
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


def _named_event_schema() -> Dict[str, Any]:
    """One server-sent event of the Responses or Messages API: its name and a JSON object
    whose "type" is that name (an error included)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}},
            },
        },
    }


def document_responses(app: FastAPI, api_key_required: bool) -> None:
    """Make /openapi.json say what the routes answer, which FastAPI's defaults do not:
    errors are 400 (and 401 for a wrong API key) with OpenAI's error body, never 422; the
    bearer key is required only when the server has one; completions are JSON, or with
    stream=true server-sent events, each described."""
    generate = app.openapi
    models = [ErrorResponse, *_ERROR_MODELS.values(), *_OK_MODELS.values(), *_STREAM_EVENT_MODELS.values()]

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
        for path, operations in schema.get("paths", {}).items():
            error = {"content": {"application/json": {"schema": _ref(_ERROR_MODELS.get(path, ErrorResponse))}}}
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if "requestBody" in operation or operation.get("parameters"):
                    responses["400"] = {"description": "Invalid request", **error}
                for status, description in _MORE_STATUSES.get(path, {}).items():
                    responses[status] = {"description": description, **error}
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
                if path in _NAMED_EVENT_ROUTES:
                    ok["description"] = "The answer; with stream=true, the API's server-sent events"
                    ok["content"]["text/event-stream"] = {"schema": _named_event_schema()}
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        if not api_key_required:
            components.pop("securitySchemes", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
