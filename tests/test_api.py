"""The drop-in API: powerinfer_py.Llama against llama_cpp.Llama 0.3.36 on SmolLM2, greedy
unless a test says otherwise. Same text, same response and stream-chunk shapes, the
same JSON under grammars, state save/load, embeddings, logprobs, the compat aliases,
and ValueError (not a crash) for bad parameters."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import N_CTX, N_THREADS

GREEDY = dict(temperature=0.0)
KW = dict(n_ctx=N_CTX, n_batch=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS, verbose=False)

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Q: What is 7 times 8?\nA:",
    "The three laws of robotics are",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "Say hello to my friend."},
    ],
    [
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": "Nice to meet you, Ann!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three colors, one per line."}],
]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PERSON_MESSAGES = [
    {"role": "user", "content": "Give me a JSON object describing a person named Alice who is 30 years old."}
]
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def ours(our_llama):
    return our_llama("smollm2")


@pytest.fixture(scope="module")
def ref(ref_llama):
    return ref_llama("smollm2")


@pytest.fixture(scope="module")
def ours_logits_all(smollm2_path):
    from powerinfer_py import Llama

    llm = Llama(smollm2_path, logits_all=True, fallback=False, **KW)
    yield llm
    llm.close()


def _shape(x):
    """Keys and value types, recursively: what a client parsing the response relies on."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_shape(v) for v in x]
    return type(x).__name__


def _text(response):
    return response["choices"][0]["text"]


def _content(response):
    return response["choices"][0]["message"]["content"]


# ---- completion -------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_llama_cpp(prompt, ours, ref):
    got = ours.create_completion(prompt, max_tokens=24, **GREEDY)
    want = ref.create_completion(prompt, max_tokens=24, **GREEDY)
    assert _shape(got) == _shape(want)
    assert got["choices"] == want["choices"]
    assert got["usage"] == want["usage"]
    assert got["model"] == ours.model_path


def test_completion_token_prompt_echo_and_stop(ours, ref):
    tokens = ref.tokenize(PROMPTS[4].encode(), add_bos=True)
    for kwargs in (dict(), dict(echo=True), dict(stop=["."]), dict(stop="\n", echo=True)):
        got = ours(tokens if not kwargs.get("echo") else PROMPTS[4], max_tokens=32, **GREEDY, **kwargs)
        want = ref(tokens if not kwargs.get("echo") else PROMPTS[4], max_tokens=32, **GREEDY, **kwargs)
        assert got["choices"] == want["choices"], kwargs
        assert got["usage"] == want["usage"], kwargs


def test_seeded_sampling_matches_llama_cpp(ours, ref):
    """Same libllama sampler chain and seed: the same draws (the logits are identical)."""
    for seed in (1234, 7):
        kwargs = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed, max_tokens=16)
        assert _text(ours(PROMPTS[1], **kwargs)) == _text(ref(PROMPTS[1], **kwargs))
    # Other samplers of the chain: a plain draw (temp < 0), Mirostat 2, penalties.
    for kwargs in (
        dict(temperature=-1.0, seed=3),
        dict(temperature=0.7, mirostat_mode=2, mirostat_tau=4.0, seed=5),
        dict(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    ):
        assert _text(ours(PROMPTS[0], max_tokens=16, **kwargs)) == _text(ref(PROMPTS[0], max_tokens=16, **kwargs)), kwargs


def test_streaming_chunks_match_llama_cpp(ours, ref):
    for prompt, kwargs in ((PROMPTS[0], {}), (PROMPTS[3], dict(stop=["\n"]))):
        got = list(ours.create_completion(prompt, max_tokens=20, stream=True, **GREEDY, **kwargs))
        want = list(ref.create_completion(prompt, max_tokens=20, stream=True, **GREEDY, **kwargs))
        assert [_shape(c) for c in got] == [_shape(c) for c in want]
        assert [c["choices"] for c in got] == [c["choices"] for c in want]
        assert len({c["id"] for c in got}) == 1
        full = ours.create_completion(prompt, max_tokens=20, **GREEDY, **kwargs)
        assert "".join(_text(c) for c in got) == _text(full)


def test_grammar_logits_processor_stopping_criteria_logit_bias(ours, ref):
    from powerinfer_py import LlamaGrammar, LogitsProcessorList, StoppingCriteriaList

    grammar = LlamaGrammar.from_string('root ::= " yes" | " no" | " maybe"', verbose=False)
    got = ours("Is the sky blue? Answer:", grammar=grammar, max_tokens=8, **GREEDY)
    assert _text(got) in (" yes", " no", " maybe")
    assert got["choices"] == ref("Is the sky blue? Answer:", grammar=grammar, max_tokens=8, **GREEDY)["choices"]

    first = ours.tokenize(_text(ours(PROMPTS[0], max_tokens=1, **GREEDY)).encode(), add_bos=False)[0]

    def ban_first(input_ids, scores):
        scores[first] = -np.inf
        return scores

    n_prompt = len(ours.tokenize(PROMPTS[0].encode(), add_bos=True, special=True))

    def three_tokens(input_ids, logits):
        return len(input_ids) >= n_prompt + 3

    for kwargs in (
        dict(logits_processor=LogitsProcessorList([ban_first])),
        dict(stopping_criteria=StoppingCriteriaList([three_tokens])),
        dict(logit_bias={first: -100.0}),
        dict(logit_bias={str(first): 5.0}),  # JSON-decoded requests carry string keys
    ):
        got, want = ours(PROMPTS[0], max_tokens=12, **GREEDY, **kwargs), ref(PROMPTS[0], max_tokens=12, **GREEDY, **kwargs)
        assert got["choices"] == want["choices"], kwargs
    assert not _text(ours(PROMPTS[0], max_tokens=4, logit_bias={first: -100.0}, **GREEDY)).startswith(" Paris")
    # Upstream drops both when logits_processor and logit_bias are given together; we apply both.
    banned = _text(ours(PROMPTS[0], max_tokens=4, logits_processor=LogitsProcessorList([ban_first]),
                        logit_bias={first: 100.0}, **GREEDY))
    assert ours.tokenize(banned.encode(), add_bos=False)[0] != first


def test_infill_suffix(ours, our_llama):
    """SmolLM2 has no FIM tokens: upstream's no-FIM path completes the prompt and appends
    the suffix. Qwen2.5-Coder has them: the prompt is <|fim_prefix|> prompt <|fim_suffix|>
    suffix <|fim_middle|> and the model fills the middle (upstream puts token 0 there)."""
    suffix = "\n    return result\n"
    out = ours.create_completion("def add(a, b):\n", suffix=suffix, max_tokens=8, **GREEDY)
    assert _text(out).endswith(suffix)
    assert ours._fim_tokens() == (-1, -1, -1)

    qwen = our_llama("qwen2.5-coder-0.5b")
    fim = qwen._fim_tokens()
    assert [qwen._token_text(t) for t in fim] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    out = qwen.create_completion(prefix, suffix=suffix, max_tokens=5, **GREEDY)
    n_parts = len(qwen.tokenize(prefix.encode(), add_bos=False)) + len(qwen.tokenize(suffix.encode(), add_bos=False))
    assert out["usage"]["prompt_tokens"] == n_parts + 3
    assert _text(out).startswith("return a + b")


# ---- chat ----------------------------------------------------------------------------------


def test_chat_format_from_gguf_template(ours, ref):
    assert "tokenizer.chat_template" in ours.metadata
    assert ours.chat_format == ref.chat_format == "chat_template.default"
    assert set(ours._chat_handlers) == set(ref._chat_handlers)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=[f"conv{i}" for i in range(len(CONVERSATIONS))])
def test_chat_completion_matches_llama_cpp(messages, ours, ref):
    got = ours.create_chat_completion(messages, max_tokens=48, **GREEDY)
    want = ref.create_chat_completion(messages, max_tokens=48, **GREEDY)
    assert _shape(got) == _shape(want)
    assert got["id"].startswith("chatcmpl-") and got["object"] == "chat.completion"
    assert got["choices"] == want["choices"]
    assert got["usage"] == want["usage"]


def test_chat_format_by_name_matches_llama_cpp(smollm2_path):
    import llama_cpp

    from powerinfer_py import Llama

    with Llama(smollm2_path, chat_format="chatml", fallback=False, **KW) as ours:
        ref = llama_cpp.Llama(model_path=smollm2_path, chat_format="chatml", **KW)
        try:
            assert ours.chat_format == "chatml"
            got = ours.create_chat_completion(CONVERSATIONS[0], max_tokens=24, **GREEDY)
            want = ref.create_chat_completion(CONVERSATIONS[0], max_tokens=24, **GREEDY)
            assert got["choices"] == want["choices"]
        finally:
            ref.close()


def test_chat_streaming_chunks_match_llama_cpp(ours, ref):
    for kwargs in (dict(), dict(tools=WEATHER_TOOLS, tool_choice=WEATHER_CHOICE)):
        got = list(ours.create_chat_completion(CONVERSATIONS[0], max_tokens=32, stream=True, **GREEDY, **kwargs))
        want = list(ref.create_chat_completion(CONVERSATIONS[0], max_tokens=32, stream=True, **GREEDY, **kwargs))
        assert [_shape(c) for c in got] == [_shape(c) for c in want]
        assert got[0]["object"] == "chat.completion.chunk"
        if not kwargs:  # tool-call deltas carry the completion id, which differs
            assert [c["choices"] for c in got] == [c["choices"] for c in want]


def _check_person(text: str) -> dict:
    """Validates against PERSON_SCHEMA by hand (jsonschema is not a dependency)."""
    value = json.loads(text)
    assert isinstance(value, dict)
    for key in PERSON_SCHEMA["required"]:
        assert key in value, f"missing {key!r} in {text!r}"
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert set(value) <= set(PERSON_SCHEMA["properties"])
    return value


def test_response_format_json_schema(ours, ref):
    # llama-cpp-python's form: {"type": "json_object", "schema": ...}
    got = ours.create_chat_completion(
        PERSON_MESSAGES, response_format={"type": "json_object", "schema": PERSON_SCHEMA}, max_tokens=96, **GREEDY
    )
    want = ref.create_chat_completion(
        PERSON_MESSAGES, response_format={"type": "json_object", "schema": PERSON_SCHEMA}, max_tokens=96, **GREEDY
    )
    assert got["choices"] == want["choices"]
    person = _check_person(_content(got))
    assert person["name"] == "Alice" and person["age"] == 30
    # OpenAI's form, which upstream ignores: enforced with the same grammar here.
    openai_form = ours.create_chat_completion(
        PERSON_MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
        max_tokens=96,
        **GREEDY,
    )
    assert _check_person(_content(openai_form)) == person
    # Any JSON value: the grammar holds from the first token (the text may be cut by max_tokens).
    free_form = ours.create_chat_completion(PERSON_MESSAGES, response_format={"type": "json_object"}, max_tokens=8, **GREEDY)
    assert _content(free_form).lstrip()[:1] in ("{", "[")


def test_tools_with_tool_choice_match_llama_cpp(ours, ref):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = ours.create_chat_completion(messages, tools=WEATHER_TOOLS, tool_choice=WEATHER_CHOICE, max_tokens=48, **GREEDY)
    want = ref.create_chat_completion(messages, tools=WEATHER_TOOLS, tool_choice=WEATHER_CHOICE, max_tokens=48, **GREEDY)
    assert _shape(got) == _shape(want)
    call = got["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    assert call["function"] == want["choices"][0]["message"]["tool_calls"][0]["function"]


# ---- logprobs ------------------------------------------------------------------------------

# The core runs llama.cpp's kernels in llama.cpp's order, so the logits are equal today;
# the bound allows float32 re-association in a different batch split (1e-3 nats is far
# below the 0.01-nat NLL parity bound and far above fp32 rounding of a log-softmax).
LOGPROB_TOL = 1e-3


def test_logprobs_match_llama_cpp(ours_logits_all, ref):
    for kwargs in (dict(logprobs=3), dict(logprobs=2, echo=True)):
        got = ours_logits_all.create_completion(PROMPTS[0], max_tokens=8, **GREEDY, **kwargs)
        want = ref.create_completion(PROMPTS[0], max_tokens=8, **GREEDY, **kwargs)
        assert _shape(got) == _shape(want)
        g, w = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
        assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"]
        assert len(g["token_logprobs"]) == len(g["tokens"]) == len(g["top_logprobs"])
        for a, b in zip(g["token_logprobs"], w["token_logprobs"]):
            assert (a is None) == (b is None)
            if a is not None:
                assert abs(float(a) - float(b)) < LOGPROB_TOL and float(a) <= 0.0
        for a, b in zip(g["top_logprobs"], w["top_logprobs"]):
            if a is None:
                assert b is None
                continue
            assert set(a) == set(b)
            assert all(abs(float(a[k]) - float(b[k])) < LOGPROB_TOL for k in a)
    got = list(ours_logits_all.create_completion(PROMPTS[0], max_tokens=6, logprobs=2, stream=True, **GREEDY))
    want = list(ref.create_completion(PROMPTS[0], max_tokens=6, logprobs=2, stream=True, **GREEDY))
    assert [_shape(c) for c in got] == [_shape(c) for c in want]


def test_logprobs_need_logits_all(ours):
    with pytest.raises(ValueError, match="logits_all"):
        ours.create_completion(PROMPTS[0], max_tokens=2, logprobs=1)


# ---- tokenizer, vocabulary, state --------------------------------------------------------


def test_tokenize_detokenize_round_trip(ours, ref):
    texts = ["Hello, world!", "  leading spaces\tand tabs\n", "Ünïcödé — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        for special in (False, True):
            tokens = ours.tokenize(text.encode(), add_bos=False, special=special)
            assert tokens == ref.tokenize(text.encode(), add_bos=False, special=special)
            assert ours.detokenize(tokens, special=special) == text.encode()
            assert ours.detokenize(tokens, special=special) == ref.detokenize(tokens, special=special)
    assert ours.tokenizer().decode(ours.tokenizer().encode("round trip")) == "round trip"


def test_vocabulary_and_sizes_match_llama_cpp(ours, ref):
    assert (ours.n_ctx(), ours.n_vocab(), ours.n_embd()) == (ref.n_ctx(), ref.n_vocab(), ref.n_embd())
    assert (ours.token_bos(), ours.token_eos(), ours.token_nl()) == (ref.token_bos(), ref.token_eos(), ref.token_nl())
    assert ours.metadata == ref.metadata
    assert ours.pooling_type() == 0  # NONE, as llama.cpp for a decoder model


def test_save_state_generate_load_state_generate(ours):
    prompt = PROMPTS[1]
    ours.create_completion(prompt, max_tokens=4, **GREEDY)  # leaves the prompt in the KV cache
    state = ours.save_state()
    assert state.n_tokens == ours.n_tokens > 0
    assert list(state.input_ids[: state.n_tokens]) == list(ours.input_ids[: ours.n_tokens])
    assert state.llama_state_size == len(state.llama_state) > 0
    # Sampled (seed derived from the saved one), continuing from the restored cache.
    first = ours.create_completion(prompt + " there was", max_tokens=16, temperature=0.9)
    ours.create_completion("Something else entirely, to overwrite the cache", max_tokens=4, **GREEDY)
    ours.load_state(pickle.loads(pickle.dumps(state)))  # LlamaDiskCache pickles states
    assert ours.n_tokens == state.n_tokens
    second = ours.create_completion(prompt + " there was", max_tokens=16, temperature=0.9)
    assert _text(second) == _text(first)
    assert second["usage"] == first["usage"]


def test_prompt_cache(ours):
    from powerinfer_py import LlamaRAMCache

    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    loads = []
    original_load = ours.load_state
    ours.set_cache(cache)
    try:
        ours.load_state = lambda state: (loads.append(state.n_tokens), original_load(state))[1]
        want = _text(ours(PROMPTS[2], max_tokens=12, **GREEDY))
        assert cache.cache_size > 0
        ours(PROMPTS[3], max_tokens=4, **GREEDY)  # another prompt takes the KV cache
        assert _text(ours(PROMPTS[2], max_tokens=12, **GREEDY)) == want
        assert loads, "the cached state of the first prompt was not restored"
    finally:
        del ours.load_state
        ours.set_cache(None)


def test_full_prompt_cached_samples_without_decoding(ours):
    tokens = ours.tokenize(PROMPTS[0].encode(), add_bos=True, special=True)
    ours.reset()
    ours.eval(tokens)
    ours.reset_timings()
    gen = ours.generate(tokens, temp=0.0)
    first = next(gen)
    gen.close()
    timings = ours.timings()
    assert timings["n_prompt"] == 0 and timings["n_eval"] == 0
    assert first == ours.tokenize(_text(ours(PROMPTS[0], max_tokens=1, **GREEDY)).encode(), add_bos=False)[0]


# ---- embeddings ----------------------------------------------------------------------------

# The core runs llama.cpp's kernels on the same weights, so the hidden states are equal
# today. The bound allows one Q8_1 activation-rounding flip per block (1/127 of a block's
# largest value) from a different accumulation order; a wrong layer or norm is O(1).
EMBD_REL_TOL = 1e-2


@pytest.fixture(scope="module")
def embedders(smollm2_path):
    import llama_cpp

    from powerinfer_py import Llama

    ours = Llama(smollm2_path, embedding=True, fallback=False, **KW)
    ref = llama_cpp.Llama(model_path=smollm2_path, embedding=True, **KW)
    yield ours, ref
    ours.close()
    ref.close()


EMBED_TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_embeddings_match_llama_cpp(embedders):
    ours, ref = embedders
    assert ours.pooling_type() == ref.pooling_type() == 0
    for text in EMBED_TEXTS:
        got, want = ours.embed(text), ref.embed(text)
        assert np.shape(got) == np.shape(want) == (len(ours.tokenize(text.encode())), ours.n_embd())
        assert _rel(got, want) < EMBD_REL_TOL
        got_n = np.asarray(ours.embed(text, normalize=True))
        assert np.allclose(np.linalg.norm(got_n, axis=-1), 1.0)
        assert _rel(got_n, ref.embed(text, normalize=True)) < EMBD_REL_TOL
    # A list gives the same vectors as one input at a time. (Upstream packs the list into
    # one batch and, with pooling NONE, reads later inputs at a wrong offset.)
    many = ours.embed(EMBED_TEXTS)
    for text, vectors in zip(EMBED_TEXTS, many):
        assert np.array_equal(np.asarray(vectors), np.asarray(ours.embed(text)))
    got, want = ours.create_embedding(EMBED_TEXTS[0]), ref.create_embedding(EMBED_TEXTS[0])
    assert _shape(got) == _shape(want)
    assert got["usage"] == want["usage"]
    # Embedding leaves generation usable.
    assert ours.n_tokens == 0
    assert _text(ours(PROMPTS[0], max_tokens=4, **GREEDY)) == _text(ref(PROMPTS[0], max_tokens=4, **GREEDY))


def test_mean_pooling_matches_llama_cpp(smollm2_path):
    import llama_cpp

    from powerinfer_py import Llama

    with Llama(smollm2_path, embedding=True, pooling_type=1, fallback=False, **KW) as ours:
        ref = llama_cpp.Llama(model_path=smollm2_path, embedding=True, pooling_type=1, **KW)
        try:
            got, want = ours.embed(EMBED_TEXTS[1]), ref.embed(EMBED_TEXTS[1])
            assert np.shape(got) == np.shape(want) == (ours.n_embd(),)
            assert _rel(got, want) < EMBD_REL_TOL
        finally:
            ref.close()


def test_embed_needs_embedding_mode(ours):
    with pytest.raises(RuntimeError, match="embedding=True"):
        ours.embed("hello")


# ---- construction, parameters, compat ------------------------------------------------------


def test_unknown_kwargs_are_ignored(smollm2_path):
    from powerinfer_py import Llama

    # LangChain's LlamaCpp passes these; llama-cpp-python ignores them.
    with Llama(smollm2_path, n_parts=-1, f16_kv=True, device="cpu", use_mlock=False, fallback=False, **KW) as llm:
        assert llm.engine == "powerinfer"
        assert _text(llm("Hello", max_tokens=2, **GREEDY))


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        # SmolLM2 is a standard SiLU GGUF: no ffn_down_t, no predictors.
        (dict(sparse_mode="gate"), "gate mode needs"),  # an error, not a fallback
        (dict(sparse_mode="predictor"), "predictor mode needs"),
        (dict(sparse_mode="sparse"), "sparse_mode must be one of"),
        (dict(sparse_threshold=float("nan")), "sparse_threshold"),
        (dict(vram_budget=-1.0), "vram_budget"),
        (dict(n_ctx=-1), "n_ctx"),
        (dict(n_batch=0), "n_batch"),
        (dict(lora_path="/nonexistent.gguf", fallback=False), "LoRA"),
    ],
)
def test_bad_constructor_parameters(smollm2_path, kwargs, pattern):
    from powerinfer_py import Llama

    with pytest.raises(ValueError, match=pattern):
        Llama(smollm2_path, verbose=False, **kwargs)


def test_extra_parameters_are_kept(smollm2_path):
    from powerinfer_py import Llama

    with Llama(smollm2_path, sparse_mode="dense", sparse_threshold=0.5, vram_budget=2.0, vocab_only=True,
               verbose=False) as llm:
        assert (llm.sparse_mode, llm.sparse_threshold, llm.vram_budget) == ("dense", 0.5, 2.0)
        clone = pickle.loads(pickle.dumps(llm))  # __getstate__ gives the constructor arguments
        try:
            assert clone.sparse_mode == "dense" and clone.tokenize(b"hi") == llm.tokenize(b"hi")
        finally:
            clone.close()


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(top_p=-0.5), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=math.nan), "temperature"),
        (dict(repeat_penalty=0.0), "repeat penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logit_bias={10**7: 1.0}), "logit_bias"),
        (dict(grammar='start ::= "a"'), "grammar"),  # no root rule (upstream: NULL sampler in the chain)
    ],
)
def test_bad_sampling_parameters_raise_value_error(ours, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ours.create_completion(PROMPTS[0], max_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        list(ours.create_completion(PROMPTS[0], max_tokens=2, stream=True, **kwargs))
    # The instance stays usable.
    assert ours(PROMPTS[0], max_tokens=2, **GREEDY)["usage"]["completion_tokens"] == 2


def test_parameters_upstream_accepts(ours, ref):
    # top_p > 1 disables top-p, negative max_tokens means "until the context is full"
    # (here: until the end of turn), stop=None means no stop strings: as upstream.
    prompt = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
    for kwargs in (dict(top_p=2.0, max_tokens=8), dict(max_tokens=-1), dict(max_tokens=None, stop=None)):
        assert ours(prompt, **GREEDY, **kwargs)["choices"] == ref(prompt, **GREEDY, **kwargs)["choices"], kwargs


def test_module_level_names():
    import llama_cpp.llama
    import llama_cpp.llama_cache
    import llama_cpp.llama_chat_format
    import llama_cpp.llama_grammar
    import llama_cpp.llama_types

    import powerinfer_py
    from powerinfer_py import llama_chat_format, llama_types

    assert powerinfer_py.LlamaGrammar is llama_cpp.llama_grammar.LlamaGrammar
    assert powerinfer_py.LlamaRAMCache is llama_cpp.llama_cache.LlamaRAMCache
    assert powerinfer_py.LlamaCache is llama_cpp.llama_cache.LlamaCache
    assert powerinfer_py.LlamaDiskCache is llama_cpp.llama_cache.LlamaDiskCache
    assert powerinfer_py.LogitsProcessorList is llama_cpp.llama.LogitsProcessorList
    assert powerinfer_py.StoppingCriteriaList is llama_cpp.llama.StoppingCriteriaList
    assert llama_types is llama_cpp.llama_types and llama_chat_format is llama_cpp.llama_chat_format
    import powerinfer_py.llama_grammar

    assert powerinfer_py.llama_grammar is llama_cpp.llama_grammar
    from powerinfer_py.llama import LlamaState

    assert LlamaState is llama_cpp.llama.LlamaState


def test_import_is_cheap():
    code = "import sys, powerinfer_py; assert 'llama_cpp' not in sys.modules and 'powerinfer_py.llama' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("how", ["function", "module"])
def test_install_as_llama_cpp(smollm2_path, how):
    switch = "powerinfer_py.install_as_llama_cpp()" if how == "function" else "import powerinfer_py.compat"
    script = textwrap.dedent(
        f"""
        import powerinfer_py
        {switch}
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama import Llama as Llama2, LlamaGrammar, LogitsProcessorList, StoppingCriteriaList
        from llama_cpp.llama_cache import LlamaRAMCache
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        import llama_cpp.llama_chat_format as chat_format, llama_cpp.llama_types as llama_types
        from llama_cpp import llama_grammar
        assert llama_cpp.Llama is powerinfer_py.Llama is Llama is Llama2
        assert llama_cpp.llama.Llama is powerinfer_py.Llama
        assert llama_cpp.__version__ == "0.3.36" and llama_cpp.llama_cpp.LLAMA_DEFAULT_SEED == 0xFFFFFFFF
        assert isinstance(llama_grammar.LlamaGrammar.from_string('root ::= "a"', verbose=False), LlamaGrammar)
        # Our internals still reach llama-cpp-python itself.
        from powerinfer_py._llama import upstream as _upstream
        assert _upstream.llama_module().Llama is not powerinfer_py.Llama
        llm = llama_cpp.Llama(model_path={smollm2_path!r}, n_ctx=256, n_threads=2, verbose=False, n_parts=-1)
        assert llm.engine == "powerinfer"
        print(llm("The capital of France is", max_tokens=4, temperature=0)["choices"][0]["text"])
        print(llm.create_chat_completion([{{"role": "user", "content": "Hi"}}], max_tokens=4)["object"])
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout
    assert "chat.completion" in r.stdout


def test_uninstall_restores_llama_cpp():
    script = textwrap.dedent(
        """
        import powerinfer_py, powerinfer_py.compat as compat
        import llama_cpp
        assert llama_cpp.Llama is powerinfer_py.Llama and compat.is_installed()
        compat.uninstall_llama_cpp()
        import llama_cpp
        assert llama_cpp.Llama is not powerinfer_py.Llama and not compat.is_installed()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


class _Rows:
    """A single logits row in the place of a Context (Sampler.sample reads logits(row))."""

    def __init__(self, row):
        self.row = row

    def logits(self, i):
        return self.row


def test_penalties_round_as_libllama_does(ours):
    """The core's penalties (applied to the window's tokens only, and inside the greedy
    shortcut) do libllama's float operations one at a time, as its plain-SSE build does:
    logit * or / repeat, then - (count * freq + present), each rounded to float32 (numpy
    float32 here, which never fuses). Each row puts an unpenalized rival one float32 step
    above or below a penalized token's expected value, so a result off by one step picks
    the other token; the full chain (top_k) and the shortcut must both agree."""
    from powerinfer_py._core import LogitBias, Sampler
    from powerinfer_py._core.bindings import lib

    n = ours.n_vocab()
    rng = np.random.default_rng(1)
    f32 = np.float32
    for trial in range(40):
        repeat, freq, present = f32(rng.uniform(0.5, 2.0)), f32(rng.uniform(0, 1)), f32(rng.uniform(0, 1))
        history = [int(t) for t in rng.integers(0, 200, size=int(rng.integers(1, 40)))]
        bias_token = int(rng.integers(0, 200))
        row = (rng.standard_normal(n) * 2).astype(np.float32) - f32(20.0)  # all far below the contest
        target = history[-1]
        row[target] = f32(rng.uniform(-3, 3))
        v = row[target] + (f32(1.5) if target == bias_token else f32(0))
        v = v * repeat if v <= 0 else v / repeat
        count = history[-64:].count(target)
        expected = f32(v - f32(f32(f32(count) * freq) + present))
        rival = 1000 + trial
        above = bool(trial % 2)
        row[rival] = np.nextafter(expected, f32(np.inf) if above else f32(-np.inf), dtype=np.float32)
        for kind in ("greedy", "chain"):
            # "chain": top-k 1 then a draw, so the candidates are filled and the penalty sampler runs.
            s = Sampler(ours._model, seed=0, temp=0.8 if kind == "chain" else 0.0, top_k=1, top_p=1.0, min_p=0.0,
                        typical_p=1.0, mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, penalty_last_n=64,
                        repeat_penalty=float(repeat), frequency_penalty=float(freq), presence_penalty=float(present),
                        logits_processor=[LogitBias({bias_token: 1.5}, n)])
            for t in history:
                lib.powerinfer_sampler_accept(s.ptr, t)
            got = s.sample(_Rows(row), -1, np.zeros(0, dtype=np.intc))
            assert got == (rival if above else target), (trial, kind, got, target, rival)


def test_greedy_takes_the_first_of_equal_largest_logits(ours):
    """A greedy chain with at most a logit bias and the penalties before it takes the core's
    shortcut (an argmax over the logits, no candidate array): the same rule as libllama's
    greedy sampler, the first of the largest logits, which the full chain also gives (run
    here through a penalty window of more than 512 distinct tokens, where the shortcut
    hands over to the chain)."""
    from powerinfer_py._core import Sampler
    from powerinfer_py._core.bindings import lib

    n = ours.n_vocab()
    rng = np.random.default_rng(0)
    base = dict(seed=0, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, mirostat_mode=0,
                mirostat_tau=5.0, mirostat_eta=0.1, frequency_penalty=0.0, presence_penalty=0.0)
    for trial in range(5):
        row = rng.standard_normal(n).astype(np.float32)
        top = sorted(rng.choice(n, size=3, replace=False))
        row[top] = row.max() + 1.0  # three equal maxima
        low = [int(t) for t in np.argsort(row)[:600]]  # penalized tokens, far from the top
        for penalty, window in ((1.0, 64), (1.0000001, 64), (1.0000001, 1000)):
            s = Sampler(ours._model, repeat_penalty=penalty, penalty_last_n=window, **base)
            for t in low[: 600 if window > 64 else 20]:
                lib.powerinfer_sampler_accept(s.ptr, t)
            assert s.sample(_Rows(row), -1, np.zeros(0, dtype=np.intc)) == top[0], (trial, penalty, window)


# ---- seeds (issue 53, item 2) ----------------------------------------------------------------


def _first_sample(smollm2_path, **llama_kwargs):
    from powerinfer_py import Llama

    with Llama(smollm2_path, **{**KW, "n_ctx": 128, **llama_kwargs}) as llm:
        return [llm.create_completion("Once upon a time", max_tokens=10, temperature=1.0)["choices"][0]["text"]
                for _ in range(2)]


def test_default_seed_is_random_and_an_explicit_seed_repeats(smollm2_path):
    """The default seed (LLAMA_DEFAULT_SEED) started every Llama's seed stream at the same
    value, so two starts of a program drew the same unseeded samples. It now means a random
    seed, like -1; an explicit one (0 included) gives the same samples on every start."""
    from powerinfer_py import Llama
    from powerinfer_py.llama import LLAMA_DEFAULT_SEED

    firsts = {tuple(_first_sample(smollm2_path)) for _ in range(2)}
    firsts.add(tuple(_first_sample(smollm2_path, seed=-1)))
    firsts.add(tuple(_first_sample(smollm2_path, seed=LLAMA_DEFAULT_SEED)))
    assert len(firsts) == 4, firsts
    for seed in (42, 0):
        assert _first_sample(smollm2_path, seed=seed) == _first_sample(smollm2_path, seed=seed)
    with Llama(smollm2_path, **{**KW, "n_ctx": 128}) as llm:
        # A per-call -1 is "unseeded" too: the next seed of the stream, not seed -1.
        texts = {llm.create_completion("Once upon a time", max_tokens=10, temperature=1.0, seed=-1)["choices"][0]["text"]
                 for _ in range(3)}
        assert len(texts) == 3, texts
        for bad in (2**32, 1.5, "7"):
            with pytest.raises(ValueError, match="seed"):
                llm.set_seed(bad)
    with pytest.raises(ValueError, match="seed"):
        Llama(smollm2_path, seed=2**40, **{**KW, "n_ctx": 128})


def test_main_prints_its_random_seed_and_repeats_a_given_one(smollm2_path, cli_path):
    """`main` without -s (llama.cpp's -s -1) samples with a fresh seed each run and prints it,
    so that `-s SEED` repeats the run."""
    def run(*extra):
        r = subprocess.run([str(cli_path), "-m", smollm2_path, "-p", "Once upon a time", "-n", "12", "-t", str(N_THREADS),
                            "-c", "128", "--temp", "1", *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        seed = [line.split("=")[1].strip() for line in r.stderr.splitlines() if line.startswith("seed")]
        assert len(seed) == 1, r.stderr
        return r.stdout, seed[0]

    (text1, seed1), (text2, seed2) = run(), run()
    assert seed1 != seed2 and text1 != text2
    assert run("-s", seed1) == (text1, seed1)
    # Any seed it prints is taken back (half of them are above INT32_MAX, which -s refused).
    assert run("-s", "4000000000") == run("-s", "4000000000")
