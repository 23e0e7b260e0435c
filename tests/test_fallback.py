"""An architecture the core does not implement runs on llama-cpp-python's dense
engine behind the same `Llama` API (a tiny random-weight GPT-2 built with gguf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

GREEDY = dict(temperature=0.0, top_k=1, repeat_penalty=1.0)


def _tiny_gpt2(path: Path) -> Path:
    n_embd, n_ff, n_head, n_ctx = 16, 32, 2, 64
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>", "\u2581", "a", "b", "\u2581a", "\u2581b", "ab"]
    T = gguf.TokenType
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL, T.BYTE] + [T.NORMAL] * 6
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 4 + [-1.0, -2.0, -2.0, -1.5, -1.5, -3.0])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)

    def rand(*shape):  # numpy shape = reversed ggml ne
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)

    ones, zeros = (lambda n: np.ones(n, np.float32)), (lambda n: np.zeros(n, np.float32))
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("position_embd.weight", rand(n_ctx, n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    w.add_tensor("output_norm.bias", zeros(n_embd))
    w.add_tensor("output.weight", rand(n_vocab, n_embd))
    for name, shape in [
        ("attn_norm", (n_embd, None)),
        ("attn_qkv", (3 * n_embd, n_embd)),
        ("attn_output", (n_embd, n_embd)),
        ("ffn_norm", (n_embd, None)),
        ("ffn_up", (n_ff, n_embd)),
        ("ffn_down", (n_embd, n_ff)),
    ]:
        rows, cols = shape
        w.add_tensor(f"blk.0.{name}.weight", ones(rows) if cols is None else rand(rows, cols))
        w.add_tensor(f"blk.0.{name}.bias", zeros(rows))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    return str(_tiny_gpt2(tmp_path_factory.mktemp("fallback") / "tiny-gpt2.gguf"))


def test_core_refuses_and_names_the_architecture(tiny_gpt2):
    from powerinfer_py import Llama, PowerInferError

    with pytest.raises(PowerInferError, match=r"gpt2"):
        Llama(tiny_gpt2, n_ctx=64, n_threads=2, fallback=False, verbose=False)


def test_fallback_runs_on_llama_cpp(tiny_gpt2):
    import llama_cpp

    from powerinfer_py import Llama

    with Llama(tiny_gpt2, n_ctx=64, n_threads=2, verbose=False) as ours:
        assert ours.engine == "llama-cpp-python"
        ref = llama_cpp.Llama(model_path=tiny_gpt2, n_ctx=64, n_threads=2, verbose=False)
        try:
            assert ours.metadata["general.architecture"] == "gpt2"
            assert ours.n_vocab() == ref.n_vocab() == 10
            assert ours.tokenize(b"a b ab") == ref.tokenize(b"a b ab")
            got = ours.create_completion("a b", max_tokens=8, **GREEDY)
            want = ref.create_completion("a b", max_tokens=8, **GREEDY)
            assert got["choices"] == want["choices"]
            assert got["usage"] == want["usage"]
        finally:
            ref.close()


def test_fallback_serves_the_whole_api(tiny_gpt2):
    """Every Llama method and attribute reaches the wrapped llama_cpp.Llama on the fallback."""
    import llama_cpp

    from powerinfer_py import Llama

    calls = []

    def chat_handler(llama, messages, **kwargs):
        # The toy vocabulary cannot tokenize a real chat template; record the call instead.
        calls.append((llama, messages, kwargs["grammar"]))
        return {"object": "chat.completion"}

    with Llama(tiny_gpt2, n_ctx=64, n_threads=2, verbose=False, n_parts=-1, chat_handler=chat_handler) as ours:
        assert ours.engine == "llama-cpp-python"
        assert isinstance(ours._fallback, llama_cpp.Llama)
        tokens = ours.tokenize(b"a b", add_bos=True)
        assert ours.detokenize(tokens) == b"a b"
        assert (ours.n_vocab(), ours.token_bos(), ours.token_eos()) == (10, 1, 2)
        assert ours.n_ctx() == ours._fallback.n_ctx()
        assert ours.token_nl() == ours._fallback.token_nl()
        chunks = list(ours.create_completion("a b", max_tokens=4, stream=True, **GREEDY))
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        state = ours.save_state()
        first = ours.create_completion("a b a", max_tokens=6, temperature=0.8)
        ours.load_state(state)
        assert ours.create_completion("a b a", max_tokens=6, temperature=0.8)["choices"] == first["choices"]
        assert ours.n_tokens == ours._fallback.n_tokens
        assert ours.chat_handler is chat_handler
        schema_format = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
        chat = ours.create_chat_completion([{"role": "user", "content": "a"}], response_format=schema_format)
        assert chat["object"] == "chat.completion"
        assert calls[0][0] is ours._fallback and calls[0][2] is not None  # json_schema became a grammar
        gen = ours.generate(tokens, temp=0.0)
        assert 0 <= next(gen) < 10
        gen.close()
        ours.reset()
        assert ours.n_tokens == 0
        assert ours.token_to_piece(7) == ours._fallback.detokenize([7])
        ours.reset_timings()
        ours.create_completion("a b", max_tokens=2, **GREEDY)
        assert ours.timings()["n_eval"] >= 1


def test_gemma3_runs_on_the_fallback_engine(gemma_path):
    """A real model of an architecture the core does not build (Gemma-3-270M, gemma3, its
    262144-token vocabulary) gives llama-cpp-python's greedy text through our Llama."""
    import llama_cpp

    from powerinfer_py import Llama

    prompt = "The capital of France is"
    with Llama(gemma_path, n_ctx=128, n_threads=2, verbose=False) as ours:
        assert ours.engine == "llama-cpp-python"
        assert ours.metadata["general.architecture"] == "gemma3"
        got = ours.create_completion(prompt, max_tokens=8, **GREEDY)
    ref = llama_cpp.Llama(model_path=gemma_path, n_ctx=128, n_threads=2, verbose=False)
    try:
        want = ref.create_completion(prompt, max_tokens=8, **GREEDY)
    finally:
        ref.close()
    assert got["choices"] == want["choices"]
    assert "France" in got["choices"][0]["text"]  # real weights: a sensible continuation
