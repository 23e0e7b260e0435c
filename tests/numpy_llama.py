"""An independent reference: the forward pass of a small F32 `llama` file (GGUF or PWRI,
as the synthetic generator writes them) in float64 numpy, with ggml's conventions
(RMS norm, RoPE rotating adjacent pairs, grouped-query heads mapped q // (n_head / n_head_kv),
ReLU FFN, the down projection as ffn_down_t rows) and an optional mask on the FFN's neurons.
It shares no code with the engine; tests use it where the engine must equal a masked
FFN that no engine path computes densely."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import numpy as np


def read_f32_model(path, tmp_dir: Path) -> tuple[Dict[str, np.ndarray], Dict[str, float]]:
    """Tensors (numpy layout: ggml's ne reversed) as float64, and the hyperparameters."""
    import gguf

    copy = Path(tmp_dir) / (Path(path).name + ".as-gguf")
    data = bytearray(Path(path).read_bytes())
    data[:4] = b"GGUF"  # gguf's reader wants the standard magic
    copy.write_bytes(bytes(data))
    reader = gguf.GGUFReader(str(copy))
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{t.name} is {t.tensor_type.name}; this reference reads F32 files only")
        tensors[t.name] = np.array(t.data, dtype=np.float64)
    arch = reader.fields["general.architecture"].contents()

    def field(key, default=None):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else default

    hp = {
        "n_layer": int(field("block_count")),
        "n_head": int(field("attention.head_count")),
        "n_head_kv": int(field("attention.head_count_kv")),
        "eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_base": float(field("rope.freq_base", 10000.0)),
    }
    return tensors, hp


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """x [T, heads, hd] at positions 0..T-1; pairs (2i, 2i+1) rotated by pos * base^(-2i/hd)."""
    T, _, hd = x.shape
    theta = np.arange(T)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]  # [T, hd/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def forward(tensors: Dict[str, np.ndarray], hp: Dict[str, float], tokens: Sequence[int],
            ffn_mask: Optional[Callable[[int, np.ndarray], np.ndarray]] = None) -> np.ndarray:
    """Logits [T, n_vocab] for every position (FFN activation ReLU, or SiLU with hp["act"] ==
    "silu"). ffn_mask(layer, x_res [T, n_embd]) -> [T, n_ff]
    multiplies the FFN's hidden activations (x_res: the residual stream entering the FFN,
    the predictor's input)."""
    W = tensors
    x = W["token_embd.weight"][list(tokens)]
    T = x.shape[0]
    n_head, n_kv = hp["n_head"], hp["n_head_kv"]
    hd = x.shape[1] // n_head
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(hp["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"], hp["eps"])
        q = _rope((h @ W[p + "attn_q.weight"].T).reshape(T, n_head, hd), hp["rope_base"])
        k = _rope((h @ W[p + "attn_k.weight"].T).reshape(T, n_kv, hd), hp["rope_base"])
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
        att = np.empty((T, n_head, hd))
        for j in range(n_head):
            kv = j // (n_head // n_kv)
            s = q[:, j] @ k[:, kv].T / np.sqrt(hd) + causal
            s = np.exp(s - s.max(axis=1, keepdims=True))
            att[:, j] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        f = _rms(x, W[p + "ffn_norm.weight"], hp["eps"])
        g = f @ W[p + "ffn_gate.weight"].T
        g = g / (1.0 + np.exp(-g)) if hp.get("act") == "silu" else np.maximum(g, 0)
        a = g * (f @ W[p + "ffn_up.weight"].T)
        if ffn_mask is not None:
            a = a * ffn_mask(il, x)
        down_t = W.get(p + "ffn_down_t.weight")
        x = x + (a @ down_t if down_t is not None else a @ W[p + "ffn_down.weight"].T)
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"], hp["eps"]) @ out.T
