"""The OpenAI-compatible server (powerinfer_py.server) on SmolLM2: routes, SSE streaming,
errors, request isolation, client disconnects, the official openai client and the CLI.

In-process tests use Starlette's TestClient; the concurrency, disconnect and openai tests
need real sockets and run against uvicorn in a thread; one test starts
`python -m powerinfer_py.server` as a subprocess. Every request is greedy (temperature 0).
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed")
pytest.importorskip("fastapi", reason="the server extra is not installed")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from powerinfer_py.server.__main__ import add_args_from_model, main as server_main  # noqa: E402
from powerinfer_py.server.app import create_app  # noqa: E402
from powerinfer_py.server.settings import ModelSettings, ServerSettings, Settings  # noqa: E402

from conftest import N_CTX, N_THREADS, ServerProcess, free_port  # noqa: E402

GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}
ERROR_KEYS = {"message", "type", "param", "code"}
TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def _settings(model_path: str, **overrides: Any) -> Settings:
    values: Dict[str, Any] = dict(
        model=model_path,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        embedding=True,
        verbose=False,
    )
    values.update(overrides)
    return Settings(**values)


def _sse_data(text: str) -> List[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def app(smollm2_path):
    return create_app(_settings(smollm2_path))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def llama(app):
    """The server's own Llama, called directly (only between requests) as the reference."""
    return app.state.powerinfer.proxy.current


@pytest.fixture(scope="module")
def live(smollm2_path):
    """A uvicorn server in a thread on a free loopback port (its own app and model)."""
    import uvicorn

    # Mean pooling: one embedding per input, as OpenAI clients expect.
    app = create_app(_settings(smollm2_path, pooling_type=1))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during start-up"
        assert time.monotonic() < deadline, "uvicorn did not start within 60 s"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", app=app, state=app.state.powerinfer)
    server.should_exit = True
    thread.join(timeout=30)


def _stream_text(response_text: str, chat: bool) -> str:
    data = _sse_data(response_text)
    assert data and data[-1] == "[DONE]"
    out = []
    for payload in data[:-1]:
        chunk = json.loads(payload)
        choice = chunk["choices"][0]
        out.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(out)


# ---------------------------------------------------------------------------- routes


def test_health_and_models(client, smollm2_path):
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert health.json()["engine"] == "powerinfer"

    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [smollm2_path]
    assert models["data"][0]["object"] == "model"


def test_completion_matches_llama(client, llama):
    prompt = "The capital of France is"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] <= 8
    expected = llama.create_completion(prompt, max_tokens=8, **GREEDY)
    assert body["choices"][0]["text"] == expected["choices"][0]["text"]
    assert body["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"]


def test_completion_stream_same_text_and_chunk_shape(client, llama):
    prompt = "1, 2, 3, 4,"
    request = {"prompt": prompt, "max_tokens": 8, **GREEDY}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    r = client.post("/v1/completions", json={**request, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert _stream_text(r.text, chat=False) == whole

    # Each SSE chunk is exactly what Llama.create_completion(stream=True) yields.
    served = [json.loads(d) for d in _sse_data(r.text)[:-1]]
    direct = list(llama.create_completion(prompt, max_tokens=8, stream=True, **GREEDY))
    assert len(served) == len(direct)
    for a, b in zip(served, direct):
        assert set(a) == set(b)
        assert {k: type(v) for k, v in a["choices"][0].items()} == {
            k: type(v) for k, v in b["choices"][0].items()
        }
        assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_chat_completion_and_stream(client, llama):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    request = {"messages": messages, "max_tokens": 10, **GREEDY}
    r = client.post("/v1/chat/completions", json=request)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    expected = llama.create_chat_completion(messages=messages, max_tokens=10, **GREEDY)
    assert message["content"] == expected["choices"][0]["message"]["content"]

    r = client.post("/v1/chat/completions", json={**request, "stream": True})
    assert r.status_code == 200
    chunks = [json.loads(d) for d in _sse_data(r.text)[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert _stream_text(r.text, chat=True) == message["content"]


def test_chat_json_schema_response_format(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Give a city and its population as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
            "max_tokens": 48,
            **GREEDY,
        },
    )
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["choices"][0]["message"]["content"])
    assert isinstance(value["city"], str) and isinstance(value["population"], int)


def test_completion_grammar_min_tokens_and_logit_bias(client, llama):
    r = client.post(
        "/v1/completions",
        json={"prompt": "Is the sky blue? Answer:", "grammar": 'root ::= " yes" | " no"', "max_tokens": 4, **GREEDY},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in (" yes", " no")

    # A strong negative bias on the greedy first token changes it ("tokens": by text).
    prompt = "1, 2, 3,"
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **GREEDY}).json()
    first_text = first["choices"][0]["text"]
    biased = client.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 1,
            "logit_bias": {first_text: -100.0},
            "logit_bias_type": "tokens",
            **GREEDY,
        },
    )
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["text"] != first_text

    # min_tokens forbids the end of generation until that many tokens exist.
    chat = {"messages": [{"role": "user", "content": "Reply with one word: is water wet?"}], "max_tokens": 24, **GREEDY}
    short = client.post("/v1/chat/completions", json=chat).json()
    assert short["choices"][0]["finish_reason"] == "stop"  # ends on its own, early
    n = short["usage"]["completion_tokens"] + 4
    longer = client.post("/v1/chat/completions", json={**chat, "min_tokens": n}).json()
    assert longer["usage"]["completion_tokens"] >= n


def test_embeddings_float_and_base64(client, llama):
    r = client.post("/v1/embeddings", json={"input": ["hello world", "goodbye"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1]
    floats = [np.asarray(d["embedding"], dtype=np.float32) for d in body["data"]]
    assert all(f.shape[-1] == llama.n_embd() for f in floats)

    r = client.post("/v1/embeddings", json={"input": ["hello world", "goodbye"], "encoding_format": "base64"})
    assert r.status_code == 200
    for item, expected in zip(r.json()["data"], floats):
        encoded = item["embedding"]
        if isinstance(encoded, list):  # one vector per token
            decoded = np.stack([np.frombuffer(base64.b64decode(e), dtype="<f4") for e in encoded])
        else:
            decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
        np.testing.assert_array_equal(decoded, expected)


def test_tokenize_extras(client, llama):
    tokens = client.post("/extras/tokenize", json={"input": "Hello world"}).json()["tokens"]
    assert tokens == llama.tokenize(b"Hello world", special=True)
    assert client.post("/extras/tokenize/count", json={"input": "Hello world"}).json()["count"] == len(tokens)
    assert client.post("/extras/detokenize", json={"tokens": tokens}).json()["text"].strip() == "Hello world"


# ---------------------------------------------------------------------------- errors


BAD_REQUESTS = {
    "malformed json": ("/v1/completions", b'{"prompt": "hi", '),
    "top_p above 1": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}),
    "negative max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    "temperature not a number": ("/v1/completions", {"prompt": "hi", "temperature": "hot"}),
    "n above 1": ("/v1/completions", {"prompt": "hi", "n": 3}),
    "two prompts": ("/v1/completions", {"prompt": ["a", "b"]}),
    "logit_bias key not a token id": ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1.0}}),
    "bad grammar": ("/v1/completions", {"prompt": "hi", "grammar": "root ::= (", "max_tokens": 2}),
    "prompt over n_ctx": ("/v1/completions", {"prompt": "hello " * (N_CTX + 50), "max_tokens": 4}),
    "message without role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),
    "messages not a list": ("/v1/chat/completions", {"messages": "hi"}),
    "bad response_format type": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
    ),
    "embedding without input": ("/v1/embeddings", {}),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_requests_get_openai_errors(client, case):
    path, payload = BAD_REQUESTS[case]
    if isinstance(payload, bytes):
        r = client.post(path, content=payload, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=payload)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == "invalid_request_error"
    assert error["message"]


def test_bad_stream_request_gets_error_before_streaming(client):
    r = client.post("/v1/completions", json={"prompt": "hello " * (N_CTX + 50), "max_tokens": 4, "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_route_and_server_still_healthy(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert set(r.json()["error"]) == ERROR_KEYS
    # After every bad request above, the model still serves.
    assert client.get("/health").json()["status"] == "ok"
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **GREEDY})
    assert r.status_code == 200


def test_api_key(app, smollm2_path):
    keyed = create_app(
        server_settings=ServerSettings(api_key="sesame"),
        model_settings=[ModelSettings(model=smollm2_path, verbose=False)],
        llama=app.state.powerinfer.proxy.current,
    )
    with TestClient(keyed) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert c.get("/health").status_code == 200  # health needs no key


# ---------------------------------------------------------------------------- isolation


def test_interleaved_requests_do_not_leak(live):
    """Different prompts (two sharing a prefix, so the KV cache is partly reused) give the
    same outputs when their requests interleave as when each runs alone."""
    prompts = [
        "The capital of France is",
        "The capital of Germany is",
        "1, 2, 3, 4,",
        "Once upon a time, there was a",
    ]

    def complete(prompt: str, stream: bool) -> str:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "stream": stream, **GREEDY})
            assert r.status_code == 200, r.text
            return _stream_text(r.text, chat=False) if stream else r.json()["choices"][0]["text"]

    alone = {p: complete(p, stream=False) for p in prompts}
    assert len(set(alone.values())) > 1
    jobs = [(p, stream) for stream in (True, False) for p in prompts] * 2
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(*job), jobs))
    for (prompt, _), text in zip(jobs, results):
        assert text == alone[prompt], prompt


def test_all_model_work_runs_on_the_model_thread(live):
    """Every decode of a one-slot server (streamed and whole completions, embeddings) runs
    on its one model thread. With a thread per stream or request libgomp keeps an OpenMP
    pool per thread, and past one pool per CPU its barriers sleep (docs/parallel.md)."""
    ctx = live.state.proxy.current._ctx
    threads = set()
    original = ctx.decode

    def decode(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return original(*args, **kwargs)

    ctx.decode = decode
    try:
        def request(kind: str) -> None:
            with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
                if kind == "embedding":
                    r = c.post("/v1/embeddings", json={"input": "a river of stones"})
                else:
                    r = c.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 4,
                                                        "stream": kind == "stream", **GREEDY})
                assert r.status_code == 200, r.text

        with ThreadPoolExecutor(max_workers=6) as pool:
            list(pool.map(request, ["stream", "whole", "embedding"] * 2))
    finally:
        del ctx.decode
    assert threads == {"powerinfer-model"}


def test_sixteen_concurrent_streaming_chats_with_openai_client(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    questions = [f"What is {i} plus {i}?" for i in range(16)]

    def ask(question: str, stream: bool) -> str:
        kwargs = dict(
            model="smollm2",
            messages=[{"role": "user", "content": question}],
            max_tokens=6,
            temperature=0,
            extra_body={"repeat_penalty": 1.0},
        )
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        pieces = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        return "".join(pieces)

    alone = {q: ask(q, stream=False) for q in questions}
    with ThreadPoolExecutor(max_workers=16) as pool:
        streamed = list(pool.map(lambda q: ask(q, stream=True), questions))
    assert streamed == [alone[q] for q in questions]
    assert len(set(streamed)) > 1  # separate outputs, not one answer repeated


def test_openai_client_completions_and_embeddings(live, llama):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    completion = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert completion.choices[0].text
    assert completion.usage.completion_tokens <= 4

    # The client asks for base64 by default and decodes it; floats when asked.
    default = client.embeddings.create(model="smollm2", input=["hello", "world"])
    floats = client.embeddings.create(model="smollm2", input=["hello", "world"], encoding_format="float")
    assert len(default.data) == len(floats.data) == 2
    for a, b in zip(default.data, floats.data):
        assert len(a.embedding) == llama.n_embd()
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-6)
    assert not np.allclose(floats.data[0].embedding, floats.data[1].embedding)

    models = client.models.list()
    assert len(models.data) == 1

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=4, top_p=2.0)


# ---------------------------------------------------------------------------- disconnect


def test_disconnect_mid_stream_stops_generation(live):
    max_tokens = 400
    state = live.state
    before = dict(state.stats)
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        # Counting never reaches an end-of-text token on its own within max_tokens.
        request = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": max_tokens, "stream": True, **GREEDY}
        with c.stream("POST", "/v1/completions", json=request) as r:
            assert r.status_code == 200
            received = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received += 1
                    if received == 2:
                        break
        # Leaving the block closed the connection mid-stream.

        deadline = time.monotonic() + 120
        while state.stats["streams_disconnected"] == before["streams_disconnected"]:
            assert time.monotonic() < deadline, f"the stream did not stop: {state.stats}"
            time.sleep(0.05)
        assert state.last_stream["outcome"] == "disconnected"
        assert state.last_stream["chunks"] < max_tokens // 4

        # The model lock was released: the next request is served, and health is ok.
        assert c.get("/health").json() == {"status": "ok", "engine": "powerinfer", "requests_waiting": 0}
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **GREEDY})
        assert r.status_code == 200
        assert state.stats["streams_completed"] >= before["streams_completed"]


def test_interrupt_requests_ends_the_running_stream(live):
    """With --interrupt_requests true (llama_cpp.server's default, not ours), a queued
    request cuts the running stream short: it ends with [DONE], and the queued one runs."""
    max_tokens = 400
    state = live.state
    before = state.stats["streams_interrupted"]
    state.settings.interrupt_requests = True
    try:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            request = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": max_tokens, "stream": True, **GREEDY}
            with c.stream("POST", "/v1/completions", json=request) as r, ThreadPoolExecutor(1) as pool:
                lines = r.iter_lines()
                data: List[str] = []
                for line in lines:
                    if line.startswith("data: "):
                        data.append(line)
                        break
                queued = pool.submit(
                    lambda: c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **GREEDY})
                )
                data += [line for line in lines if line.startswith("data: ")]
                assert queued.result().status_code == 200
        assert data[-1] == "data: [DONE]"
        assert len(data) - 1 < max_tokens
        assert state.stats["streams_interrupted"] == before + 1
    finally:
        state.settings.interrupt_requests = False


# ---------------------------------------------------------------------------- CLI


def test_cli_flags_follow_llama_cpp_server(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_args_from_model(parser, Settings)
    args = parser.parse_args(
        [
            "--model", "m.gguf",
            "--n_ctx", "256",
            "--n-threads", "3",
            "--embedding", "true",
            "--vram-budget", "1.5",
            "--sparse_mode", "dense",
            "--kv_overrides", "a=int:1", "b=bool:true",
            "--chat_template_kwargs", '{"enable_thinking": false}',
            "--interrupt_requests", "yes",
        ]
    )  # fmt: skip
    assert args.n_ctx == 256 and args.n_threads == 3 and args.embedding is True
    assert args.vram_budget == 1.5 and args.sparse_mode == "dense"
    assert args.kv_overrides == ["a=int:1", "b=bool:true"]
    assert args.chat_template_kwargs == {"enable_thinking": False}
    assert args.interrupt_requests is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m.gguf", "--embedding", "maybe"])


def test_cli_names_the_missing_extra():
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from powerinfer_py.server.__main__ import main\n"
        "sys.exit(main(['--model', 'm.gguf']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "pip install 'powerinfer-py[server]'" in proc.stderr


def test_cli_reports_a_missing_model(tmp_path, capsys):
    assert server_main(["--model", str(tmp_path / "missing.gguf"), "--verbose", "false"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_config_file(tmp_path, smollm2_path):
    from powerinfer_py.server.app import _settings_from_config_file

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"port": 9, "models": [{"model": smollm2_path, "model_alias": "smol", "n_ctx": 256}]})
    )
    server_settings, model_settings = _settings_from_config_file(str(config))
    assert server_settings.port == 9
    assert model_settings[0].model_alias == "smol" and model_settings[0].n_ctx == 256


def test_python_m_server_subprocess(smollm2_path):
    with ServerProcess(smollm2_path, "--n_ctx", str(N_CTX), "--vram-budget", "0") as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "smollm2"
            r = c.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 4, **GREEDY})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"]


# ---------------------------------------------------------------------------- schema run
# Defects found by tests/test_server_schema.py (schemathesis on /openapi.json); each of
# these answered 500 (or misbehaved as described) before its fix.


SCHEMA_RUN_BAD_REQUESTS = {
    # Python ints beyond the C int32 the core takes: OverflowError.
    "top_k beyond int32": ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": 10**23}),
    "token id beyond int32": ("/extras/detokenize", {"tokens": [10**23]}),
    # Token ids outside the vocabulary: a RuntimeError of Llama.detokenize.
    "token id past the vocabulary": ("/extras/detokenize", {"tokens": [99_999_999]}),
    "negative token id": ("/extras/detokenize", {"tokens": [-5]}),
    # Schemas the JSON-schema-to-grammar converter fails on: AttributeError.
    "json_schema schema not an object": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
    ),
    "json_schema properties not an object": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": 5}}}},
    ),
    # Tools and functions without the keys the chat handler reads: KeyError.
    "tool without function": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "tools": [{"a": 1}], "tool_choice": {"x": 1}},
    ),
    "function without name": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "functions": [{}], "function_call": {"name": "x"}},
    ),
    # Token-id prompts are the server's addition; Llama's echo concatenated them to text.
    "echo of a token-id prompt": ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "echo": True}),
    # Not a 500 but a hang: the whole vocabulary's logprobs at every position, computed after
    # the generation, past a client's timeout (the long schema run's 60 s read timeout).
    "logprobs past 20": ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 49152}),
    "top_logprobs past 20": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 49152},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SCHEMA_RUN_BAD_REQUESTS), ids=list(SCHEMA_RUN_BAD_REQUESTS))
def test_schema_run_bad_requests_get_400(client, case):
    path, payload = SCHEMA_RUN_BAD_REQUESTS[case]
    r = client.post(path, json=payload)
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(
    "messages",
    [[{"role": "tool", "content": None}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]],
    ids=["null content", "content parts"],
)
def test_messages_the_chat_template_cannot_format_get_400(client, messages):
    # SmolLM2's template concatenates content as a string: TypeError inside the template.
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "chat_template_error" and error["param"] == "messages"
    assert "chat template" in error["message"]


def test_tool_choice_of_a_tool_without_parameters(client):
    # OpenAI makes `parameters` optional; the handler read it unconditionally (KeyError).
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Call it."}],
            "tools": [{"type": "function", "function": {"name": "ping"}}],
            "tool_choice": {"type": "function", "function": {"name": "ping"}},
            "max_tokens": 4,
            **GREEDY,
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_of_an_empty_prompt_with_logprobs(client, stream):
    # Llama's echo path indexed an empty list (IndexError: a 500, or an error event mid-stream).
    r = client.post("/v1/completions", json={"prompt": "", "echo": True, "logprobs": 2, "max_tokens": 2, "stream": stream, **GREEDY})
    assert r.status_code == 200, r.text
    if stream:
        data = _sse_data(r.text)
        assert data[-1] == "[DONE]" and not any('"error"' in d for d in data), data
    else:
        assert r.json()["choices"][0]["logprobs"] is not None


def test_null_penalties_mean_the_default(client):
    # The schema allows null; the sampler got None ("must be real number, not NoneType").
    base = {"prompt": "1, 2, 3,", "max_tokens": 3, **GREEDY}
    expected = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    for chat in (False, True):
        nulls = {"presence_penalty": None, "frequency_penalty": None}
        if chat:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **GREEDY, **nulls})
        else:
            r = client.post("/v1/completions", json={**base, **nulls})
            assert r.json()["choices"][0]["text"] == expected
        assert r.status_code == 200, r.text


def test_embeddings_on_a_server_without_them_get_400(our_llama, smollm2_path):
    # "Llama model must be created with embedding=True" was a RuntimeError: 500.
    llama = our_llama("smollm2")  # embedding=False
    app = create_app(
        server_settings=ServerSettings(),
        model_settings=[ModelSettings(model=smollm2_path, verbose=False)],
        llama=llama,
    )
    with TestClient(app) as c:
        r = c.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "embeddings_disabled"
    assert "--embedding true" in r.json()["error"]["message"]


def test_wrong_method_names_the_allowed_ones(client):
    # RFC 9110: a 405 carries Allow; the app's error handler dropped it.
    r = client.delete("/v1/completions")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == ERROR_KEYS


def test_missing_body_is_named(client):
    r = client.post("/v1/completions")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The request needs a JSON object body"


def test_openapi_documents_what_the_server_answers(app, smollm2_path):
    """Errors are 400 with OpenAI's body (FastAPI documented 422, which the server never
    sends), the bearer key is declared only when one is required, and 200 answers have
    schemas, with server-sent events for the streaming routes (FastAPI: `{}`)."""
    doc = app.openapi()
    assert "securitySchemes" not in doc.get("components", {})
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            assert "422" not in responses and "security" not in operation, path
            assert responses["200"]["content"]["application/json"]["schema"], path
            if "requestBody" in operation:
                # Anthropic's Messages API answers errors in its own shape.
                error = "AnthropicErrorResponse" if path == "/v1/messages" else "ErrorResponse"
                assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{error}"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]

    keyed = create_app(
        server_settings=ServerSettings(api_key="sesame"),
        model_settings=[ModelSettings(model=smollm2_path, verbose=False)],
        llama=app.state.powerinfer.proxy.current,
    ).openapi()
    completions = keyed["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"HTTPBearer": []}] and "401" in completions["responses"]
    assert "security" not in keyed["paths"]["/health"]["get"]


def test_disconnect_stops_a_whole_completion(live):
    """A non-streamed generation whose client gave up (a 1 s timeout here) stops at its next
    token and frees the model; it used to run on to the end of the context for nobody,
    holding the model lock meanwhile."""
    state = live.state
    before = state.stats.get("generations_cancelled", 0)
    # Counting on, min_tokens keeping EOS away, max_tokens 0: until the context (512) is full.
    request = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 0, "min_tokens": 400, **GREEDY}
    with httpx.Client(base_url=live.url, timeout=httpx.Timeout(1.0, connect=10.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=request)
    deadline = time.monotonic() + 120
    while state.stats.get("generations_cancelled", 0) == before:
        assert time.monotonic() < deadline, f"the generation did not stop: {state.stats}"
        time.sleep(0.05)
    llama = state.proxy.current
    assert llama.n_tokens < N_CTX - 100, llama.n_tokens  # stopped early, not at the end
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        assert c.get("/health").json()["requests_waiting"] == 0
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **GREEDY})
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- issue 53


def _texts(c: Any, n: int, **request: Any) -> List[str]:
    out = []
    for _ in range(n):
        r = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, **request})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_unseeded_samples_differ_across_server_starts(smollm2_path):
    """Every start of the server drew the same unseeded samples (its seed stream began at the
    fixed default seed); a request's explicit seed gives the same sample on every start."""
    starts = []
    for _ in range(2):
        with ServerProcess(smollm2_path, "--n_ctx", str(N_CTX), "--n_parallel", "4") as server:
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
                starts.append((_texts(c, 3), _texts(c, 1, seed=7)))
    (unseeded1, seeded1), (unseeded2, seeded2) = starts
    assert unseeded1 != unseeded2
    assert seeded1 == seeded2


LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "logit_bias": {"2": -100}}


@pytest.mark.parametrize("args,sig", [((), signal.SIGTERM),
                                      (("--n_parallel", "2", "--draft_model", "prompt-lookup-decoding"), signal.SIGINT)],
                         ids=["serial-sigterm", "slots-draft-sigint"])
def test_shutdown_signal_ends_open_streams_and_the_server(smollm2_path, args, sig):
    """SIGTERM or SIGINT while a stream was open: the stream went on and the process stayed
    alive until the generation's end (uvicorn waits for every response; our stream watched
    only its client). Now every open stream ends with an error event and [DONE], a running
    non-streamed completion gets 503, and the process exits within a few seconds."""
    with ServerProcess(smollm2_path, "--n_ctx", "4096", *args) as server:
        lines: List[str] = []
        answers: List[Any] = []

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG_STREAM, timeout=TIMEOUT) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        def whole() -> None:
            body = {**LONG_STREAM, "stream": False}
            answers.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT))

        threads = [threading.Thread(target=stream)] + ([threading.Thread(target=whole)] if args else [])
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(lines) < 3 and not any("[DONE]" in line for line in lines):
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)
        server.proc.send_signal(sig)
        try:
            server.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 5 s of the signal:\n" + "".join(server.log[-20:]))
        for t in threads:
            t.join(timeout=10)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "shutting_down", lines[-3:]
    for r in answers:  # the slots' non-streamed completion
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT).text.splitlines():
        if line.split(" ")[0].split("{")[0] == name:
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


@pytest.mark.parametrize("args,stream", [(("--n_parallel", "2"), False), (("--n_parallel", "2"), True),
                                         (("--n_batch", "128"), False)],
                         ids=["slots", "slots-stream", "serial"])
def test_a_gone_clients_prompt_stops_at_the_next_slice(smollm2_path, args, stream):
    """A client that leaves while its long prompt is read: the whole prompt was still computed
    (the cancel check ran only before each sampled token, and a stream's first chunk, prompt
    included, before anything watched the client), holding its slot ~68 s for a 1700-token
    prompt. Now the prompt stops at its next slice (a batcher step; n_batch tokens alone)."""
    prompt = [100 + (i * 7919) % 40000 for i in range(1700)]  # token ids: 1700 tokens
    with ServerProcess(smollm2_path, "--n_ctx", "2048", *args) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": stream},
                       timeout=httpx.Timeout(0.5, connect=10.0))
        deadline = time.monotonic() + 120
        while _metric(server.url, "powerinfer_slots_busy") > 0:
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.1)
        assert _metric(server.url, "powerinfer_prompt_tokens_total") < len(prompt) / 2
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **GREEDY},
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_concurrent_identical_unseeded_requests_give_distinct_answers(smollm2_path, route):
    """Issue 53, item 1: eight identical unseeded requests at once on four slots. (The empty
    answers reported were the model's own: SmolLM2-Instruct ends the raw prompt "Write one
    sentence about the sea." at once with p = 0.47, 0.61 after min_p, as llama-cpp-python
    does; a chat request or a prompt it continues has no empty answer.)"""
    if route == "/v1/completions":
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    else:
        body = {"messages": [{"role": "user", "content": "Write one sentence about the sea."}], "max_tokens": 12,
                "temperature": 1.0}
    with ServerProcess(smollm2_path, "--n_ctx", "2048", "--n_parallel", "4") as server:
        def ask(_: int) -> str:
            r = httpx.post(f"{server.url}{route}", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"] if "text" in choice else choice["message"]["content"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
    assert all(answers), answers
    assert len(set(answers)) >= 6, answers
