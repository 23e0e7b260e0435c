"""The offline pipeline (profile -> train-predictor -> convert, relufy) on the tiny synthetic model."""

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from powerinfer_py.formats import pt_io
from powerinfer_py.pipeline import cli
from powerinfer_py.pipeline.common import spread_pieces, tokenize_texts
from powerinfer_py.formats.gguf_io import KEY_STATS_N_TOKENS, KEY_THRESHOLDS, field, open_gguf, tensor_f32
from powerinfer_py.pipeline.convert import convert, permute_qk, unpermute_qk, write_safetensors
from powerinfer_py.assets.synthetic import PRESETS, generate
from powerinfer_py.pipeline.train_predictor import choose_ranks, recall_precision, threshold_for_recall

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. If music be the food of love, play on. ") * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe")
    paths = generate(PRESETS["tiny"], d / "model", progress=False)
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT)
    return {"dir": d, "gguf": paths["dense"], "corpus": str(corpus)}


def _llama(path, **kw):
    from powerinfer_py import Llama

    return Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False, **kw)


# The engine against the float64 numpy reference (tests/numpy_llama.py), relative to the
# largest logit. F32 weights: float32 summation order only (~n * eps), as in
# test_sparse_engine.py. F16 weights: two roundings to 11 significant bits (2**-11 relative)
# per product, the weight's and the activation's (ggml's F16 dot products round it too).
TOL_F32 = 1e-4
TOL_F16 = 2 * 2.0**-11


def _completion_and_greedy(llm, prompt: str, max_tokens: int):
    """create_completion's greedy text, and the tokens it consists of with the logits each
    was chosen from (generate() from an empty cache, the path create_completion takes).
    With this byte-level vocabulary a completion may run past max_tokens to finish a
    UTF-8 character, so the token count is read from its usage."""
    llm.reset()
    got = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0)
    n = got["usage"]["completion_tokens"]
    assert n >= max_tokens and got["choices"][0]["finish_reason"] == "length"
    prompt_tokens = llm.tokenize(prompt.encode())
    rows = []

    def record(_input_ids, logits):
        rows.append(np.array(logits, dtype=np.float64))
        return False

    llm.reset()
    gen = llm.generate(prompt_tokens, temp=0.0, top_k=1, repeat_penalty=1.0, stopping_criteria=record)
    try:
        ids = [int(t) for t in itertools.islice(gen, n)]
    finally:
        gen.close()
    text = llm.detokenize(ids, prev_tokens=prompt_tokens).decode("utf-8", errors="ignore")
    assert got["choices"][0]["text"] == text
    return prompt_tokens, ids, np.array(rows)


def _assert_greedy_follows(ids, rows, ref_rows, tol):
    """Our logits along our greedy tokens within tol of the reference's on the same tokens,
    and each token the reference's best but for a near-tie within 2 * tol."""
    scale = np.abs(ref_rows).max()
    err = np.abs(rows - ref_rows).max()
    assert err <= tol * scale, f"max |logit - reference| {err:.3g}, {err / scale:.3g} of the largest"
    for i, (t, r) in enumerate(zip(ids, ref_rows)):
        assert r[t] >= r.max() - 2 * tol * scale, f"step {i}: token {t}, {r.max() - r[t]:.3g} below the best"


# ---------------------------------------------------------------- metrics

def test_spread_pieces_sample_the_whole_corpus():
    # three documents of distinct lines: the pieces come from all of them, in order, each
    # from a line's start and of the asked length
    docs = ["".join(f"{name} line {i:04d}\n" for i in range(400)) for name in ("alpha", "beta", "gamma")]
    pieces = spread_pieces(docs, 6, 100)
    assert pieces is not None and len(pieces) == 6
    assert [p.split()[0] for p in pieces] == ["alpha", "alpha", "beta", "beta", "gamma", "gamma"]
    for p in pieces:
        assert len(p) == 100 and p.split("\n")[0] in "".join(docs).split("\n")
    # places evenly spaced: the first from the first sixth, not the corpus's start
    assert pieces[0] != docs[0][:100]
    # a corpus too short to sample is taken whole by the callers
    assert spread_pieces(["short text"], 4, 100) is None
    assert spread_pieces(docs, 0, 100) is None


def test_recall_precision_hand_cases():
    logits = np.array([[2.0, -1.0, 0.5, -3.0], [0.1, 0.2, -0.2, 1.0]])
    mask = np.array([[1, 0, 0, 0], [1, 0, 1, 1]], dtype=bool)
    # >= 0 predicts (0,0) (0,2) (1,0) (1,1) (1,3): tp = 3 of 4 positives, 3 of 5 predicted
    assert recall_precision(logits, mask, 0.0) == (0.75, 0.6)
    # >= -0.5 adds (1,2): all 4 positives, 4 of 6 predicted
    assert recall_precision(logits, mask, -0.5) == (1.0, 4 / 6)
    # a logit equal to the threshold counts as predicted (PowerInfer skips iff logit < t):
    # >= 1.0 predicts (0,0) and (1,3), both positives
    assert recall_precision(logits, mask, 1.0) == (0.5, 1.0)
    # nothing predicted: precision 1 by convention; no positives: recall 1
    assert recall_precision(logits, mask, 10.0) == (0.0, 1.0)
    assert recall_precision(logits, np.zeros_like(mask), 0.0) == (1.0, 0.0)


def test_threshold_for_recall_meets_target():
    rng = np.random.default_rng(0)
    mask = rng.random((400, 64)) < 0.1
    logits = rng.standard_normal(mask.shape) + 2.0 * mask  # informative but noisy
    for target in (0.5, 0.9, 0.95, 0.99, 1.0):
        t = threshold_for_recall(logits, mask, target)
        rec, _ = recall_precision(logits, mask, t)
        assert rec >= target
        # the largest such threshold but for a float32 step: just above the lowest positive
        # kept, recall falls below the target
        if target < 1.0:
            kept = np.min(logits[mask][logits[mask] >= t])
            assert kept - t < 1e-6
            assert recall_precision(logits, mask, np.nextafter(kept, np.inf))[0] < target
    with pytest.raises(ValueError):
        threshold_for_recall(logits, mask, 0.0)


def test_rank_rule_respects_budget():
    ranks = choose_ranks([0.05, 0.2, 0.45], n_embd=576, n_ff=1536, budget=3 * 160 * (576 + 1536))
    assert all(r % 32 == 0 and 32 <= r <= 576 for r in ranks)
    assert ranks[0] < ranks[1] < ranks[2]  # denser layers get more rank
    assert sum(ranks) * (576 + 1536) <= 3 * 160 * (576 + 1536)
    assert choose_ranks([0.1, 0.2], 64, 256, rank=48) == [48, 48]
    with pytest.raises(ValueError, match="minimum"):
        choose_ranks([0.1], 64, 256, budget=100)


# ---------------------------------------------------------------- end to end

def test_profile_train_convert_generate(tiny, capsys):
    d = tiny["dir"]
    prof, pred, out = d / "prof", d / "pred", d / "tiny.powerinfer.gguf"
    assert cli.main(["profile", tiny["gguf"], "--corpus", tiny["corpus"], "--n-tokens", "1500", "--samples", "800",
                     "--ctx", "128", "--out", str(prof)]) == 0
    report = capsys.readouterr().out
    assert "mean sparsity" in report and "top 10%" in report
    meta = json.loads((prof / "profile.json").read_text())
    planted = json.loads((Path(tiny["gguf"]).parent / "tiny-relu.stats.json").read_text())
    for layer, p in zip(meta["layers"], planted["layers"]):  # the planted ~10% firing rate is what we measure
        assert abs((1 - layer["sparsity"]) - p["planted_active_frac"]) < 0.05
    counts = pt_io.read_activation_dir(prof / "activation", n_layer=2)
    assert counts[0].shape == (256,) and counts[0].sum() > 0 and counts[0].max() <= meta["n_tokens"]

    assert cli.main(["train-predictor", "--samples", str(prof), "--model", tiny["gguf"], "--target-recall", "0.95",
                     "--out", str(pred)]) == 0
    tj = json.loads((pred / "thresholds.json").read_text())
    assert len(tj["sparse_thresholds"]) == 2 and tj["sparse_threshold"] == min(tj["sparse_thresholds"])
    for layer in tj["layers"]:  # held-out test pairs, thresholds chosen on separate calibration pairs
        assert layer["recall"] >= 0.90 and layer["precision"] > 0.3
    fc1, fc2 = pt_io.read_predictor_dir(pred, 2)[0]
    assert fc1.shape == (32, 64) and fc2.shape == (256, 32)

    assert cli.main(["convert", tiny["gguf"], "--predictors", str(pred), "--stats", str(prof), "--outtype", "q8_0",
                     "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"PWRI"
    r = open_gguf(out)
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_down_t.weight" in names and "blk.0.ffn_down.weight" not in names
    assert {"blk.1.fc1.weight", "blk.1.fc2.weight", "blk.1.ffn_act_count"} <= names
    assert list(field(r, KEY_THRESHOLDS)) == pytest.approx(tj["sparse_thresholds"])
    assert field(r, KEY_STATS_N_TOKENS) == meta["n_tokens"]
    assert field(r, "powerinfer.ffn_activation") == "relu"
    stats = {t.name: np.array(t.data) for t in r.tensors if t.name.endswith("ffn_act_count")}
    np.testing.assert_array_equal(stats["blk.0.ffn_act_count"], counts[0].astype(np.float32))

    # Predictor mode computes exactly the neurons the trained predictor selects. The
    # reference shares no code with the engine or convert: tests/numpy_llama.py's float64
    # forward pass of the ORIGINAL F32 model, each FFN masked to the neurons whose
    # fc2 . relu(fc1 . x) >= the layer's threshold, read from train-predictor's files. An F32
    # conversion of the same inputs leaves float32 rounding as the only difference.
    from numpy_llama import forward, read_f32_model

    f32 = d / "tiny.f32.powerinfer.gguf"
    assert cli.main(["convert", tiny["gguf"], "--predictors", str(pred), "--stats", str(prof), "--outtype", "f32",
                     "--out", str(f32)]) == 0
    tensors, hp = read_f32_model(tiny["gguf"], d)
    predictors, thresholds = pt_io.read_predictor_dir(pred, 2), tj["sparse_thresholds"]
    n_prompt = 4  # "In" with BOS: decoded as one batch, then one token per decode
    margins, expected = [], []  # expected: per layer, (active, considered) neurons

    def predicted(il, x_res):
        fc1, fc2 = (a.astype(np.float64) for a in predictors[il])
        logit = np.maximum(x_res @ fc1.T, 0) @ fc2.T
        margins.append(np.abs(logit - thresholds[il]).min())
        mask = logit >= thresholds[il]
        # docs/formats.md: the prompt's batch holds position 0, so it takes every neuron;
        # each later token is one sparse decode, whose counters count what the mask selects
        mask[:n_prompt] = True
        expected.append((int(mask[n_prompt:].sum()), mask[n_prompt:].size))
        return mask.astype(np.float64)

    llm = _llama(f32, sparse_mode="predictor")
    assert llm.sparse_mode_in_use() == "predictor"
    llm.reset_timings()
    prompt, ids, rows = _completion_and_greedy(llm, "In", 8)
    assert len(prompt) == n_prompt
    seq = prompt + ids[:-1]  # what generate() decoded
    engine_counts = [llm._ctx.sparse_stats(il) for il in range(2)]
    masked = forward(tensors, hp, seq, predicted)
    dense_ref = forward(tensors, hp, seq)
    _assert_greedy_follows(ids, rows, masked[n_prompt - 1 :], TOL_F32)
    # the mask matters: computing every neuron would be far outside the tolerance
    assert np.abs(dense_ref - masked)[n_prompt - 1 :].max() > 100 * TOL_F32 * np.abs(masked).max()
    # The engine computed exactly the neurons the reference selects in every decode of both
    # runs (create_completion's and generate()'s); the dense prompt batch is no sparse step
    # and counts nothing (measured alone). No predictor logit of the reference lies within
    # float32 reach of its threshold.
    assert min(margins) > 1e-5, min(margins)
    alone = _llama(f32, sparse_mode="predictor")
    alone.eval(prompt)
    assert [alone._ctx.sparse_stats(il) for il in range(2)] == [(0, 0), (0, 0)]
    assert engine_counts == [(2 * a, 2 * c) for a, c in expected]

    # The Q8_0 file (8-bit weights, and activations rounded to 8 bits before each product)
    # follows the predictor's mask too: its logits along the same tokens are much closer to
    # the masked reference than computing every neuron is.
    q8 = _llama(out, sparse_mode="predictor")
    q8.reset()
    q8_rows = []
    for t in seq:
        q8.eval([t])
        q8_rows.append(np.array(q8._last_logits_view(), dtype=np.float64))
    q8_rows = np.array(q8_rows)
    assert np.abs(q8_rows - masked).max() < 0.5 * np.abs(dense_ref - masked).max()


# ---------------------------------------------------------------- convert

def _hf_dir_from_gguf(gguf_path, d: Path, n_head=4, n_head_kv=2):
    """A Hugging Face llama directory holding the synthetic model's weights (q/k un-permuted
    back to HF's layout) and a small byte-level BPE tokenizer with the same vocabulary size."""
    r = open_gguf(gguf_path)
    w = {t.name: tensor_f32(t) for t in r.tensors}
    n_vocab, n_embd = w["token_embd.weight"].shape
    hf = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
          "lm_head.weight": w["output.weight"]}
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(2):
        for g, h in names.items():
            a = w[f"blk.{i}.{g}.weight"]
            if g == "attn_q":
                a = unpermute_qk(a, n_head)
            elif g == "attn_k":
                a = unpermute_qk(a, n_head_kv)
            hf[f"model.layers.{i}.{h}.weight"] = a
    d.mkdir(parents=True, exist_ok=True)
    half = len(hf) // 2  # two shards, to exercise reading several files
    items = list(hf.items())
    write_safetensors(d / "model-00001-of-00002.safetensors", dict(items[:half]))
    write_safetensors(d / "model-00002-of-00002.safetensors",
                      {k: v.astype(np.float16) if v.ndim == 2 and "embed" not in k else v for k, v in items[half:]})
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": int(n_embd),
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "hidden_act": "relu", "tie_word_embeddings": False}))
    # byte-level BPE: the 256 GPT-2 byte symbols, merges up to n_vocab - 3, then 3 specials
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    sym = [chr(c) for c in cs]
    vocab = {s: i for i, s in enumerate(sym)}
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("Ġ", "o"), ("e", "r"), ("o", "n"),
                 ("a", "n"), ("Ġ", "s")][: n_vocab - 3 - 256]:
        vocab[a + b] = len(vocab)
        merges.append(f"{a} {b}")
    specials = ["<unk>", "<s>", "</s>"]
    tok = {"model": {"type": "BPE", "vocab": vocab, "merges": merges},
           "decoder": {"type": "ByteLevel"},
           "added_tokens": [{"id": len(vocab) + i, "content": s, "special": True} for i, s in enumerate(specials)]}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return d


def test_permutation_round_trip():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 2), 2), w)
    # HF pairs (i, i + hd/2) become adjacent rows (2i, 2i + 1) within each head
    p = permute_qk(w, 2)
    np.testing.assert_array_equal(p[0], w[0])
    np.testing.assert_array_equal(p[1], w[2])


def test_convert_round_trip_safetensors_and_gguf(tiny):
    d = tiny["dir"]
    hf = _hf_dir_from_gguf(tiny["gguf"], d / "hf")
    a_path, b_path = str(d / "from_hf.powerinfer.gguf"), str(d / "from_gguf.powerinfer.gguf")
    convert(str(hf), a_path, outtype="f16")
    convert(tiny["gguf"], b_path, outtype="f16")
    ra, rb = open_gguf(a_path), open_gguf(b_path)
    ta = {t.name: tensor_f32(t) for t in ra.tensors}
    tb = {t.name: tensor_f32(t) for t in rb.tensors}
    assert set(ta) == set(tb)
    for name in tb:
        if "ffn_down_t" in name or "attn_k" in name or "attn_norm" in name:
            np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    assert field(ra, "tokenizer.ggml.model") == "gpt2" and len(field(ra, "tokenizer.ggml.tokens")) == 269
    assert field(ra, "tokenizer.ggml.bos_token_id") == 267
    toks = [267, 40, 72, 101, 33, 260, 70, 90, 45, 12]
    la = np.array(_llama(a_path, sparse_mode="dense").compute_logits(toks))
    lb = np.array(_llama(b_path, sparse_mode="dense").compute_logits(toks))
    np.testing.assert_array_equal(la, lb)  # same weights, same layout, same bits
    lo = np.array(_llama(tiny["gguf"], sparse_mode="dense").compute_logits(toks))
    assert np.abs(la - lo).max() < 0.05 * np.abs(lo).max()  # F16 of the F32 original
    assert _llama(a_path, sparse_mode="gate").sparse_mode_in_use() == "gate"  # ReLU + ffn_down_t: gate-ready


def test_convert_errors_leave_input_alone(tiny, tmp_path):
    src = tiny["gguf"]
    before = Path(src).read_bytes()
    with pytest.raises(ValueError, match="must be a new file"):
        convert(src, src)
    assert cli.main(["convert", src, "--out", src]) == 1
    hf = tmp_path / "hf"
    _hf_dir_from_gguf(src, hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported"):
        convert(str(hf), str(tmp_path / "x.gguf"))
    (hf / "config.json").write_text(json.dumps(cfg))
    # a missing tensor: drop the second shard
    os.remove(hf / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match="missing tensors"):
        convert(str(hf), str(tmp_path / "x.gguf"))
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.tmp").exists()
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    shutil.copy(hf / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        convert(str(tmp_path), str(tmp_path / "y.gguf"))
    with pytest.raises(ValueError, match="model_\\{i\\}.pt"):
        convert(src, str(tmp_path / "z.gguf"), predictors=str(tmp_path))
    assert Path(src).read_bytes() == before


# ---------------------------------------------------------------- relufy

def test_relufy_torch_forward_matches_engine(tiny):
    pytest.importorskip("torch")
    from powerinfer_py.pipeline.relufy import check_against_engine

    c = check_against_engine(tiny["gguf"], [1, 40, 72, 101, 33, 260, 70, 90, 45, 12, 200, 7] * 3)
    assert c["top1_agree"] == 1.0 and c["rel_diff"] < 1e-4


def _qwen2_tiny(tiny, tmp_path):
    """The tiny llama model as a qwen2 GGUF: the same keys under qwen2.*, and q/k/v biases
    (qwen2's), which the engine adds and runs with RoPE in NEOX mode."""
    import gguf

    from powerinfer_py.formats.gguf_io import finish, new_writer

    src = open_gguf(tiny["gguf"])
    dst = tmp_path / "qwen2.gguf"
    w = new_writer(str(dst), "qwen2")
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        key = "qwen2." + name[len("llama."):] if name.startswith("llama.") else name
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    rng = np.random.default_rng(5)
    for t in src.tensors:
        arr = tensor_f32(t)
        w.add_tensor(t.name, arr)
        for n in ("attn_q", "attn_k", "attn_v"):
            if t.name.endswith(f".{n}.weight"):
                w.add_tensor(t.name.replace(".weight", ".bias"), (0.5 * rng.standard_normal(arr.shape[0])).astype(np.float32))
    finish(w, str(dst))
    return dst


def test_relufy_qwen2(tiny, tmp_path):
    """qwen2 (q/k/v biases, NEOX RoPE): the torch model computes what the engine computes on
    the original, and a relufied qwen2 keeps its architecture and biases and runs."""
    pytest.importorskip("torch")
    from powerinfer_py.pipeline.relufy import check_against_engine

    qwen = _qwen2_tiny(tiny, tmp_path)
    toks = [1, 40, 72, 101, 33, 260, 70, 90, 45, 12, 200, 7] * 3
    c = check_against_engine(str(qwen), toks)
    assert c["top1_agree"] == 1.0 and c["rel_diff"] < 1e-4, c
    # both differences from llama matter: without the biases, or with NORMAL RoPE, the torch
    # model is far from the engine's
    from powerinfer_py.pipeline.relufy import load_weights

    hp, weights, _ = load_weights(str(qwen))
    no_bias = {k: (np.zeros_like(v) if k.endswith(".bias") else v) for k, v in weights.items()}
    assert check_against_engine(str(qwen), toks, hp, no_bias)["rel_diff"] > 1e-2
    assert check_against_engine(str(qwen), toks, dict(hp, rope_neox=False), weights)["rel_diff"] > 1e-2
    out = tmp_path / "relu-qwen2.gguf"
    assert cli.main(["relufy", str(qwen), "--corpus", tiny["corpus"], "--out", str(out), "--steps", "2",
                     "--seq-len", "32", "--batch", "1", "--layerwise-steps", "2", "--layerwise-seqs", "2",
                     "--outtype", "f32", "--distill", "1"]) == 0
    r = open_gguf(out)
    assert field(r, "general.architecture") == "qwen2" and field(r, "powerinfer.ffn_activation") == "relu"
    names = {t.name for t in r.tensors}
    assert {"blk.0.attn_q.bias", "blk.1.attn_v.bias"} <= names
    llm = _llama(out)
    assert len(llm.tokenize(b"In the beginning")) > 0 and llm.create_completion("In the", max_tokens=4)["choices"]


def test_relufy_checkpoint_resume_and_flow(tiny, tmp_path):
    pytest.importorskip("torch")
    out, ck = tmp_path / "relu.gguf", tmp_path / "ck"
    def args(steps):
        return ["relufy", tiny["gguf"], "--corpus", tiny["corpus"], "--out", str(out), "--steps", str(steps),
                "--seq-len", "32", "--batch", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--l1", "0.01"]

    assert cli.main(args(2)) == 0  # 2 steps, then resume to 4
    assert (ck / "relufy-checkpoint.pt").is_file()
    assert cli.main(args(4) + ["--resume", "--check", "--report", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["start_step"] == 2 and rep["steps"] == 4 and rep["check_original"]["top1_agree"] == 1.0
    r = open_gguf(out)
    assert field(r, "powerinfer.ffn_activation") == "relu" and len(field(r, "tokenizer.ggml.tokens")) == 269
    assert cli.main(["relufy", tiny["gguf"], "--corpus", tiny["corpus"], "--out", str(out), "--act", "drelu",
                     "--steps", "4", "--seq-len", "32", "--checkpoint-dir", str(ck), "--resume"]) == 1
    # the exported model runs in our engine and flows into profile
    assert cli.main(["profile", str(out), "--corpus", tiny["corpus"], "--n-tokens", "300", "--ctx", "64",
                     "--out", str(tmp_path / "p")]) == 0
    # ... and computes the model relufy trained: the reference is tests/numpy_llama.py's float64
    # forward pass (ReLU FFN) of the original F32 weights with the trained ones from the
    # checkpoint in their place (the token embedding and output stay frozen)
    import torch
    from numpy_llama import forward, read_f32_model

    original, hp = read_f32_model(tiny["gguf"], tmp_path)
    state = torch.load(ck / "relufy-checkpoint.pt", weights_only=False)
    assert state["step"] == 4
    trained = dict(original)
    for key, value in state["params"].items():
        name = "output_norm.weight" if key == "output_norm" else "blk.{}.{}.weight".format(*key.split(".")[1:])
        assert name in original and value.shape == original[name].shape, key
        trained[name] = value.double().numpy()
    llm = _llama(out)
    prompt, ids, rows = _completion_and_greedy(llm, "In the", 4)
    seq = prompt + ids[:-1]
    ref = forward(trained, hp, seq)
    _assert_greedy_follows(ids, rows, ref[len(prompt) - 1 :], TOL_F16)
    # four steps moved the model far beyond that tolerance: the file holds the trained weights
    assert np.abs(forward(original, hp, seq) - ref).max() > 10 * TOL_F16 * np.abs(ref).max()


def test_profile_plot(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert cli.main(["profile", tiny["gguf"], "--corpus", tiny["corpus"], "--n-tokens", "256", "--ctx", "64",
                     "--out", str(tmp_path / "p"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _silu_tiny(tiny, tmp_path):
    """The tiny model made a SiLU original: its activation key removed, its gates scaled
    down (up scaled up to match) so preactivations sit near 0, where SiLU and ReLU differ;
    with the synthetic gates as they are the two models nearly agree."""
    from powerinfer_py.formats.gguf_io import KEY_ACTIVATION, copy_kv, finish, new_writer

    silu = tmp_path / "silu.gguf"
    r = open_gguf(tiny["gguf"])
    w = new_writer(str(silu), "llama")
    copy_kv(r, w, skip={KEY_ACTIVATION})
    for t in r.tensors:
        scale = 0.1 if t.name.endswith("ffn_gate.weight") else 10.0 if t.name.endswith("ffn_up.weight") else 1.0
        w.add_tensor(t.name, tensor_f32(t) * np.float32(scale))
    finish(w, str(silu))
    return silu


def _kl_from(original, hp, toks):
    """kl(weights): mean KL(original SiLU model || ReLU model with WEIGHTS) over TOKS, both
    from tests/numpy_llama.py's float64 forward pass (independent of torch and the engine)."""
    from numpy_llama import forward

    def log_softmax(x):
        m = x.max(axis=1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))

    teacher = log_softmax(forward(original, dict(hp, act="silu"), toks))

    def kl(weights):
        student = log_softmax(forward(weights, dict(hp, act="relu"), toks))
        return float((np.exp(teacher) * (teacher - student)).sum(axis=1).mean())

    return kl


def test_relufy_layerwise_stage(tiny, tmp_path):
    """--layerwise-steps alone (no end-to-end step): fitting each relufied FFN to the
    original's residual stream, layer after layer, brings the model closer to the original
    (KL measured by numpy on corpus tokens: under half of the plain relufied model's), and
    with --target-sparsity each layer's share of zero activations rises to near it. The
    stage's result is kept in the checkpoint folder and reused by a run with the same
    settings (same weights written), not by one with other settings."""
    pytest.importorskip("torch")
    from numpy_llama import read_f32_model

    silu = _silu_tiny(tiny, tmp_path)
    ck, out, out2 = tmp_path / "ck", tmp_path / "lw.gguf", tmp_path / "lw2.gguf"

    def run(dest, *extra):
        rep = tmp_path / (dest.stem + ".json")
        assert cli.main(["relufy", str(silu), "--corpus", tiny["corpus"], "--out", str(dest), "--steps", "0",
                         "--seq-len", "32", "--layerwise-steps", "60", "--layerwise-seqs", "8", "--layerwise-lr", "3e-3",
                         "--outtype", "f32", "--checkpoint-dir", str(ck), "--report", str(rep), *extra]) == 0
        return json.loads(rep.read_text())["layerwise"]

    rep = run(out, "--target-sparsity", "0.8")
    original, hp = read_f32_model(str(silu), tmp_path)
    fitted, _ = read_f32_model(str(out), tmp_path)
    kl = _kl_from(original, hp, tokenize_texts(str(silu), [TEXT])[:48].tolist())
    before, after = kl(original), kl(fitted)
    assert after < 0.5 * before, (before, after)
    for layer in rep["layers"]:
        assert layer["sparsity_after"] > layer["sparsity_before"] + 0.05 or layer["sparsity_after"] > 0.75, layer
    assert (ck / "relufy-layerwise.pt").is_file() and "loaded_from" not in rep
    again = run(out2, "--target-sparsity", "0.8")
    assert again["loaded_from"] == str(ck / "relufy-layerwise.pt")
    assert out2.read_bytes() == out.read_bytes()
    assert "loaded_from" not in run(out2, "--target-sparsity", "0.7")
    # an end-to-end run started from the stage keeps its numbers in the checkpoint, so a
    # resumed run still reports the stage it came from
    first = run(out2, "--target-sparsity", "0.7", "--steps", "1", "--batch", "1")
    resumed = run(out2, "--target-sparsity", "0.7", "--steps", "2", "--batch", "1", "--resume")
    assert resumed["layers"] == first["layers"]
    assert cli.main(["relufy", str(silu), "--corpus", tiny["corpus"], "--out", str(out2), "--steps", "0",
                     "--target-sparsity", "1.5"]) == 1


def test_distill_kl_matches_autograd_through_kl_div():
    """relufy's hand-written KL(teacher || student) and its gradient against torch's own
    kl_div differentiated by autograd, in float64 (the formula, not rounding, is tested):
    one token's distribution far from the teacher's, one equal to it (KL and gradient 0)."""
    torch = pytest.importorskip("torch")
    from powerinfer_py.pipeline.relufy import distill_kl

    g = torch.Generator().manual_seed(3)
    s = (torch.randn(5, 97, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    t = torch.randn(5, 97, generator=g, dtype=torch.float64) * 2
    t[4] = s.detach()[4] + 1.5  # the same distribution: logits differ by a constant
    t_logp = torch.log_softmax(t, -1)
    kl, s_logp = distill_kl(torch)(s, t_logp.clone())
    ref = torch.nn.functional.kl_div(torch.log_softmax(s, -1), t_logp, log_target=True, reduction="batchmean")
    assert abs(kl.item() - ref.item()) < 1e-12 and kl.item() > 0.1
    assert torch.allclose(s_logp, torch.log_softmax(s.detach(), -1), atol=1e-12, rtol=0)
    (3.0 * kl).backward()
    mine = s.grad.clone()
    s.grad = None
    (3.0 * ref).backward()
    assert torch.allclose(mine, s.grad, atol=1e-12, rtol=0)
    assert mine[4].abs().max().item() < 1e-12


def test_relufy_distillation_pulls_towards_the_original(tiny, tmp_path):
    """--distill 1: the loss is KL(original || model) alone. The tiny model made a SiLU
    original (its key removed, its gates scaled into SiLU's curved range) starts, relufied,
    away from it (KL 0.05 nats), and training on that loss
    brings it closer: the KL after training is under half the KL before, both measured
    independently of torch (tests/numpy_llama.py's float64 forward passes, on corpus tokens)."""
    pytest.importorskip("torch")
    from numpy_llama import read_f32_model

    silu = _silu_tiny(tiny, tmp_path)
    out = tmp_path / "relu.gguf"
    rep_path = tmp_path / "r.json"
    assert cli.main(["relufy", str(silu), "--corpus", tiny["corpus"], "--out", str(out), "--steps", "24",
                     "--seq-len", "32", "--batch", "2", "--l1", "0", "--lr", "3e-3", "--distill", "1",
                     "--outtype", "f32", "--report", str(rep_path)]) == 0
    rep = json.loads(rep_path.read_text())
    assert rep["distill"] == 1.0 and rep["final_kl"] is not None

    original, hp = read_f32_model(str(silu), tmp_path)
    trained, _ = read_f32_model(str(out), tmp_path)
    kl = _kl_from(original, hp, tokenize_texts(str(silu), [TEXT])[:48].tolist())
    before, after = kl(original), kl(trained)
    assert after < 0.5 * before, (before, after)
    # resuming a checkpoint with another distillation setting is refused; bad values too
    ck = tmp_path / "ck"
    base = ["relufy", str(silu), "--corpus", tiny["corpus"], "--out", str(out), "--seq-len", "32", "--batch", "2",
            "--checkpoint-dir", str(ck), "--checkpoint-every", "1"]
    assert cli.main(base + ["--steps", "1", "--distill", "0.5"]) == 0
    assert cli.main(base + ["--steps", "2", "--resume"]) == 1
    assert cli.main(base + ["--steps", "2", "--distill", "1.5"]) == 1


def test_sample_is_deterministic_and_reads_as_corpus(smollm2_path, tmp_path, capsys):
    """`powerinfer sample`: the file depends only on its arguments (each batched stream
    equals its solo run and sample i has seed SEED + i), whatever --parallel; its texts
    read as a corpus; bad arguments and bad files end with an error, not a traceback."""
    from powerinfer_py.pipeline.common import PipelineError, read_corpus
    from powerinfer_py.pipeline.sample import prompts, read_samples

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = [smollm2_path, "--n-tokens", "160", "--max-tokens", "40", "--threads", "2"]
    assert cli.main(["sample", *base, "--out", str(a), "--parallel", "1"]) == 0
    assert cli.main(["sample", *base, "--out", str(b), "--parallel", "3"]) == 0
    assert a.read_bytes() == b.read_bytes()
    head, recs = read_samples(str(a))
    assert head["n_tokens"] == 160 and [r["i"] for r in recs] == list(range(len(recs)))
    assert sum(r["n_tokens"] for r in recs) >= 160 > sum(r["n_tokens"] for r in recs[:-1])
    assert all(r["n_tokens"] <= 40 and r["text"] for r in recs)
    assert [(r["kind"], r["prompt"]) for r in recs] == prompts(len(recs), 0)
    assert {r["kind"] for r in recs} == {"chat", "text"}
    corpus = read_corpus([str(a)])
    assert corpus == ["\n\n".join(r["text"] for r in recs)]
    # kept as it is when the settings match
    mtime = a.stat().st_mtime_ns
    assert cli.main(["sample", *base, "--out", str(a), "--skip-existing"]) == 0
    assert a.stat().st_mtime_ns == mtime and "kept" in capsys.readouterr().err
    assert prompts(5, 0) == prompts(40, 0)[:5]  # a longer run extends a shorter one's prompts
    for bad in (["--n-tokens", "0"], ["--parallel", "65"]):
        assert cli.main(["sample", smollm2_path, "--out", str(tmp_path / "x.jsonl"), "--n-tokens", "10", *bad]) == 1
    assert cli.main(["sample", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x.jsonl"), "--n-tokens", "10"]) == 1
    assert not (tmp_path / "x.jsonl").exists()
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"not": "samples"}\n')
    with pytest.raises(PipelineError, match="not a `powerinfer sample` file"):
        read_corpus([str(junk)])


# ---------------------------------------------------------------- outputs never overwrite inputs

def _tree(d: Path):
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# Commands that write no file (no output path to check)
NO_FILES = {"rpc-server"}


def test_no_command_overwrites_its_inputs(tiny, tmp_path, capsys):
    """Issue 28, item 8: `sample MODEL --out MODEL` replaced a 98 MB model by 473 bytes of
    JSON lines. Every command refuses an output that is one of its inputs (the model, a
    reference, corpus, samples, predictors, statistics, text files; a file an output
    directory would receive included), with a message and status 1, before it does anything:
    the directory's every file is byte for byte what it was, and nothing was added."""
    d = tmp_path
    m, m2, c = d / "m.gguf", d / "m2.gguf", d / "c.txt"
    shutil.copy(tiny["gguf"], m)
    shutil.copy(tiny["gguf"], m2)
    c.write_text(TEXT)
    prof = d / "prof"  # a profile's output: its samples, and a file profile writes, read as corpus
    (prof / "samples").mkdir(parents=True)
    (prof / "samples" / "layer_0.npz").write_bytes(b"samples")
    (prof / "profile.json").write_text(TEXT)
    pred = d / "pred"
    pred.mkdir()
    (pred / "model_0.pt").write_bytes(b"predictor")
    stats = d / "stats.gguf"
    stats.write_bytes(b"statistics")
    held = d / "o.card.md"  # held-out text named as `convert --out o.gguf --card` names its card
    held.write_text(TEXT)
    act = d / "m.gguf.generated.gpuidx"  # counts where place writes its cache
    act.mkdir()
    (act / "activation_0.pt").write_bytes(b"counts")
    cases = {
        "profile": [[m, "--corpus", c, "--out", m], [m, "--corpus", c, "--out", d / "p", "--plot", c],
                    [m, "--corpus", prof / "profile.json", "--out", prof]],
        "train-predictor": [["--samples", prof, "--out", prof], ["--samples", prof, "--model", m, "--out", m],
                            ["--samples", prof / "samples" / "layer_0.npz", "--out", prof / "samples" / "layer_0.npz"]],
        "convert": [[m, "--out", m], [m, "--stats", stats, "--out", stats], [m, "--predictors", pred, "--out", pred],
                    [m, "--predictors", pred, "--out", pred / "model_0.pt"], [m, "--out", d / "o.gguf", "--card", held],
                    [m2, "--out", m, "--card", c, "--card-reference", m]],
        "sample": [[m, "--out", m, "--n-tokens", "8"]],
        "relufy": [[m, "--corpus", c, "--out", m], [m, "--corpus", c, "--out", c],
                   [m, "--corpus", c, "--out", d / "r.gguf", "--report", m]],
        "calibrate": [[m, "--corpus", c, "--out", m], [m, "--corpus", c, "--out", c],
                      [m, "--corpus", c, "--eval", held, "--out", held]],
        "sparsify": [[m, "--sparsity", "0.4", "--corpus", c, "--out", m, "--no-card"],
                     [m, "--sparsity", "0.4", "--corpus", c, "--out", c, "--no-card"],
                     [m, "--sparsity", "0.4", "--corpus", c, "--out", d / "o.gguf", "--text", held]],
        "place": [[m, "--vram-budget", "1", "--emulate-device", "--activation", act]],
        "eval": [[m, "--text", c, "--out", m], [m, "--text", f"held={held}", "--out", held],
                 [m, "--text", c, "--reference", m2, "--out", m2]],
    }
    assert set(cases) == set(cli.COMMANDS) - NO_FILES  # a new command needs its cases here
    before = _tree(d)
    for cmd, argvs in cases.items():
        for argv in argvs:
            rc = cli.main([cmd, *map(str, argv)])
            err = capsys.readouterr().err
            assert rc == 1 and "would overwrite" in err and "Traceback" not in err, (cmd, argv, rc, err)
            assert _tree(d) == before, (cmd, argv)
    # a link to an input is the input; the same file spelled differently too
    (d / "link.gguf").symlink_to(m)
    before = _tree(d)
    assert cli.main(["sample", str(d / "link.gguf"), "--out", str(m), "--n-tokens", "8"]) == 1
    assert cli.main(["sample", str(m), "--out", os.path.relpath(m), "--n-tokens", "8"]) == 1
    assert "would overwrite" in capsys.readouterr().err and _tree(d) == before


def test_a_write_that_fails_midway_leaves_the_old_output(tiny, tmp_path):
    """Outputs go to a temporary name beside them and are renamed when complete: a write that
    fails midway (here the file size limit, as a full disk would) ends with an error and leaves
    the output of an earlier run as it was, and no temporary file behind."""
    import subprocess
    import sys

    c = tmp_path / "c.txt"
    c.write_text(TEXT)
    old = "an earlier card\n" * 100
    card_md, card_json = tmp_path / "card.md", tmp_path / "card.json"
    card_md.write_text(old)
    card_json.write_text(old)
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256)); "
            "from powerinfer_py.pipeline.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "eval", tiny["gguf"], "--text", str(c), "--passages", "1",
                        "--n-tokens", "16", "--no-speed", "--out", str(card_md)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "File too large" in r.stderr, r.stderr[-2000:]
    assert card_md.read_text() == old and card_json.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "card.json", "card.md"]


# ---------------------------------------------------------------- temporaries, early checks, full disks (issue 53)

def _pipeline(*argv, code: str = None, timeout: float = 300):
    """A pipeline command in a child process (a crash by a signal ends there)."""
    import subprocess
    import sys

    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "powerinfer_py.pipeline"]
    return subprocess.run(head + [str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


def test_an_input_named_like_the_old_temporary_is_never_written(tiny, tmp_path):
    """Issue 53, item 3: every GGUF writer wrote OUT.tmp, then renamed it: `sparsify M.gguf.tmp
    --out M.gguf` wrote over the model it was reading through a memory map (SIGBUS, the input
    truncated), and any other OUT.tmp was overwritten, then deleted. A new unique temporary
    can be no existing file: every file that was in the folder is as it was, the output is
    the one file added."""
    d = tmp_path
    m = d / "model.gguf.tmp"
    shutil.copy(tiny["gguf"], m)
    c = d / "c.txt"
    c.write_text(TEXT)
    (d / "other.gguf.tmp").write_bytes(b"someone else's file")
    cases = [("sparsify", m, "--sparsity", "0", "--out", d / "model.gguf", "--no-card"),
             ("convert", m, "--out", d / "other.gguf"),
             ("calibrate", m, "--corpus", c, "--n-tokens", "256", "--out", d / "model.gguf")]
    for argv in cases:
        out = Path(argv[argv.index("--out") + 1])
        before = {p: b for p, b in _tree(d).items() if p != out}
        r = _pipeline(*argv)
        assert r.returncode == 0, (argv, r.returncode, r.stderr[-2000:])
        after = _tree(d)
        assert {p: after.get(p) for p in before} == before, argv
        assert set(after) - set(before) == {out}, argv
        assert open_gguf(out).get_field("general.architecture") is not None


def test_sigterm_during_a_write_leaves_no_temporary(tiny, tmp_path):
    """SIGTERM while the output is written (here: sent by the writer itself once the header is
    out) leaves the earlier output as it was and no partial temporary (100 MB in the issue),
    as SIGINT does; the process still ends by SIGTERM."""
    import signal

    code = ("import os, signal, sys, time, gguf\n"
            "orig = gguf.GGUFWriter.write_kv_data_to_file\n"
            "def kv(self):\n"
            "    orig(self)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(60)\n"
            "gguf.GGUFWriter.write_kv_data_to_file = kv\n"
            "from powerinfer_py.pipeline.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "s.gguf"
    out.write_bytes(b"an earlier output")
    r = _pipeline("sparsify", tiny["gguf"], "--sparsity", "0", "--out", out, "--no-card", code=code, timeout=120)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-2000:])
    assert out.read_bytes() == b"an earlier output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.gguf"]


def test_arguments_are_checked_before_calibrating(tiny, tmp_path, monkeypatch, capsys):
    """Issue 53, item 8: sparsify --sparsity 1.5 failed after calibrating (28 s on SmolLM2, 20
    minutes on a 1.5B), --out /nonexistent/dir/x.gguf after 36 s; calibrate alike. Every
    argument, the card's and the output's folder included, is checked first: here calibrating
    at all fails the test."""
    from powerinfer_py.pipeline import calibrate as calibrate_mod
    from powerinfer_py.pipeline import sparsify as sparsify_mod

    def calibrating(*a, **k):
        raise AssertionError("calibrating before the arguments were checked")

    monkeypatch.setattr(sparsify_mod, "calibration_texts", calibrating)
    monkeypatch.setattr(sparsify_mod, "collect_input_histograms", calibrating)
    monkeypatch.setattr(calibrate_mod, "collect_histograms", calibrating)
    m, c = tiny["gguf"], tiny["corpus"]
    ok = str(tmp_path / "o.gguf")
    (tmp_path / "file").write_text("a file, not a folder")
    missing = str(tmp_path / "missing.txt")
    held = f"held={c}"
    cases = [
        ("sparsify", ["--sparsity", "1.5", "--out", ok, "--no-card"], "--sparsity must be in [0, 1), got 1.5"),
        ("sparsify", ["--sparsity", "nan", "--out", ok, "--no-card"], "--sparsity must be in [0, 1), got nan"),
        ("sparsify", ["--sparsity", "0.4", "--out", "/nonexistent/dir/x.gguf", "--no-card"],
         "--out /nonexistent/dir/x.gguf: its folder /nonexistent/dir does not exist"),
        ("sparsify", ["--sparsity", "0.4", "--out", str(tmp_path / "file" / "x.gguf"), "--no-card"], "is not a folder"),
        ("sparsify", ["--sparsity", "0.4", "--out", ok, "--n-tokens", "0", "--no-card"], "--n-tokens"),
        ("sparsify", ["--sparsity", "0.4", "--out", ok, "--corpus", missing, "--no-card"], f"{missing}: no such file"),
        ("sparsify", ["--sparsity", "0.4", "--out", ok, "--text", missing], f"--text {missing}: no such file"),
        ("sparsify", ["--sparsity", "0.4", "--out", ok, "--text", held, "--card-passages", "0"], "--card-passages"),
        ("sparsify", ["--sparsity", "0.4", "--out", ok, "--text", held, "--card-batch", "0"], "--card-batch"),
        ("calibrate", ["--sparsity", "1.5", "--out", ok], "--sparsity must be in [0, 1), got 1.5"),
        ("calibrate", ["--out", "/nonexistent/dir/x.gguf"], "its folder /nonexistent/dir does not exist"),
        ("calibrate", ["--out", ok, "--eval", missing], f"--eval {missing}: no such file"),
    ]
    for cmd, extra, message in cases:
        rc = cli.main([cmd, m, "--corpus", c, *extra])
        err = capsys.readouterr().err
        assert rc == 1 and message in err and "Traceback" not in err, (cmd, extra, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root; skipped elsewhere): a disk that fills up."""
    import subprocess

    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)  # -l: even with a file still open


def test_a_full_disk_is_found_before_calibrating(small_disk, smollm2_path, tmp_path, monkeypatch, capsys):
    """Issue 53, item 9: sparsify on a full disk failed at the end, saying "552960 requested
    and 14560 written". A folder without room for the copy is found before calibrating."""
    from powerinfer_py.pipeline import sparsify as sparsify_mod

    def calibrating(*a, **k):
        raise AssertionError("calibrating before the free space was checked")

    monkeypatch.setattr(sparsify_mod, "collect_input_histograms", calibrating)
    c = tmp_path / "c.txt"
    c.write_text(TEXT)
    out = small_disk / "s.gguf"
    assert cli.main(["sparsify", smollm2_path, "--sparsity", "0.4", "--corpus", str(c), "--out", str(out),
                     "--no-card"]) == 1
    err = capsys.readouterr().err
    assert f"no space left on device for --out {out}: it needs about 93.8 MiB" in err, err
    assert list(small_disk.iterdir()) == []


def test_a_write_that_fills_the_disk_says_so(small_disk):
    """A GGUF write that fills the disk midway (2 MiB of tensor data on a 1 MiB disk: numpy's
    short write, "N requested and M written", without errno) says "no space left on device"
    with the path, and leaves nothing behind."""
    from powerinfer_py.formats.gguf_io import finish, new_writer

    out = small_disk / "s.gguf"
    w = new_writer(out, "llama")
    w.add_tensor("big", np.zeros(1 << 19, dtype=np.float32))
    with pytest.raises(OSError) as e:
        finish(w, out)
    assert f"no space left on device writing {out}" in str(e.value), str(e.value)
    assert list(small_disk.iterdir()) == []


def test_sample_shows_progress_as_tokens_come(smollm2_path, tmp_path, capsys, monkeypatch):
    """Issue 53, item 10: the bar counted the finished samples' tokens only, so with the first
    --parallel samples holding the whole budget it sat at 0 (814 s on a 1.5B) and then jumped
    to the end. It counts tokens as they are generated, with the rate."""
    from powerinfer_py.pipeline import sample as sample_mod

    # redrawn every 20 ms, so that even a fast machine (SmolLM2 at hundreds of tokens a
    # second) draws the count several times on the way
    monkeypatch.setattr(sample_mod, "PROGRESS_EVERY", 0.02)
    sample_mod.sample(smollm2_path, str(tmp_path / "s.jsonl"), 128, max_tokens=128, n_parallel=1, threads=2, progress=True)
    err = capsys.readouterr().err
    draws = [d for d in err.split("\r") if d.startswith("sample [")]
    counts = {int(d.split("] ")[1].split(" tokens")[0]) for d in draws}
    assert len({n for n in counts if 0 < n < 128}) >= 4, draws
    assert all("tok/s" in d for d in draws if "] 0 tokens" not in d), draws
