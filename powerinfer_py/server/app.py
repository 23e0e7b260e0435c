"""The FastAPI app of `powerinfer_py.server`: OpenAI-compatible routes over one Llama.

Routes and request bodies follow `llama_cpp.server` 0.3.36. The server is split by concern,
as llama.cpp's and llama-cpp-python's servers are:
- `errors.py`: OpenAI's error body; which failures are the client's (4xx) and which ours;
- `engine.py`: where model work runs: one request at a time on the model thread under the
  model lock, or with --n_parallel > 1 the slots of a ParallelLlama; `ServerState`;
- `requests.py`: request bodies -> Llama keyword arguments (grammar, logit bias, ...);
- `streaming.py`: the pump that runs a stream off the event loop and the event stream;
- `routes.py`, `metrics.py`, `openapi.py`: the handlers, /metrics, the OpenAPI document;
- `responses_api.py`, `messages_api.py` (over `translate.py`): OpenAI's Responses and
  Anthropic's Messages APIs on the chat completions engine; `slots.py`: GET /slots and slot
  save/restore; `page.py` and `static/`: the chat page at /;
- this file: the app itself (settings, exception handlers, the route table).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, List, Optional, Tuple

try:
    import anyio  # noqa: F401  (engine.py)
    import numpy as np  # noqa: F401  (routes.py)
    import pydantic_settings  # noqa: F401  (settings.py)
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"powerinfer_py.server needs the 'server' extra ({e.name or e} is missing):\n"
        "    pip install 'powerinfer-py[server]'   # fastapi, uvicorn, pydantic-settings"
    ) from e

from .. import __version__
from . import messages_api, page, responses_api, routes, slots
from .engine import ServerState
from .errors import APIError, anthropic_error_response, error_from_exception, error_response, validation_error
from .openapi import document_responses
from .settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings
from .types import HealthResponse

__all__ = ["create_app", "ServerState"]


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
    app.state.powerinfer = state = ServerState(
        server_settings, model_settings, llama=llama, background=load_in_background, on_load_error=on_load_error
    )
    # The slots' batcher stops with the server (its streams end with an error, not a crash).
    app.router.on_shutdown.append(state.close)

    def render(request: Request, error: APIError) -> Response:
        # The Messages API's routes answer errors in Anthropic's shape, the others in OpenAI's.
        if messages_api.is_messages_route(request.url.path):
            return anthropic_error_response(error)
        return error_response(error)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return render(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        error_type = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        response = render(request, APIError(exc.status_code, message, type=error_type))
        # E.g. the Allow header of a 405, which RFC 9110 requires.
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return render(request, error_from_exception(exc))

    openai_v1 = ["OpenAI V1"]
    auth = [Depends(routes.authenticate)]
    app.add_api_route("/v1/completions", routes.create_completion, methods=["POST"], dependencies=auth, tags=openai_v1, summary="Completion")
    app.add_api_route(
        "/v1/engines/copilot-codex/completions",
        routes.create_completion,
        methods=["POST"],
        dependencies=auth,
        include_in_schema=False,
    )
    app.add_api_route("/v1/chat/completions", routes.create_chat_completion, methods=["POST"], dependencies=auth, tags=openai_v1, summary="Chat")
    app.add_api_route("/v1/responses", responses_api.create_response, methods=["POST"], dependencies=auth, tags=openai_v1,
                      summary="Responses")
    app.add_api_route("/v1/messages", messages_api.create_message, methods=["POST"], dependencies=auth,
                      tags=["Anthropic"], summary="Messages")
    app.add_api_route("/v1/embeddings", routes.create_embedding, methods=["POST"], dependencies=auth, tags=openai_v1, summary="Embedding")
    app.add_api_route("/v1/models", routes.get_models, methods=["GET"], dependencies=auth, tags=openai_v1, summary="Models")
    app.add_api_route("/health", routes.health, methods=["GET"], summary="Health", response_model=HealthResponse)
    app.add_api_route("/props", routes.props, methods=["GET"], dependencies=auth, summary="Server properties")
    app.add_api_route("/slots", slots.get_slots, methods=["GET"], dependencies=auth, summary="Slots")
    app.add_api_route("/slots/{id_slot}", slots.slot_action, methods=["POST"], dependencies=auth,
                      summary="Save, restore or erase a slot's prompt cache")
    # The chat page (static files of the package; the page calls the routes above).
    app.add_api_route("/", page.index, methods=["GET"], include_in_schema=False)
    app.mount("/static", page.static_files(), name="static")
    # Prometheus text, not JSON: outside the OpenAPI document.
    app.add_api_route("/metrics", routes.metrics, methods=["GET"], dependencies=auth, include_in_schema=False)
    extras = ["Extras"]
    app.add_api_route("/extras/tokenize", routes.tokenize, methods=["POST"], dependencies=auth, tags=extras, summary="Tokenize")
    app.add_api_route(
        "/extras/tokenize/count", routes.count_query_tokens, methods=["POST"], dependencies=auth, tags=extras, summary="Tokenize Count"
    )
    app.add_api_route("/extras/detokenize", routes.detokenize, methods=["POST"], dependencies=auth, tags=extras, summary="Detokenize")
    document_responses(app, server_settings.api_key is not None)
    return app

