"""LangChain on PowerInfer-Py (SmolLM2, greedy): our powerinfer_py.langchain classes, and
langchain-community's LlamaCpp / ChatLlamaCpp / LlamaCppEmbeddings running unchanged
through powerinfer_py.install_as_llama_cpp()."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("langchain_core", reason="the langchain extra is not installed")

from pydantic import BaseModel  # noqa: E402

from powerinfer_py.langchain import ChatPowerInfer, PowerInferEmbeddings, PowerInferLLM  # noqa: E402

from conftest import N_CTX, N_THREADS, REPO_DIR  # noqa: E402

GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


@pytest.fixture(scope="module")
def llama(our_llama):
    return our_llama("smollm2")


@pytest.fixture(scope="module")
def llm(llama):
    return PowerInferLLM(client=llama, max_tokens=8, **GREEDY)


@pytest.fixture(scope="module")
def chat(llama):
    return ChatPowerInfer(client=llama, max_tokens=24, **GREEDY)


@pytest.fixture(scope="module")
def embeddings(smollm2_path):
    return PowerInferEmbeddings(model_path=smollm2_path, n_ctx=N_CTX, n_threads=N_THREADS, verbose=False)


# ---------------------------------------------------------------------------- LLM


def test_llm_invoke_matches_llama(llm, llama):
    prompt = "The capital of France is"
    expected = llama.create_completion(prompt, max_tokens=8, top_p=0.95, top_k=40, min_p=0.05, **GREEDY)
    assert llm.invoke(prompt) == expected["choices"][0]["text"]
    # The non-streaming path gives the same text.
    assert llm.model_copy(update={"streaming": False}).invoke(prompt) == expected["choices"][0]["text"]


def test_llm_stream_batch_and_stop(llm):
    prompts = ["1, 2, 3,", "Once upon a time"]
    alone = [llm.invoke(p) for p in prompts]
    chunks = list(llm.stream(prompts[0]))
    assert len(chunks) > 1
    assert "".join(chunks) == alone[0]
    assert llm.batch(prompts) == alone
    assert llm.batch(prompts, config={"max_concurrency": 2}) == alone
    stopped = llm.invoke(prompts[0], stop=[","])
    assert "," not in stopped and alone[0].startswith(stopped)


def test_llm_async(llm):
    async def run():
        text = await llm.ainvoke("1, 2, 3,")
        pieces = [piece async for piece in llm.astream("1, 2, 3,")]
        return text, "".join(pieces)

    text, streamed = asyncio.run(run())
    assert text == streamed == llm.invoke("1, 2, 3,")


def test_llm_needs_a_model():
    with pytest.raises(ValueError):
        PowerInferLLM(model_path="/nonexistent/model.gguf", verbose=False)
    with pytest.raises(ValueError):
        PowerInferLLM(verbose=False)


# ---------------------------------------------------------------------------- chat


def test_chat_invoke_stream_batch(chat, llama):
    messages = [("system", "You are brief."), ("human", "What is the capital of France?")]
    expected = llama.create_chat_completion(
        messages=[
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=24,
        **GREEDY,
    )
    message = chat.invoke(messages)
    assert message.content == expected["choices"][0]["message"]["content"]
    assert message.usage_metadata["output_tokens"] == expected["usage"]["completion_tokens"]
    assert message.response_metadata["finish_reason"] in ("stop", "length")

    assert "".join(chunk.content for chunk in chat.stream(messages)) == message.content

    # Runnable.batch runs on a thread pool: the per-Llama lock keeps the calls apart.
    questions = ["Say hi.", "What is 2 + 2?", "Name a color."]
    alone = [chat.invoke(q).content for q in questions]
    assert [m.content for m in chat.batch(questions)] == alone
    assert len(set(alone)) == len(alone)


def test_chat_structured_output(chat):
    prompt = "Paris is a city in France. Extract the city."
    city = chat.with_structured_output(City).invoke(prompt)  # a forced tool call
    assert isinstance(city, City) and city.name
    city = chat.with_structured_output(City, method="json_schema").invoke(prompt)
    assert isinstance(city, City) and city.name
    raw = chat.with_structured_output(City, include_raw=True).invoke(prompt)
    assert set(raw) == {"raw", "parsed", "parsing_error"}
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], City)
    assert raw["raw"].tool_calls[0]["name"] == "City"


def test_chat_bind_tools(chat):
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] == "get_weather"
    assert isinstance(call["args"].get("city"), str)
    with pytest.raises(ValueError):
        chat.bind_tools([get_weather], tool_choice="no_such_tool")


# ---------------------------------------------------------------------------- embeddings


def test_embeddings_shapes(embeddings):
    n_embd = embeddings.client.n_embd()
    docs = embeddings.embed_documents(["hello world", "a different sentence", "x"])
    assert len(docs) == 3
    assert all(len(vector) == n_embd and all(isinstance(v, float) for v in vector) for vector in docs)
    assert docs[0] != docs[1]
    query = embeddings.embed_query("hello world")
    assert len(query) == n_embd
    assert query == pytest.approx(docs[0], rel=1e-5, abs=1e-6)
    assert embeddings.embed_documents([]) == []
    assert asyncio.run(embeddings.aembed_query("hello world")) == pytest.approx(query, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------- langchain-community


_COMMUNITY_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import powerinfer_py
    powerinfer_py.install_as_llama_cpp()
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_community.embeddings import LlamaCppEmbeddings
    from langchain_community.llms import LlamaCpp
    from pydantic import BaseModel

    class City(BaseModel):
        \"\"\"A city and the country it is in.\"\"\"
        name: str
        country: str

    path, n_ctx, n_threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    common = dict(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads, verbose=False)
    out = {}
    llm = LlamaCpp(temperature=0, max_tokens=8, repeat_penalty=1.0, **common)
    out["client"] = type(llm.client).__module__ + "." + type(llm.client).__name__
    out["invoke"] = llm.invoke("The capital of France is")
    out["stream"] = list(llm.stream("The capital of France is"))
    chat = ChatLlamaCpp(temperature=0, max_tokens=32, repeat_penalty=1.0, **common)
    out["chat"] = chat.invoke("What is the capital of France?").content
    out["structured"] = chat.with_structured_output(City).invoke("Paris is a city in France. Extract the city.").model_dump()
    emb = LlamaCppEmbeddings(**common)
    out["query"] = len(emb.embed_query("hello"))
    out["documents"] = [len(v) for v in emb.embed_documents(["hello", "world"])]
    print("RESULT " + json.dumps(out))
    """
)


def test_langchain_community_llamacpp_classes_through_compat(smollm2_path, llama, tmp_path):
    if importlib.util.find_spec("langchain_community") is None:
        pytest.skip("langchain-community is not installed")
    script = tmp_path / "community.py"
    script.write_text(_COMMUNITY_SCRIPT)
    # A subprocess: install_as_llama_cpp() rebinds `llama_cpp` for the whole process.
    proc = subprocess.run(
        [sys.executable, str(script), smollm2_path, str(N_CTX), str(N_THREADS)],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])

    assert out["client"] == "powerinfer_py.llama.Llama"
    # The same LlamaCpp on llama-cpp-python gives the same text. LlamaCpp passes its own
    # rope_freq_base=10000 and rope_freq_scale=1 (not SmolLM2's), so the reference does too.
    import llama_cpp

    ref = llama_cpp.Llama(
        model_path=smollm2_path,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=N_THREADS,
        rope_freq_base=10000.0,
        rope_freq_scale=1.0,
        verbose=False,
    )
    try:
        expected = ref.create_completion("The capital of France is", max_tokens=8, top_p=0.95, top_k=40, **GREEDY)
    finally:
        ref.close()
    assert out["invoke"] == expected["choices"][0]["text"]
    assert "".join(out["stream"]) == out["invoke"]
    assert out["chat"]
    assert out["structured"]["name"] and out["structured"]["country"]
    assert out["query"] == llama.n_embd()
    assert out["documents"] and all(n == llama.n_embd() for n in out["documents"])


# ---------------------------------------------------------------------------- kept streams (issue 12, item 6)

_KEPT_STREAM_SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, json, sys, threading, time
    from powerinfer_py import Llama
    from powerinfer_py.langchain import ChatPowerInfer, PowerInferLLM, StreamCancelledError

    path, n_ctx, n_threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llama = Llama(model_path=path, n_ctx=n_ctx, n_threads=n_threads, verbose=False)
    greedy = dict(temperature=0.0, repeat_penalty=1.0)
    llm = PowerInferLLM(client=llama, max_tokens=8, **greedy)
    chat = ChatPowerInfer(client=llama, max_tokens=8, **greedy)
    out = {}
    P, Q = "1, 2, 3,", "The capital of France is"
    out["ref_p"], out["ref_q"] = llm.invoke(P), llm.invoke(Q)
    msgs = [("human", "Say hi.")]
    out["ref_chat"] = chat.invoke(msgs).content

    def step(name):
        print("STEP", name, flush=True)

    # 1. A partly consumed stream kept alive, then invoke() on the same thread.
    step("kept")
    it = llm.stream(P)
    out["kept_first"] = next(it)
    out["kept_invoke"] = llm.invoke(Q)
    try:
        next(it)
        out["kept_resume"] = "no error"
    except StreamCancelledError as e:
        out["kept_resume"] = "cancelled: " + str(e)[:40]

    # 2. The same with the chat model, and across the two wrappers of one Llama.
    step("chat")
    cit = chat.stream(msgs)
    next(cit)
    out["chat_invoke"] = chat.invoke(msgs).content
    it2 = llm.stream(P)
    next(it2)
    out["cross_wrapper"] = chat.invoke(msgs).content

    # 3. A call inside the loop body of a stream of the same model.
    step("nested")
    inner, error = None, None
    try:
        for chunk in llm.stream(P):
            inner = llm.invoke(Q)
    except StreamCancelledError:
        error = "cancelled"
    out["nested"] = [inner, error]

    # 4. A stream left by break: the next call does not wait for garbage collection.
    step("break")
    gc.disable()
    for chunk in llm.stream(P):
        break
    out["after_break"] = llm.invoke(Q)
    gc.enable()

    # 5. Another thread's stream: a call waits for it to end, and both are complete.
    step("threads")
    started, pieces = threading.Event(), []

    def slow_consumer():
        for chunk in llm.stream(P):
            pieces.append(chunk)
            started.set()
            time.sleep(0.05)

    t = threading.Thread(target=slow_consumer)
    t.start()
    started.wait(60)
    out["other_thread_invoke"] = llm.invoke(Q)
    t.join(60)
    out["other_thread_stream"] = "".join(pieces)

    # 6. A stream kept by a thread that has ended does not block anyone.
    step("dead thread")
    kept = []
    t = threading.Thread(target=lambda: kept.append((llm.stream(P), None)) or next(kept[0][0]))
    t.start()
    t.join(60)
    out["dead_thread_invoke"] = llm.invoke(Q)

    # 7. async: astream kept by a task, then ainvoke in that task; two tasks' streams at once.
    step("async")
    async def main():
        agen = llm.astream(P)
        first = await agen.__anext__()
        text = await asyncio.wait_for(llm.ainvoke(Q), 60)
        try:
            await agen.__anext__()
            resumed = "no error"
        except StreamCancelledError:
            resumed = "cancelled"
        await agen.aclose()

        async def collect(prompt):
            return "".join([c async for c in llm.astream(prompt)])

        both = await asyncio.wait_for(asyncio.gather(*[collect(P if i % 2 else Q) for i in range(8)]), 120)
        return [first, text, resumed, both]

    out["async"] = asyncio.run(main())
    step("done")
    print("RESULT " + json.dumps(out))
    """
)


def test_kept_stream_never_deadlocks(smollm2_path, tmp_path):
    """A partly consumed stream kept alive used to hold a plain Lock, so the next call on the
    same thread waited forever. Run in a subprocess with a timeout, so a regression fails."""
    script = tmp_path / "kept.py"
    script.write_text(_KEPT_STREAM_SCRIPT)
    try:
        proc = subprocess.run([sys.executable, str(script), smollm2_path, str(N_CTX), str(N_THREADS)],
                              cwd=REPO_DIR, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        steps = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"deadlock: the script hung after {steps.strip().splitlines()[-1:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    ref_p, ref_q = out["ref_p"], out["ref_q"]
    assert ref_p and ref_q and ref_p != ref_q
    assert ref_p.startswith(out["kept_first"])
    assert out["kept_invoke"] == ref_q  # the cancelled stream did not disturb the call
    assert out["kept_resume"].startswith("cancelled: this stream was cancelled")
    assert out["chat_invoke"] == out["cross_wrapper"] == out["ref_chat"]
    assert out["nested"] == [ref_q, "cancelled"]
    assert out["after_break"] == ref_q
    assert out["other_thread_invoke"] == ref_q and out["other_thread_stream"] == ref_p  # served in turn
    assert out["dead_thread_invoke"] == ref_q
    first, text, resumed, both = out["async"]
    assert ref_p.startswith(first) and text == ref_q and resumed == "cancelled"
    assert both == [ref_p if i % 2 else ref_q for i in range(8)]
