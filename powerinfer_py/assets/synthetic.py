"""Synthetic ReLU llama-architecture models with planted activation sparsity, for tests
and benchmarks. Each model is written twice: as a standard GGUF (llama.cpp runs it,
`ffn_down`) and as its PowerInfer twin (`PWRI` magic, `ffn_down_t`, predictors).

How the sparsity is planted (see docs/synthetic-models.md):
- Residual channel 0 carries a constant: every token embedding has the value `c` there,
  and the attention output and FFN down projections have zero weights into it, so it
  stays `c` through every layer. After RMSNorm it acts as a bias input.
- The gate matrix is low rank plus a bias column: gate_i(x) = u_i . (V x) - b_i x_0.
  `b_i` is solved per neuron from sampled inputs so that neuron i fires (ReLU > 0) with
  probability p_i, a power law over neurons averaging about `active_frac` (10%).
- The predictor is exact by construction: fc2 . relu(fc1 . x_res) = W_gate diag(g) x_res,
  which is the gate pre-activation times the positive RMS of x_res, so it has the same
  sign (fc1 = [A; -A], fc2 = [B, -B] and relu(y) - relu(-y) = y). Weight quantization
  makes it slightly inexact.

Also a tiny MoE model of llama.cpp's qwen3moe architecture (generate_qwen3moe: random weights,
no planted sparsity; the input-sparse module's MUL_MAT_ID tests).

Run `python -m powerinfer_py.assets.synthetic --preset tiny|7b|tiny-qwen3moe --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from .._progress import Progress
from ..formats.gguf_io import KEY_ACTIVATION, KEY_STATS_N_TOKENS, KEY_THRESHOLD, finish, new_writer

STATS_TOKENS = 10000  # nominal token count of the planted activation counts


@dataclass
class SyntheticSpec:
    name: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    gate_rank: int
    wtype: str  # gguf quantization type name for 2-D weights: F32, F16, Q8_0, Q4_0
    active_frac: float = 0.10
    power: float = 1.0  # p_i ~ (rank_i + 1) ** -power
    n_ctx: int = 2048
    seed: int = 0
    embd_const: float = 0.0  # 0: chosen so channel 0 is ~half the embedding's RMS energy
    activation: str = "relu"  # written as powerinfer.ffn_activation
    arch: str = "llama"  # general.architecture: llama, or bamboo (PowerInfer's dReLU llama)
    pred_rank: int = 0  # predictor rank; 0: the exact one's, 2 * (gate_rank + 1) in whole 32s. Larger
                        # ranks add units of noise (their own random fc1 rows and small fc2 weights)
    pred_type: str = ""  # the predictor's quantization type (F32, F16, Q8_0, Q4_0); "": wtype
    pred_noise: float = 0.02  # the extra units' fc2 weights, relative to the exact units' RMS


PRESETS: Dict[str, SyntheticSpec] = {
    "tiny": SyntheticSpec("tiny-relu", n_embd=64, n_ff=256, n_layer=2, n_head=4, n_head_kv=2, gate_rank=16, wtype="F32"),
    "tiny-q8": SyntheticSpec("tiny-relu-q8", n_embd=128, n_ff=384, n_layer=3, n_head=4, n_head_kv=4, gate_rank=24, wtype="Q8_0"),
    "tiny-bamboo": SyntheticSpec("tiny-bamboo", n_embd=64, n_ff=256, n_layer=2, n_head=4, n_head_kv=2, gate_rank=16,
                                 wtype="F32", activation="drelu", arch="bamboo"),
    # big enough that a fraction of it holds a device's compute buffers (hybrid benchmark in CI)
    "small": SyntheticSpec("small-relu", n_embd=256, n_ff=1024, n_layer=4, n_head=4, n_head_kv=4, gate_rank=32,
                           wtype="Q4_0"),
    "7b": SyntheticSpec("relu-7b-shaped", n_embd=4096, n_ff=11008, n_layer=32, n_head=32, n_head_kv=32, gate_rank=127,
                        wtype="Q4_0", n_ctx=4096),
    # A second 7B shape made differently: a steeper firing law over fewer active neurons, a
    # larger, noisier Q8_0 predictor (like a trained rank-512 one), another seed.
    "7b-b": SyntheticSpec("relu-7b-shaped-b", n_embd=4096, n_ff=11008, n_layer=32, n_head=32, n_head_kv=32, gate_rank=95,
                          wtype="Q4_0", n_ctx=4096, active_frac=0.08, power=1.4, seed=7, pred_rank=512,
                          pred_type="Q8_0"),
}


def _vocab():
    """A byte-level SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte
    tokens and a few word pieces, enough for libllama to tokenize any text."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    pieces = ["\u2581", "\u2581the", "\u2581a", "e", "t", "a", "o", "n", "\u2581of", "\u2581and"]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i + 1) for i in range(len(pieces))]
    return tokens, scores, types


def _add_vocab(w, unk: bool) -> None:
    """The _vocab() tokenizer keys: <s> = 1 (added in front of texts), </s> = 2, <unk> = 0 if `unk`."""
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if unk:
        w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def _quant(arr: np.ndarray, wtype: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor; arr is float32 in numpy (row-major) shape."""
    import gguf

    if wtype == "F32":
        return arr.astype(np.float32), None
    if wtype == "F16":
        return arr.astype(np.float16), None
    qt = getattr(gguf.GGMLQuantizationType, wtype)
    return gguf.quants.quantize(arr.astype(np.float32), qt), qt


def _fire_probabilities(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    """Power-law firing probabilities with mean active_frac, in a random neuron order."""
    ranks = np.arange(spec.n_ff)
    p = (ranks + 1.0) ** -spec.power
    # Scale to the target mean, capping at 0.95 and redistributing the excess.
    for _ in range(50):
        q = np.minimum(p * spec.active_frac * spec.n_ff / p.sum(), 0.95)
        if abs(q.mean() - spec.active_frac) < 1e-4:
            break
        p = q
    return rng.permutation(np.clip(q, 1e-4, 0.95))


def _rms_norm(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class _Layer:
    """Weights of one layer, float32, numpy row-major (ggml ne reversed)."""

    def __init__(self, spec: SyntheticSpec, rng: np.random.Generator, resid: np.ndarray, ffn_norm: np.ndarray):
        """resid: sampled residual-stream rows entering this layer; updated in place to
        the rows leaving it (attention approximated by each token attending to itself),
        so every layer's gate biases are solved on the inputs it will actually see."""
        from statistics import NormalDist

        e, f, d_head = spec.n_embd, spec.n_ff, spec.n_embd // spec.n_head
        kv = d_head * spec.n_head_kv
        s = 1.0 / np.sqrt(e)
        self.wq = (rng.standard_normal((e, e)) * s).astype(np.float32)
        self.wk = (rng.standard_normal((kv, e)) * s).astype(np.float32)
        self.wv = (rng.standard_normal((kv, e)) * s).astype(np.float32)
        self.wo = (rng.standard_normal((e, e)) * s * 0.1).astype(np.float32)
        self.wo[0, :] = 0.0  # nothing writes residual channel 0
        self.up = (rng.standard_normal((f, e)) * s).astype(np.float32)
        self.down = (rng.standard_normal((e, f)) * s * 0.1).astype(np.float32)  # numpy [n_embd, n_ff]
        self.down[0, :] = 0.0
        v_self = _rms_norm(resid) @ self.wv.T  # [samples, kv]: a token attending to itself
        v_self = np.repeat(v_self.reshape(len(resid), spec.n_head_kv, d_head), spec.n_head // spec.n_head_kv, axis=1)
        resid += v_self.reshape(len(resid), e) @ self.wo.T
        # Gate: low rank over channels 1.. plus a per-neuron bias through channel 0.
        u = rng.standard_normal((f, spec.gate_rank)).astype(np.float32)
        v = (rng.standard_normal((spec.gate_rank, e)) * s).astype(np.float32)
        v[:, 0] = 0.0
        gate = u @ v
        xn = _rms_norm(resid) * ffn_norm  # normalized FFN inputs (RMSNorm output times ffn_norm)
        z = xn @ gate.T  # [samples, n_ff]
        sigma = z.std(axis=0) + 1e-6
        x0 = float(np.mean(xn[:, 0]))
        p = _fire_probabilities(spec, rng)
        nd = NormalDist()
        b = np.array([nd.inv_cdf(1.0 - pi) for pi in p]) * sigma / x0
        gate[:, 0] = -b
        self.gate = gate.astype(np.float32)
        resid += (np.maximum(xn @ self.gate.T, 0.0) * (xn @ self.up.T)) @ self.down.T
        self.p_fire = p
        # Exact predictor of sign(gate . (g * x_res)): W' = gate diag(g) = U (V diag g) + (-b)(g0 e0^T).
        a = np.concatenate([v * ffn_norm[None, :], (ffn_norm[0] * np.eye(1, e, 0)).astype(np.float32)], axis=0)
        bmat = np.concatenate([u, -b[:, None]], axis=1).astype(np.float32)
        # Rank 2(r+1), padded with zero units to whole quantization blocks; a larger
        # pred_rank adds noise units: random fc1 rows, small random fc2 weights.
        exact = 2 * a.shape[0]
        rank = max(-(-exact // 32) * 32, spec.pred_rank)
        if rank % 32 or (spec.pred_rank and spec.pred_rank < exact):
            raise ValueError(f"pred_rank {spec.pred_rank} must be a multiple of 32 and at least {exact}")
        self.fc1 = np.zeros((rank, e), dtype=np.float32)
        self.fc1[:exact] = np.concatenate([a, -a], axis=0)
        self.fc2 = np.zeros((f, rank), dtype=np.float32)
        self.fc2[:, :exact] = np.concatenate([bmat, -bmat], axis=1)
        n_noise = rank - -(-exact // 32) * 32
        if n_noise > 0:
            fc2_rms = float(np.sqrt(np.mean(self.fc2[:, :exact] ** 2)))
            self.fc1[rank - n_noise :] = rng.standard_normal((n_noise, e)).astype(np.float32) * s
            self.fc2[:, rank - n_noise :] = rng.standard_normal((f, n_noise)).astype(np.float32) * fc2_rms * spec.pred_noise


def _finish(writers, paths: Dict[str, str], progress: bool, name: str) -> None:
    """Writes the standard GGUF and its PowerInfer twin (PWRI magic) into place."""
    for kind, w in writers.items():
        if progress:
            print(f"{name}: writing {paths[kind]}", file=sys.stderr, flush=True)
        finish(w, paths[kind], pwri=kind == "powerinfer", progress=progress)


def generate(spec: SyntheticSpec, out_dir: os.PathLike, progress: bool = True) -> Dict[str, str]:
    """Writes <name>.gguf (standard) and <name>.powerinfer.gguf (PWRI twin) into out_dir;
    returns their paths and a stats JSON path."""
    import gguf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    n_vocab = len(_vocab()[0])
    e = spec.n_embd
    c = spec.embd_const or float(np.sqrt(e))  # channel 0 holds about half the energy
    embd = rng.standard_normal((n_vocab, e)).astype(np.float32)
    embd[:, 0] = c
    out_w = (rng.standard_normal((n_vocab, e)) / np.sqrt(e)).astype(np.float32)
    ffn_norm = np.ones(e, dtype=np.float32)
    resid = embd[rng.integers(0, n_vocab, size=512)].astype(np.float32)  # residual-stream samples

    paths = {"dense": str(out / f"{spec.name}.gguf"), "powerinfer": str(out / f"{spec.name}.powerinfer.gguf")}
    writers = {}
    for kind, path in paths.items():
        w = new_writer(path, spec.arch)
        w.add_name(spec.name)
        w.add_context_length(spec.n_ctx)
        w.add_embedding_length(e)
        w.add_block_count(spec.n_layer)
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        w.add_head_count_kv(spec.n_head_kv)
        w.add_rope_dimension_count(e // spec.n_head)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if spec.wtype == "F32" else gguf.LlamaFileType.MOSTLY_F16
                        if spec.wtype == "F16" else getattr(gguf.LlamaFileType, f"MOSTLY_{spec.wtype}"))
        w.add_string(KEY_ACTIVATION, spec.activation)
        if kind == "powerinfer":
            w.add_float32(KEY_THRESHOLD, 0.0)
            w.add_uint64(KEY_STATS_N_TOKENS, STATS_TOKENS)
        _add_vocab(w, unk=True)
        writers[kind] = w

    def add(name, arr, kinds=("dense", "powerinfer"), quantize=True, wtype=spec.wtype):
        data, raw = _quant(arr, wtype) if quantize else (arr.astype(np.float32), None)
        for k in kinds:
            if raw is None:
                writers[k].add_tensor(name, data)
            else:
                writers[k].add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw)

    add("token_embd.weight", embd)
    add("output_norm.weight", np.ones(e, dtype=np.float32), quantize=False)
    add("output.weight", out_w)
    stats = {"spec": asdict(spec), "layers": []}
    bar = Progress(f"{spec.name}: layers", spec.n_layer, progress)
    for il in range(spec.n_layer):
        layer = _Layer(spec, rng, resid, ffn_norm)
        add(f"blk.{il}.attn_norm.weight", np.ones(e, dtype=np.float32), quantize=False)
        add(f"blk.{il}.attn_q.weight", layer.wq)
        add(f"blk.{il}.attn_k.weight", layer.wk)
        add(f"blk.{il}.attn_v.weight", layer.wv)
        add(f"blk.{il}.attn_output.weight", layer.wo)
        add(f"blk.{il}.ffn_norm.weight", ffn_norm, quantize=False)
        add(f"blk.{il}.ffn_gate.weight", layer.gate)
        add(f"blk.{il}.ffn_up.weight", layer.up)
        add(f"blk.{il}.ffn_down.weight", layer.down, kinds=("dense",))
        add(f"blk.{il}.ffn_down_t.weight", np.ascontiguousarray(layer.down.T), kinds=("powerinfer",))
        add(f"blk.{il}.fc1.weight", layer.fc1, kinds=("powerinfer",), wtype=spec.pred_type or spec.wtype)
        add(f"blk.{il}.fc2.weight", layer.fc2, kinds=("powerinfer",), wtype=spec.pred_type or spec.wtype)
        # Expected activation counts over STATS_TOKENS tokens (the planted firing
        # probabilities), as `powerinfer profile` would record them: hybrid placement input.
        add(f"blk.{il}.ffn_act_count", (layer.p_fire * STATS_TOKENS).astype(np.float32), kinds=("powerinfer",),
            quantize=False)
        stats["layers"].append({"planted_active_frac": float(layer.p_fire.mean()),
                                "predictor_rank": int(layer.fc1.shape[0])})
        bar.update(il + 1)
    bar.close()

    _finish(writers, paths, progress, spec.name)
    paths["stats"] = str(out / f"{spec.name}.stats.json")
    with open(paths["stats"], "w") as f:
        json.dump(stats, f, indent=1)
    return paths


def generate_falcon(out_dir: os.PathLike, n_embd: int = 64, n_ff: int = 256, n_layer: int = 2, n_head: int = 4,
                    seed: int = 0) -> Dict[str, str]:
    """A tiny Falcon-architecture pair (F32, multi-query attention like Falcon-7B): the
    standard GGUF runs GELU (llama.cpp runs it too: the parity reference), the PWRI twin
    the same weights with ReLU, ffn_down_t and an exact predictor. The attention norm has
    no bias, so the up projection's sign is linear in the residual x: up = W_up (w * C x)
    / std(x) with C the centring matrix, and fc2 . relu(fc1 . x) = M x with fc1 = [I; -I],
    fc2 = [M, -M], M = W_up diag(w) C. No planted power law: about half the neurons fire."""
    import gguf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_vocab = len(_vocab()[0])
    e, head = n_embd, n_embd // n_head
    n_kv = head  # one key/value head

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"token_embd.weight": normal(n_vocab, e), "output_norm.weight": 1 + normal(e, scale=0.1),
         "output_norm.bias": normal(e, scale=0.1), "output.weight": normal(n_vocab, e, scale=e ** -0.5)}
    resid = t["token_embd.weight"][rng.integers(0, n_vocab, size=512)]
    centre = np.eye(e, dtype=np.float32) - 1.0 / e
    pred, counts = {}, {}
    for il in range(n_layer):
        b = f"blk.{il}."
        t[b + "attn_norm.weight"] = 1 + normal(e, scale=0.1)
        t[b + "attn_norm.bias"] = np.zeros(e, dtype=np.float32)
        t[b + "attn_qkv.weight"] = normal(e + 2 * n_kv, e, scale=e ** -0.5)
        t[b + "attn_output.weight"] = normal(e, e, scale=e ** -0.5)
        t[b + "ffn_up.weight"] = normal(n_ff, e, scale=e ** -0.5)
        t[b + "ffn_down.weight"] = normal(e, n_ff, scale=n_ff ** -0.5)
        m = t[b + "ffn_up.weight"] @ np.diag(t[b + "attn_norm.weight"]) @ centre
        pred[b + "fc1.weight"] = np.concatenate([np.eye(e), -np.eye(e)]).astype(np.float32)
        pred[b + "fc2.weight"] = np.concatenate([m, -m], axis=1).astype(np.float32)
        counts[b + "ffn_act_count"] = ((resid @ m.T) > 0).sum(axis=0).astype(np.float32)
    paths = {"dense": str(out / "tiny-falcon.gguf"), "powerinfer": str(out / "tiny-falcon.powerinfer.gguf")}
    writers = {}
    for kind, path in paths.items():
        w = new_writer(path, "falcon")
        w.add_name("tiny-falcon")
        w.add_context_length(2048)
        w.add_embedding_length(e)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(1)
        w.add_layer_norm_eps(1e-5)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        if kind == "powerinfer":
            w.add_string(KEY_ACTIVATION, "relu")
            w.add_float32(KEY_THRESHOLD, 0.0)
        _add_vocab(w, unk=False)
        for name, arr in t.items():
            if kind == "powerinfer" and name.endswith("ffn_down.weight"):
                w.add_tensor(name.replace("ffn_down", "ffn_down_t"), np.ascontiguousarray(arr.T))
            else:
                w.add_tensor(name, arr)
        if kind == "powerinfer":
            for name, arr in {**pred, **counts}.items():
                w.add_tensor(name, arr)
        writers[kind] = w
    _finish(writers, paths, False, "tiny-falcon")
    return paths


@dataclass
class MoeSpec:
    """A tiny model of llama.cpp's `qwen3moe` architecture (Qwen3-30B-A3B's graph: q/k
    RMS norms, a softmax router whose top-k weights are renormalised, SwiGLU experts, no
    shared expert), random but well-scaled weights, the experts quantized."""

    name: str = "tiny-qwen3moe"
    n_embd: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ctx: int = 2048
    seed: int = 0
    attn_type: str = "Q8_0"     # attn_q/k/v/output, token_embd, output
    gate_up_type: str = "Q4_0"  # ffn_gate_exps, ffn_up_exps: [n_expert, n_ff_exp, n_embd]
    down_type: str = "Q8_0"     # ffn_down_exps: [n_expert, n_embd, n_ff_exp]
    bigram: float = 0.5         # weight of the planted successor in the output matrix


MOE_PRESETS: Dict[str, MoeSpec] = {"tiny-qwen3moe": MoeSpec()}


def generate_qwen3moe(out_dir: os.PathLike, spec: MoeSpec = MoeSpec(), progress: bool = False) -> str:
    """Writes <name>.gguf (architecture qwen3moe, the _vocab() tokenizer) into out_dir and
    returns its path. The router's logits have unit spread over normalised inputs, so tokens
    spread over the experts; every matrix is scaled to keep its output's RMS near its input's."""
    import gguf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    e, hd, f, n_exp = spec.n_embd, spec.head_dim, spec.n_ff_exp, spec.n_expert
    n_vocab = len(_vocab()[0])

    def normal(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    path = str(out / f"{spec.name}.gguf")
    w = new_writer(path, "qwen3moe")
    w.add_name(spec.name)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(e)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(f * spec.n_expert_used)
    w.add_expert_feed_forward_length(f)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    _add_vocab(w, unk=True)

    def add(name, arr, wtype="F32"):
        data, raw = _quant(arr, wtype)
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw)

    embd = normal(n_vocab, e, fan_in=1)
    add("token_embd.weight", embd, spec.attn_type)
    add("output_norm.weight", ones(e))
    # Random logits plus a planted bigram: token i's row leans towards the embedding of a
    # random successor, so greedy text wanders through the vocabulary instead of repeating,
    # with margins between the top logits well above the run-to-run noise of 8-bit inputs.
    succ = rng.permutation(n_vocab)
    add("output.weight", normal(n_vocab, e, fan_in=e) + spec.bigram * embd[np.argsort(succ)] / np.sqrt(e),
        spec.attn_type)
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        add(b + "attn_norm.weight", ones(e))
        add(b + "attn_q.weight", normal(spec.n_head * hd, e, fan_in=e), spec.attn_type)
        add(b + "attn_k.weight", normal(spec.n_head_kv * hd, e, fan_in=e), spec.attn_type)
        add(b + "attn_v.weight", normal(spec.n_head_kv * hd, e, fan_in=e), spec.attn_type)
        add(b + "attn_output.weight", normal(e, spec.n_head * hd, fan_in=spec.n_head * hd), spec.attn_type)
        add(b + "attn_q_norm.weight", ones(hd))
        add(b + "attn_k_norm.weight", ones(hd))
        add(b + "ffn_norm.weight", ones(e))
        add(b + "ffn_gate_inp.weight", normal(n_exp, e, fan_in=e))  # the router stays F32, as in real files
        add(b + "ffn_gate_exps.weight", normal(n_exp, f, e, fan_in=e), spec.gate_up_type)
        add(b + "ffn_up_exps.weight", normal(n_exp, f, e, fan_in=e), spec.gate_up_type)
        add(b + "ffn_down_exps.weight", normal(n_exp, e, f, fan_in=f), spec.down_type)
    finish(w, path, progress=progress)
    return path


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer_py.assets.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS) + sorted(MOE_PRESETS), default="tiny",
                    help="tiny-qwen3moe: a qwen3moe MoE model (only --seed and --name apply)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--name", help="file name stem (default: the preset's)")
    ap.add_argument("--active-frac", type=float, help="mean share of neurons firing per token")
    ap.add_argument("--power", type=float, help="firing law: neuron of rank k fires with probability ~ (k + 1)^-power")
    ap.add_argument("--pred-rank", type=int, help="predictor rank (a multiple of 32, at least the exact predictor's)")
    ap.add_argument("--pred-type", choices=("F32", "F16", "Q8_0", "Q4_0"), help="the predictor's type")
    ap.add_argument("--wtype", choices=("F32", "F16", "Q8_0", "Q4_0"), help="the other 2-D weights' type")
    args = ap.parse_args(argv)
    if args.preset in MOE_PRESETS:
        moe = replace(MOE_PRESETS[args.preset])
        moe.seed = moe.seed if args.seed is None else args.seed
        moe.name = args.name or moe.name
        print(json.dumps({"dense": generate_qwen3moe(args.out, moe)}, indent=1))
        return 0
    spec = replace(PRESETS[args.preset])
    for field, value in (("seed", args.seed), ("name", args.name), ("active_frac", args.active_frac),
                         ("power", args.power), ("pred_rank", args.pred_rank), ("pred_type", args.pred_type),
                         ("wtype", args.wtype)):
        if value is not None:
            setattr(spec, field, value)
    if not 0.0 < spec.active_frac < 0.95 or spec.power < 0 or spec.pred_rank < 0:
        ap.error("--active-frac must be in (0, 0.95), --power and --pred-rank >= 0")
    try:
        paths = generate(spec, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(paths, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
