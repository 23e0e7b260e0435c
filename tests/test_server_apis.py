"""The server as people use it in 2026: the chat page at / in a real browser, OpenAI's
Responses API (the official `openai` client), Anthropic's Messages API (the official
`anthropic` client), llama-server's GET /slots and slot save/restore, and bad input on all
of them (4xx in each API's own error shape, the server alive afterwards).

The clients and the round trips run against `python -m powerinfer_py.server` on SmolLM2-135M
in a child process, with --n_parallel 1 (one request at a time on the model) and 4 (slots of
a ParallelLlama); bad input runs in-process. Every generation is greedy and a few tokens long.

The page test drives Debian's headless Chromium through Selenium with Debian's chromedriver
(nothing is downloaded: Selenium Manager is never asked); it is skipped where either is
missing, unless POWERINFER_REQUIRE_CHROMIUM=1 (CI) makes that a failure. The screenshot goes
to $POWERINFER_SCREENSHOT_DIR, else the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from fastapi.testclient import TestClient  # noqa: E402

from powerinfer_py.server.app import create_app  # noqa: E402
from powerinfer_py.server.settings import ModelSettings, ServerSettings  # noqa: E402

from conftest import ServerProcess  # noqa: E402

GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}
TIMEOUT = httpx.Timeout(120.0, connect=10.0)
CHROMIUM = os.environ.get("POWERINFER_CHROMIUM_BIN", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("POWERINFER_CHROMEDRIVER", "/usr/bin/chromedriver")
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module", params=[1, 4], ids=["n_parallel=1", "n_parallel=4"])
def server(request, smollm2_path, tmp_path_factory):
    """The server as a user starts it, with a slot save folder."""
    slot_dir = tmp_path_factory.mktemp("slots")
    with ServerProcess(smollm2_path, "--n_ctx", "512", "--n_parallel", str(request.param),
                       "--slot-save-path", str(slot_dir)) as proc:
        proc.n_parallel = request.param
        proc.slot_dir = slot_dir
        yield proc
        assert proc.proc.poll() is None, "the server died:\n" + "".join(proc.log[-80:])
        assert "Traceback" not in "".join(proc.log), "".join(proc.log)[-4000:]


@pytest.fixture(scope="module")
def app(our_llama, smollm2_path, tmp_path_factory):
    """An in-process app over the shared Llama, for bad input (no generation reaches far)."""
    return create_app(server_settings=ServerSettings(slot_save_path=str(tmp_path_factory.mktemp("slots-app"))),
                      model_settings=[ModelSettings(model=smollm2_path, model_alias="smollm2", verbose=False)],
                      llama=our_llama("smollm2"))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


def _openai(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120.0, max_retries=0)


def _anthropic(server) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120.0, max_retries=0)


# ---------------------------------------------------------------------------- OpenAI Responses


def test_openai_client_responses_plain_and_streamed(server):
    client = _openai(server)
    ask = dict(model="smollm2", input="Name a colour.", instructions="Answer briefly.", max_output_tokens=6,
               temperature=0, extra_body={"repeat_penalty": 1.0})
    whole = client.responses.create(**ask)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output[0].type == "message" and whole.output_text.strip()
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 6
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"

    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text  # greedy: the stream says what the whole answer said
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens

    # The SDK's stream helper puts the events together itself (it fails on events out of order;
    # its get_final_response() takes only a response.completed, not OpenAI's response.incomplete).
    with client.responses.stream(**ask) as stream:
        last = list(stream)[-1]
    assert last.type == kinds[-1] and last.response.output_text == whole.output_text


@pytest.mark.parametrize("server", [1], indirect=True, ids=["n_parallel=1"])  # the same path on either engine
def test_openai_client_responses_function_call_and_message_list(server):
    client = _openai(server)
    r = client.responses.create(model="smollm2", input=[{"role": "user", "content": "What is the weather in Paris?"}],
                                tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=24, temperature=0)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)

    events = list(client.responses.create(model="smollm2", input="Weather in Rome?", tools=[WEATHER_TOOL],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == events[-1].response.output[0].arguments


# ---------------------------------------------------------------------------- Anthropic Messages


def test_anthropic_client_messages_plain_and_streamed(server):
    client = _anthropic(server)
    # temperature: the Messages API's field, which this SDK no longer has a parameter for.
    ask = dict(model="smollm2", max_tokens=6, system="Answer briefly.", extra_body={"temperature": 0},
               messages=[{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}])
    whole = client.messages.create(**ask)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content[0].type == "text" and whole.content[0].text.strip()
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 6

    events = list(client.messages.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"], kinds  # the SDK drops pings
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens

    # The SDK's stream helper accumulates the events into a Message.
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == whole.content[0].text

    # On the wire: named events, each `data` of its own type, the ping after the first block starts.
    body = {"model": "smollm2", "max_tokens": 3, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    raw = httpx.post(f"{server.url}/v1/messages", json=body, timeout=TIMEOUT)
    assert raw.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.text.split("\n\n") if b.strip()]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-1] == "message_stop", names
    assert all(json.loads(b.split("\n")[1].removeprefix("data: "))["type"] == n for b, n in zip(blocks, names))


@pytest.mark.parametrize("server", [1], indirect=True, ids=["n_parallel=1"])  # the same path on either engine
def test_anthropic_stop_sequences_and_errors(server):
    client = _anthropic(server)
    whole = client.messages.create(model="smollm2", max_tokens=8, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Count from 1 to 9, digits and commas."}])
    text = whole.content[0].text
    stop = next((c for c in text[1:] if c.isdigit()), None)
    if stop is not None:  # the model counts: stop at its second digit
        cut = client.messages.create(model="smollm2", max_tokens=8, extra_body={"temperature": 0}, stop_sequences=[stop],
                                     messages=[{"role": "user", "content": "Count from 1 to 9, digits and commas."}])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[: text.index(stop, 1)]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smollm2", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- slots


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _complete(c, prompt: str, n: int = 8) -> str:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_slots_save_restore_continues_exactly(server):
    """Save a slot, continue it, erase every slot and fill one with another prompt, restore the
    file (into another slot with --n_parallel 4): the continuation is the same, and its prompt
    comes from the restored cache (only the tokens after it are computed)."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        prompt = "The three primary colours are"
        text = _complete(c, prompt)
        slots = c.get("/slots").json()
        assert [s["id"] for s in slots] == list(range(server.n_parallel))
        assert all({"id", "id_task", "n_ctx", "speculative", "is_processing", "params", "next_token"} <= set(s)
                   for s in slots)
        assert all(s["n_ctx"] == 512 and not s["is_processing"] for s in slots)
        used = max(slots, key=lambda s: s["id_task"])
        assert used["n_past"] > 0 and used["params"]["n_predict"] == 8 and used["params"]["temperature"] == 0.0

        r = c.post(f"/slots/{used['id']}?action=save", json={"filename": "colours.bin"})
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["id_slot"] == used["id"] and saved["filename"] == "colours.bin"
        assert saved["n_saved"] == used["n_past"] and saved["n_written"] == (server.slot_dir / "colours.bin").stat().st_size
        assert saved["timings"]["save_ms"] >= 0

        expected = _complete(c, prompt + text)  # the continuation on the live cache

        for s in range(server.n_parallel):
            r = c.post(f"/slots/{s}?action=erase")
            assert r.status_code == 200 and r.json()["id_slot"] == s, r.text
        assert all(s["n_past"] == 0 for s in c.get("/slots").json())
        _complete(c, "An unrelated prompt about the sea", 2)  # another use of a slot

        target = (used["id"] + 1) % server.n_parallel
        r = c.post(f"/slots/{target}?action=restore", json={"filename": "colours.bin"})
        assert r.status_code == 200, r.text
        restored = r.json()
        assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
        assert c.get("/slots").json()[target]["n_past"] == saved["n_saved"]

        before = _metric(server, "powerinfer_prompt_tokens_total")
        assert _complete(c, prompt + text) == expected
        computed = _metric(server, "powerinfer_prompt_tokens_total") - before
        assert computed < saved["n_saved"] / 2, f"{computed} prompt tokens computed: the restored cache was not used"


def _rewrite_header(blob: bytes, **changes: Any) -> bytes:
    (n,) = struct.unpack_from("<I", blob, 8)
    header = json.loads(blob[12 : 12 + n])
    header.update(changes)
    new = json.dumps(header).encode()
    return blob[:8] + struct.pack("<I", len(new)) + new + blob[12 + n :]


def test_slot_actions_refuse_bad_input(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        _complete(c, "Hello", 2)
        assert c.post("/slots/0?action=save", json={"filename": "good.bin"}).status_code == 200
        good = (server.slot_dir / "good.bin").read_bytes()
        files = {
            "other-model.bin": _rewrite_header(good, model_sha256="0" * 64),
            "other-ctx.bin": _rewrite_header(good, n_ctx=256),
            "too-many.bin": _rewrite_header(good, n_tokens=10**6),
            "cut.bin": good[: len(good) // 2],
            "garbage.bin": b"not a slot file at all",
        }
        for name, blob in files.items():
            (server.slot_dir / name).write_bytes(blob)
        cases = [
            ("/slots/0?action=restore", {"filename": "../good.bin"}, 400),
            ("/slots/0?action=save", {"filename": "a/b.bin"}, 400),
            ("/slots/0?action=save", {"filename": "..\\x"}, 400),
            ("/slots/0?action=save", {}, 400),
            ("/slots/0?action=save", {"filename": 7}, 400),
            ("/slots/0?action=restore", {"filename": "missing.bin"}, 404),
            ("/slots/99?action=erase", None, 400),
            ("/slots/-1?action=erase", None, 400),
            ("/slots/0?action=explode", None, 400),
            ("/slots/0", None, 400),
            ("/slots/x?action=erase", None, 400),
            *[("/slots/0?action=restore", {"filename": name}, 400) for name in files],
        ]
        for path, body, status in cases:
            r = c.post(path, json=body) if body is not None else c.post(path)
            assert r.status_code == status, (path, body, r.status_code, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (path, error)
        assert "model" in c.post("/slots/0?action=restore", json={"filename": "other-model.bin"}).json()["error"]["message"]
        assert c.get("/slots?fail_on_no_slot=1").status_code == 200
        # Still serving, and the good file still restores.
        assert c.post("/slots/0?action=restore", json={"filename": "good.bin"}).status_code == 200
        assert _complete(c, "Hello", 2)


def test_slot_actions_need_a_save_path(our_llama, smollm2_path):
    app = create_app(server_settings=ServerSettings(), model_settings=[ModelSettings(model=smollm2_path, verbose=False)],
                     llama=our_llama("smollm2"))
    with TestClient(app) as c:
        r = c.post("/slots/0?action=save", json={"filename": "x.bin"})
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert c.post("/slots/0?action=erase").status_code == 501
        assert c.get("/slots").status_code == 200


# ---------------------------------------------------------------------------- bad input


RESPONSES_BAD = {
    "no input": {"max_output_tokens": 2},
    "input a number": {"input": 7},
    "zero max_output_tokens": {"input": "hi", "max_output_tokens": 0},
    "temperature out of range": {"input": "hi", "temperature": 9},
    "unknown item type": {"input": [{"type": "reasoning", "summary": []}]},
    "image part": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    "bad role": {"input": [{"role": "robot", "content": "hi"}]},
    "content a number": {"input": [{"role": "user", "content": 5}]},
    "web search tool": {"input": "hi", "tools": [{"type": "web_search"}]},
    "tool without name": {"input": "hi", "tools": [{"type": "function"}]},
    "previous_response_id": {"input": "hi", "previous_response_id": "resp_1"},
    "bad text format": {"input": "hi", "text": {"format": {"type": "yaml"}}},
    "bad passthrough": {"input": "hi", "top_k": -3},
    "function_call without arguments": {"input": [{"type": "function_call", "name": "f"}]},
}


@pytest.mark.parametrize("case", list(RESPONSES_BAD), ids=list(RESPONSES_BAD))
def test_responses_bad_input_gets_openai_400(client, case):
    r = client.post("/v1/responses", json={**RESPONSES_BAD[case], "stream": case.endswith("range")})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"] == "invalid_request_error"


MESSAGES_BAD = {
    "no max_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "no messages": {"max_tokens": 2, "messages": []},
    "bad role": {"max_tokens": 2, "messages": [{"role": "system", "content": "hi"}]},
    "temperature above 1": {"max_tokens": 2, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
    "image block": {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    "system a number": {"max_tokens": 2, "system": 3, "messages": [{"role": "user", "content": "hi"}]},
    "bad tool_choice": {"max_tokens": 2, "tool_choice": {"type": "maybe"}, "messages": [{"role": "user", "content": "hi"}]},
    "server tool": {"max_tokens": 2, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                    "messages": [{"role": "user", "content": "hi"}]},
    "not JSON": None,
}


@pytest.mark.parametrize("case", list(MESSAGES_BAD), ids=list(MESSAGES_BAD))
def test_messages_bad_input_gets_anthropic_400(client, case):
    payload = MESSAGES_BAD[case]
    if payload is None:
        r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/messages", json={"model": "smollm2", **payload})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_messages_errors_keep_anthropic_shape_for_auth_and_methods(our_llama, smollm2_path):
    app = create_app(server_settings=ServerSettings(api_key="sesame"),
                     model_settings=[ModelSettings(model=smollm2_path, verbose=False)], llama=our_llama("smollm2"))
    with TestClient(app) as c:
        ask = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        r = c.post("/v1/messages", json=ask)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/messages", json=ask, headers={"x-api-key": "sesame"}).status_code == 200
        r = c.get("/v1/messages", headers={"x-api-key": "sesame"})
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = c.post("/v1/responses", json={"input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------------------- the page


def _require_chromium():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).is_file()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        why = f"{', '.join(map(str, missing))} missing (apt-get install chromium chromium-driver; pip install selenium)"
        (pytest.fail if os.environ.get("POWERINFER_REQUIRE_CHROMIUM") == "1" else pytest.skip)(why)


@pytest.mark.parametrize("server", [1], indirect=True, ids=["n_parallel=1"])  # the same path on either engine
def test_chat_page_streams_in_chromium(server, tmp_path):
    _require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,860",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        options.add_argument(arg)
    # The driver's path given: Selenium Manager, which would download one, is never run.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.ID, "model-name").text not in ("", "loading…"))
        assert "SmolLM2-135M" in driver.find_element(By.ID, "model-name").text
        driver.find_element(By.CSS_SELECTOR, ".settings summary").click()
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("24")
        driver.find_element(By.ID, "prompt").send_keys("Write one sentence about the sea.")
        # Every length the answer's text takes, as the page writes it.
        driver.execute_script("""
            window.lengths = [];
            new MutationObserver(() => {
                const m = document.querySelector('.msg.assistant .text');
                if (m) window.lengths.push(m.textContent.length);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
        """)
        driver.find_element(By.ID, "send").click()
        answer = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant.done"))
        assert "Error" not in answer.text and answer.find_element(By.CSS_SELECTOR, ".text").text.strip()
        assert "tokens" in answer.find_element(By.CSS_SELECTOR, ".meta").text
        lengths = [n for n in driver.execute_script("return window.lengths") if n]
        assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths  # the text grew, chunk by chunk
        wait.until(lambda d: d.find_element(By.ID, "tps").text not in ("", "–"))
        wait.until(lambda d: d.find_element(By.ID, "server-tps").text not in ("", "–"))
        assert "Dense model" in driver.find_element(By.ID, "sparse-note").text  # SmolLM2 is dense
        assert driver.execute_script("return document.getElementById('sparse-plot').getContext('2d') !== null")
        out = Path(os.environ.get("POWERINFER_SCREENSHOT_DIR") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        shot = out / "server-chat-page.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        driver.quit()
    # The page loaded nothing from elsewhere: its files are the package's.
    page = httpx.get(server.url + "/", timeout=TIMEOUT).text
    assert "http://" not in page and "https://" not in page
    for name in ("app.js", "style.css"):
        assert httpx.get(f"{server.url}/static/{name}", timeout=TIMEOUT).status_code == 200


def test_static_files_are_package_data():
    """The page's files are in the package (the wheel takes the package folder whole)."""
    from powerinfer_py.server.page import STATIC_DIR

    assert {p.name for p in STATIC_DIR.iterdir()} >= {"index.html", "app.js", "style.css"}
