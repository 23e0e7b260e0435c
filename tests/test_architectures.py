"""FFN activations and architectures of the sparse path against an independent numpy
forward pass: llama with ReLU and Bamboo (dReLU: relu(gate) * relu(up)). No other
engine runs these here (llama.cpp's llama is SiLU-only and it has no bamboo), so the
reference is numpy on the F32 synthetic weights, for a one-token prompt (attention over
a single position is softmax([s]) = 1, so it reduces to Wo · Wv · x and RoPE drops out).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer_py import Llama
from powerinfer_py.assets.synthetic import PRESETS, generate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("arch")
    return {name: generate(PRESETS[name], out, progress=False) for name in ("tiny", "tiny-bamboo")}


def _tensors(path: str, tmp: Path):
    import gguf

    data = bytearray(Path(path).read_bytes())
    data[:4] = b"GGUF"  # gguf's reader wants the standard magic
    copy = tmp / (Path(path).name + ".as-gguf")
    copy.write_bytes(bytes(data))
    # numpy shape is ggml's reversed: [ne1, ne0] = [out, in] for matrices
    return {t.name: np.array(t.data, dtype=np.float64).reshape([int(x) for x in reversed(t.shape)])
            for t in gguf.GGUFReader(copy).tensors}


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _reference_logits(w, token: int, n_layer: int, act: str):
    h = w["token_embd.weight"][token]
    for il in range(n_layer):
        b = f"blk.{il}."
        x = _rms(h, w[b + "attn_norm.weight"])
        v = w[b + "attn_v.weight"] @ x                                # [n_embd_kv]
        n_rep = w[b + "attn_q.weight"].shape[0] // v.shape[0]        # grouped-query heads share V
        head = w[b + "attn_q.weight"].shape[0] // (PRESETS["tiny"].n_head)
        v = np.repeat(v.reshape(-1, head), n_rep, axis=0).reshape(-1)
        h = h + w[b + "attn_output.weight"] @ v
        f = _rms(h, w[b + "ffn_norm.weight"])
        g, u = w[b + "ffn_gate.weight"] @ f, w[b + "ffn_up.weight"] @ f
        a = np.maximum(g, 0) * (np.maximum(u, 0) if act == "drelu" else u)
        down = w[b + "ffn_down.weight"] if b + "ffn_down.weight" in w else w[b + "ffn_down_t.weight"].T
        h = h + down @ a
    return w["output.weight"] @ _rms(h, w["output_norm.weight"])


@pytest.mark.parametrize("name,act", [("tiny", "relu"), ("tiny-bamboo", "drelu")])
@pytest.mark.parametrize("mode", ["dense", "gate", "predictor"])
def test_one_token_logits_match_numpy(models, tmp_path, name, act, mode):
    path = models[name]["powerinfer"]
    w = _tensors(path, tmp_path)
    llm = Llama(model_path=path, n_ctx=256, sparse_mode=mode, verbose=False)
    assert llm.ffn_activation() == act
    for token in (5, 100, 260):
        llm.reset()
        llm.eval([token])
        got = np.array(llm._last_logits_view(), dtype=np.float64)
        ref = _reference_logits(w, token, PRESETS[name].n_layer, act)
        # F32 weights; ggml sums in another order and keeps F32 activations: 1e-4 of the scale.
        assert np.max(np.abs(got - ref)) <= 1e-4 * np.max(np.abs(ref)), (token, np.max(np.abs(got - ref)))
    llm.close()


def test_bamboo_sparse_modes_match_dense(models):
    path = models["tiny-bamboo"]["powerinfer"]
    out = {}
    for mode in ("dense", "gate", "predictor"):
        llm = Llama(model_path=path, n_ctx=256, sparse_mode=mode, verbose=False)
        out[mode] = llm.create_completion("the cat sat on", max_tokens=16, temperature=0)["choices"][0]["text"]
        llm.close()
    assert out["gate"] == out["dense"] == out["predictor"]


def test_bamboo_standard_gguf_loads(models):
    """A standard-magic bamboo file: libllama gets its tokenizer under the llama name."""
    llm = Llama(model_path=models["tiny-bamboo"]["dense"], n_ctx=256, verbose=False)
    assert llm.ffn_activation() == "drelu" and llm.sparse_mode_in_use() == "dense"
    assert llm.tokenize(b"the cat") == Llama(model_path=models["tiny-bamboo"]["powerinfer"], n_ctx=256,
                                             verbose=False).tokenize(b"the cat")


# ---- Falcon: LayerNorm, fused QKV, multi-query attention, parallel attention + FFN -------

@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    from powerinfer_py.assets.synthetic import generate_falcon

    return generate_falcon(tmp_path_factory.mktemp("falcon"))


def test_falcon_dense_matches_llama_cpp(falcon):
    """llama.cpp runs Falcon (GELU): same graph, same kernels, so the logits agree exactly."""
    import llama_cpp

    ref = llama_cpp.Llama(model_path=falcon["dense"], n_ctx=256, logits_all=True, verbose=False)
    ours = Llama(model_path=falcon["dense"], n_ctx=256, logits_all=True, verbose=False)
    assert ours.ffn_activation() == "gelu"
    toks = ref.tokenize(b"the cat sat on the mat and the dog")
    assert ours.tokenize(b"the cat sat on the mat and the dog") == toks
    ref.eval(toks)
    ours.eval(toks)
    a, b = np.array(ref.scores[: len(toks)]), np.array(ours.scores[: len(toks)])
    np.testing.assert_array_equal(a, b)
    # Token by token (another matmul kernel than the batch): F32 rounding only.
    ours.reset()
    for t in toks:
        ours.eval([t])
    b = np.array(ours.scores[: len(toks)])
    assert np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(a))


@pytest.mark.parametrize("budget_share", [None, 0.5])
def test_falcon_predictor_matches_dense(falcon, budget_share):
    """PWRI Falcon (ReLU) with its exact predictor: the same tokens as dense, on the CPU
    and split with the device emulated. Log-probabilities agree to 1e-4 on the CPU (the
    same attention op); the split graph attends with ggml's flash attention, which sums V
    in fp16 (2^-11 relative), where the CPU's pi_attention sums in fp32: measured up to
    8e-4 apart on this model, so 2e-3 there."""
    path = falcon["powerinfer"]

    def run(mode, **kw):
        llm = Llama(model_path=path, n_ctx=256, n_batch=32, sparse_mode=mode, logits_all=True, verbose=False, **kw)
        out = llm.create_completion("the cat sat on", max_tokens=16, temperature=0, logprobs=1)
        place = llm.placement()
        llm.close()
        return out["choices"][0], place

    dense, _ = run("dense")
    kw = {}
    if budget_share is not None:
        whole, p = run("predictor", vram_budget=1.0, emulate_device=True, reset_gpu_index=True)
        assert p["n_hot"] == p["n_neurons"]
        budget = p["bytes_total"] - p["bytes_ffn"] + int(budget_share * p["bytes_ffn"]) + (64 << 10)
        kw = dict(vram_budget=budget / 2**30, emulate_device=True, reset_gpu_index=True)
    pred, p = run("predictor", **kw)
    assert pred["text"] == dense["text"]
    np.testing.assert_allclose(pred["logprobs"]["token_logprobs"], dense["logprobs"]["token_logprobs"],
                               atol=1e-4 if budget_share is None else 2e-3)
    if budget_share is not None:
        assert p["active"] and 0 < p["n_hot"] < p["n_neurons"] and p["bytes_total"] <= p["budget"]
