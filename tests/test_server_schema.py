"""Schemathesis against the server's own OpenAPI schema: `python -m powerinfer_py.server` on
SmolLM2-135M in a child process on 127.0.0.1, every operation of its /openapi.json fed
generated requests (schemathesis' examples, coverage and fuzzing phases: valid bodies,
boundary values and invalid ones).

Each response must:
  - not be a 5xx (not_a_server_error);
  - have a status, content type, headers and body the schema documents (400s included);
  - be strict JSON (no NaN/Infinity, which json.dumps writes and many clients reject);
  - for stream=true, be server-sent events that each follow the schema's event schema,
    end with [DONE] and carry no internal error (a 5xx after the 200 was sent).
Afterwards the process must still run and answer a normal completion.

Streaming: the completion and chat schemas document text/event-stream for 200, and the
generated bodies include stream=true, so generated streams are validated event by event;
test_streams_conform sends one valid stream per route so that this holds every run.

Cost bound: SmolLM2 decodes some 5-30 tokens/s on 2 shared cores, and the schema allows
max_tokens up to 2**31-1, where 0 or null (the chat default) mean "until the context is
full": uncapped, one request takes a minute. What is tested (status codes, shapes, the
process surviving) does not depend on how many tokens are generated, so _cap_generation
lowers generated max_tokens / max_completion_tokens above MAX_NEW_TOKENS, and 0/null/
absent, to MAX_NEW_TOKENS before sending; invalid values (negative, strings) are left as
generated so that the rejection paths stay tested. The server's context is 256 tokens.

SCHEMA_MAX_EXAMPLES (default 10) sets hypothesis' max_examples per operation in the fuzzing
phase, SCHEMA_SEED schemathesis' seed (default: random); scripts/schema_server.sh runs a
longer campaign with more examples and prints the summary written to SCHEMA_SUMMARY_JSON.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any, Dict, List

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed")
pytest.importorskip("fastapi", reason="the server extra is not installed")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import ServerProcess  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("SCHEMA_MAX_EXAMPLES", "10"))
MAX_NEW_TOKENS = 2
N_CTX = 256
# Far above what a capped request needs (well under 10 s): hitting it means a hang.
REQUEST_TIMEOUT = float(os.environ.get("SCHEMA_REQUEST_TIMEOUT", "60"))
GENERATING = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
# The streams of these routes are named events ending in one of these types, not [DONE].
NAMED_EVENT_ENDS = {
    "/v1/responses": {"response.completed", "response.incomplete", "response.failed"},
    "/v1/messages": {"message_stop", "error"},
}

# What the run sent and got, for the summary (and the checks of the last test).
STATS: Dict[str, Any] = {
    "requests": 0,
    "by_status": collections.Counter(),
    "by_operation": collections.Counter(),
    "streams": 0,
    "stream_events": 0,
    "seconds_in_requests": 0.0,
    "slowest_request_s": 0.0,
}


# ---------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    # One thread: on 2 cores shared with other jobs, two threads that wait on each other
    # at every layer run many times slower than one.
    args = ("--n_ctx", str(N_CTX), "--n_batch", str(N_CTX), "--embedding", "true", "--vram-budget", "0")
    # The slot actions run for real (files in a folder of the test's own).
    args += ("--slot-save-path", str(tmp_path_factory.mktemp("schema-slots")))
    args += ("--n_threads", "1", "--n_threads_batch", "1")
    with ServerProcess(smollm2_path, *args) as proc:  # it reads the server's output into proc.log
        started = time.monotonic()
        yield proc
        STATS["duration_s"] = round(time.monotonic() - started, 1)
        _write_summary(proc)


def _openapi_document() -> Dict[str, Any]:
    """The /openapi.json that `python -m powerinfer_py.server` (no API key) serves, built by
    the same app without a model: the generated tests are made at collection, before any
    server runs (schemathesis.pytest.from_fixture, which would load it from the running
    server, fails under pytest 9: it sets Function._nodeid). test_served_schema_is_the_tested_one
    checks that the running server serves exactly this document."""
    from powerinfer_py.server.app import create_app
    from powerinfer_py.server.settings import ModelSettings, ServerSettings

    app = create_app(
        server_settings=ServerSettings(),
        model_settings=[ModelSettings(model="schema-only.gguf", model_alias="smollm2")],
        llama=object(),  # never called: only the routes are needed
    )
    return app.openapi()


OPENAPI = _openapi_document()
schema = schemathesis.openapi.from_dict(json.loads(json.dumps(OPENAPI)))
if os.environ.get("SCHEMA_SEED"):  # default: a random seed per run, in the summary
    schema.config.seed = int(os.environ["SCHEMA_SEED"])


@pytest.fixture(scope="module")
def api_schema():
    return schema


def test_served_schema_is_the_tested_one(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/openapi.json").json() == json.loads(json.dumps(OPENAPI))


# ---------------------------------------------------------------------------- checks


def _header(response, name: str) -> str:
    for key, values in response.headers.items():
        if key.lower() == name:
            return values[0] if isinstance(values, list) else values
    return ""


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _strict_loads(text: Any) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise AssertionError(f"not strict JSON ({exc}): {text[:300]!r}") from None


def _sse_data(text: str) -> List[str]:
    return [line[len("data:") :].lstrip(" ") for line in text.splitlines() if line.startswith("data:")]


def strict_json(ctx, response, case) -> None:
    """JSON bodies and event payloads parse without NaN/Infinity."""
    content_type = _header(response, "content-type")
    if content_type.startswith("application/json"):
        _strict_loads(response.content)
    elif content_type.startswith("text/event-stream"):
        for data in _sse_data(response.content.decode("utf-8")):
            if data != "[DONE]":
                _strict_loads(data)


def stream_completes(ctx, response, case) -> None:
    """A stream ends with [DONE] (the Responses and Messages APIs: their last event), and no
    event reports an internal error."""
    if not _header(response, "content-type").startswith("text/event-stream"):
        return
    data = _sse_data(response.content.decode("utf-8"))
    STATS["streams"] += 1
    STATS["stream_events"] += len(data)
    ends = NAMED_EVENT_ENDS.get(case.operation.path)
    if ends is not None:
        events = [_strict_loads(payload) for payload in data]
        for event in events:
            assert event.get("type") != "error" or event.get("error", {}).get("type") != "api_error", event
            assert event.get("type") != "response.failed", event
        assert events and events[-1].get("type") in ends, f"the stream does not end with {ends}: {events[-2:]}"
        return
    for payload in data:
        if payload != "[DONE]":
            error = _strict_loads(payload).get("error")
            assert error is None or error.get("type") != "internal_server_error", f"error in the stream: {error}"
    assert data and data[-1] == "[DONE]", f"the stream does not end with [DONE]: {data[-3:]}"


def error_has_message(ctx, response, case) -> None:
    """Every error answer names what is wrong (OpenAI's shape)."""
    if response.status_code >= 400:
        error = _strict_loads(response.content)["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), error


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
EXTRA_CHECKS = [strict_json, stream_completes, error_has_message]


# ---------------------------------------------------------------------------- requests


def _cap_generation(case) -> None:
    """Keep generation requests cheap (see the module docstring): valid max_tokens and
    max_completion_tokens above MAX_NEW_TOKENS, or meaning "until the context is full"
    (0, null, absent), become MAX_NEW_TOKENS."""
    if case.operation.path not in GENERATING or not isinstance(case.body, dict):
        return
    body = case.body
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        # pydantic's lax mode takes 5000.0 and "5000" for 5000 too.
        value = _as_int(body.get(key))
        if value is not None and value > MAX_NEW_TOKENS:
            body[key] = MAX_NEW_TOKENS
    if case.operation.path == "/v1/messages":
        return  # max_tokens is required there: one left out stays out (a 400 to test)
    key = "max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"
    if body.get(key) is None or _as_int(body[key]) == 0:
        body[key] = MAX_NEW_TOKENS


def _as_int(value: Any) -> Any:
    """The int the server reads `value` as (None if it reads none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def _send(case, server) -> Any:
    started = time.monotonic()
    response = case.call(base_url=server.url, timeout=REQUEST_TIMEOUT)
    elapsed = time.monotonic() - started
    STATS["requests"] += 1
    STATS["by_status"][str(response.status_code)] += 1
    STATS["by_operation"][f"{case.operation.method.upper()} {case.operation.path}"] += 1
    STATS["seconds_in_requests"] += elapsed
    STATS["slowest_request_s"] = max(STATS["slowest_request_s"], round(elapsed, 2))
    return response


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_api_conforms_to_its_schema(case, server):
    _cap_generation(case)
    response = _send(case, server)
    case.validate_response(response, checks=CHECKS, additional_checks=EXTRA_CHECKS)


STREAMS = {
    "/v1/completions": {"prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0, "stream": True, "logprobs": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Count to three."}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
    },
    "/v1/responses": {"input": "Count to three.", "max_output_tokens": 3, "temperature": 0, "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 3, "temperature": 0,
                     "stream": True, "model": "smollm2"},
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_streams_conform(api_schema, server, path):
    """One valid stream per streaming route, validated event by event against the schema."""
    case = api_schema[path]["POST"].Case(body=STREAMS[path], media_type="application/json")
    response = _send(case, server)
    assert response.status_code == 200, response.content[:500]
    assert _header(response, "content-type").startswith("text/event-stream")
    case.validate_response(response, checks=CHECKS, additional_checks=EXTRA_CHECKS)


def test_server_alive_and_serving_afterwards(server):
    """After everything above: the process runs, is idle, and serves a normal completion."""
    assert server.proc.poll() is None, "the server exited:\n" + "".join(server.log[-50:])
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(120.0, connect=10.0)) as c:
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["requests_waiting"] == 0, health
        r = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
    assert STATS["requests"] > 0
    assert not any(s.startswith("5") for s in STATS["by_status"]), dict(STATS["by_status"])
    assert "Traceback" not in "".join(server.log), "".join(server.log)[-5000:]


def _write_summary(server) -> None:
    summary = {
        "requests": STATS["requests"],
        "by_status": dict(sorted(STATS["by_status"].items())),
        "responses_5xx": sum(n for s, n in STATS["by_status"].items() if s.startswith("5")),
        "by_operation": dict(sorted(STATS["by_operation"].items())),
        "streams": STATS["streams"],
        "stream_events": STATS["stream_events"],
        "duration_s": STATS.get("duration_s"),
        "seconds_in_requests": round(STATS["seconds_in_requests"], 1),
        "slowest_request_s": STATS["slowest_request_s"],
        "max_examples_per_operation": MAX_EXAMPLES,
        "seed": schema.config.seed,
        "server_alive_at_end": server.proc.poll() is None,
        "server_tracebacks": "".join(server.log).count("Traceback"),
    }
    path = os.environ.get("SCHEMA_SUMMARY_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
