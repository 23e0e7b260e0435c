"""Profile FFN activations with our engine:

    powerinfer profile MODEL --corpus FILE... [--n-tokens N] [--samples N] [--out DIR] [--plot PNG]

Runs the model (dense FFN, any GGUF or PowerInfer file the core loads) over --n-tokens
corpus tokens, in windows of --ctx tokens spread evenly over the corpus, and counts, per layer and neuron, the tokens on which the
neuron fired (act(gate) > 0; for a ReLU model exactly the neurons whose output is not
zero). Writes into DIR:

- `activation/activation_{i}.pt`: the counts as PowerInfer's 1-D int64 tensors;
- `stats.gguf`: the same counts as our statistics (`blk.N.ffn_act_count` F32[n_ff],
  `powerinfer.stats.n_tokens`), which `powerinfer convert --stats` embeds in a model;
- `profile.json`: tokens profiled, per-layer sparsity and hot-neuron curve;
- with --samples N: `samples/layer_{i}.npz` with N (x_res, mask) pairs per layer for
  `powerinfer train-predictor` (x_res: the residual stream before ffn_norm, the
  predictor's input, float16; mask: which neurons fired, np.packbits along axis 1).

It prints per layer the sparsity (share of neurons not firing, averaged over tokens)
and the power-law curve: the share of all activations owned by the hottest 1/5/10/20/50%
of neurons. --plot draws the curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from .._core import Context, Model
from ..formats import pt_io
from ..formats.gguf_io import write_stats_gguf
from .common import PipelineError, Progress, files, read_corpus, replacing, run_cli, tokenize_texts, write_text

CURVE_POINTS = (0.01, 0.05, 0.10, 0.20, 0.50)


def hot_curve(counts: np.ndarray, points: Sequence[float] = CURVE_POINTS) -> List[float]:
    """Share of the total activation count held by the top p of neurons, for each p."""
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    total = c.sum()
    if total == 0:
        return [0.0 for _ in points]
    cum = np.cumsum(c) / total
    return [float(cum[max(1, math.ceil(p * len(c))) - 1]) for p in points]


def profile(model_path: str, corpus: Sequence[str], out: str, n_tokens: int = 8192, samples: int = 0,
            ctx_len: int = 256, n_threads: int = 2, seed: int = 0, progress: bool = True) -> Dict:
    if n_tokens < 2 or ctx_len < 2 or samples < 0:
        raise PipelineError("--n-tokens and --ctx must be >= 2, --samples >= 0")
    texts = read_corpus(corpus)
    with Model(model_path, sparse_mode="dense") as model, \
            Context(model, n_ctx=ctx_len, n_batch=ctx_len, n_threads=n_threads) as ctx:
        n_layer, n_embd, n_ff = model.n_layer(), model.n_embd(), model.n_ff()
        ctx.set_ffn_capture(True)
        corpus_tokens = tokenize_texts(model_path, texts)
        if len(corpus_tokens) < 2:
            raise PipelineError("the corpus has fewer than 2 tokens")
        # windows spread evenly over the whole corpus, so every part of it is represented
        n_win = max(1, min(math.ceil(n_tokens / ctx_len), len(corpus_tokens) // ctx_len))
        starts = np.linspace(0, max(0, len(corpus_tokens) - ctx_len), n_win).astype(np.int64)
        tokens = np.concatenate([corpus_tokens[s : s + ctx_len] for s in starts])[:n_tokens]
        n = len(tokens)
        counts = np.zeros((n_layer, n_ff), dtype=np.int64)
        rng = np.random.default_rng(seed)
        take = np.sort(rng.choice(n, size=min(samples, n), replace=False)) if samples else np.zeros(0, np.int64)
        xs: List[List[np.ndarray]] = [[] for _ in range(n_layer)]
        ms: List[List[np.ndarray]] = [[] for _ in range(n_layer)]
        bar = Progress("profile", n, progress)
        for w0 in range(0, n, ctx_len):
            chunk = tokens[w0 : w0 + ctx_len]
            ctx.decode(chunk.tolist(), 0)
            sel = take[(take >= w0) & (take < w0 + len(chunk))] - w0
            for il in range(n_layer):
                x, act = ctx.ffn_capture(il)
                if len(act) != len(chunk):
                    raise RuntimeError(f"FFN capture of layer {il} returned {len(act)} tokens, expected {len(chunk)}")
                fired = act > 0
                counts[il] += fired.sum(axis=0)
                if len(sel):
                    xs[il].append(x[sel].copy())
                    ms[il].append(np.packbits(fired[sel], axis=1))
            bar.update(min(w0 + ctx_len, n))
        bar.close()

    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    pt_io.write_activation_dir(outp / "activation", counts)
    write_stats_gguf(str(outp / "stats.gguf"), counts, n)
    layers = []
    for il in range(n_layer):
        layers.append({"layer": il, "sparsity": float(1.0 - counts[il].sum() / (n * n_ff)),
                       "dead": int((counts[il] == 0).sum()),
                       "hot_curve": dict(zip([f"top{int(p * 100)}%" for p in CURVE_POINTS], hot_curve(counts[il])))})
    rep = {"model": os.path.abspath(model_path), "n_tokens": int(n), "n_layer": n_layer, "n_embd": n_embd,
           "n_ff": n_ff, "ctx": ctx_len, "mean_sparsity": float(np.mean([l["sparsity"] for l in layers])),
           "layers": layers, "n_samples": int(len(take))}
    if samples:
        sdir = outp / "samples"
        sdir.mkdir(exist_ok=True)
        for il in range(n_layer):
            x = np.concatenate(xs[il]) if xs[il] else np.zeros((0, n_embd), np.float32)
            x16 = x.astype(np.float16)
            with replacing(sdir / f"layer_{il}.npz") as tmp, open(tmp, "wb") as f:  # a name would gain .npz
                np.savez(f, x=x16 if np.isfinite(x16).all() else x,
                         mask=np.concatenate(ms[il]) if ms[il] else np.zeros((0, (n_ff + 7) // 8), np.uint8),
                         n_ff=np.int64(n_ff))
    write_text(outp / "profile.json", json.dumps(rep, indent=1))
    return rep


def format_report(rep: Dict) -> str:
    hdr = "| layer | sparsity | never fired | " + " | ".join(f"top {int(p * 100)}%" for p in CURVE_POINTS) + " |"
    lines = [f"{rep['n_tokens']} tokens profiled, {rep['n_layer']} layers x {rep['n_ff']} neurons; "
             f"mean sparsity {rep['mean_sparsity']:.1%}", "share of activations held by the hottest neurons:",
             hdr, "|" + "---|" * (3 + len(CURVE_POINTS))]
    for l in rep["layers"]:
        lines.append(f"| {l['layer']} | {l['sparsity']:.1%} | {l['dead']} | "
                     + " | ".join(f"{v:.1%}" for v in l["hot_curve"].values()) + " |")
    return "\n".join(lines)


def plot(rep: Dict, counts: Sequence[np.ndarray], png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PipelineError("--plot needs matplotlib (pip install matplotlib); the profile itself was written") from None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for il, c in enumerate(counts):
        c = np.sort(np.asarray(c, dtype=np.float64))[::-1]
        x = np.arange(1, len(c) + 1) / len(c)
        a1.plot(x, np.cumsum(c) / max(c.sum(), 1), lw=0.8, label=f"layer {il}" if len(counts) <= 8 else None)
        a2.loglog(np.arange(1, len(c) + 1), np.maximum(c, 0.5) / rep["n_tokens"], lw=0.8)
    a1.set_xlabel("fraction of neurons (hottest first)")
    a1.set_ylabel("fraction of activations")
    a1.set_title("hot-neuron coverage")
    if len(counts) <= 8:
        a1.legend(fontsize=7)
    a2.set_xlabel("neuron rank")
    a2.set_ylabel("firing frequency")
    a2.set_title(f"firing frequency by rank (mean sparsity {rep['mean_sparsity']:.1%})")
    fig.tight_layout()
    with replacing(png) as tmp:  # the format from png's name: the temporary one has none
        fig.savefig(tmp, dpi=110, format=Path(png).suffix[1:] or "png")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--corpus", nargs="+", required=True, help="text files")
    p.add_argument("--n-tokens", type=int, default=8192, help="corpus tokens to profile (default 8192)")
    p.add_argument("--samples", type=int, default=0, help="(x_res, mask) pairs to keep per layer for predictor training")
    p.add_argument("--out", default="profile", help="output directory (default ./profile)")
    p.add_argument("--ctx", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", help="save the hot-neuron curves as a PNG (needs matplotlib)")

    def run(a):
        rep = profile(a.model, a.corpus, a.out, n_tokens=a.n_tokens, samples=a.samples, ctx_len=a.ctx,
                      n_threads=a.threads, seed=a.seed)
        print(format_report(rep))
        if a.plot:
            plot(rep, pt_io.read_activation_dir(Path(a.out) / "activation"), a.plot)
            print(f"plot: {a.plot}")
        return 0

    def paths(a):
        out = [("--out", a.out, files(a.out, "activation/activation_*.pt", "stats.gguf", "profile.json",
                                      "samples/layer_*.npz")), ("--plot", a.plot, files(a.plot))]
        return out, [("the model", a.model, files(a.model))] + [("--corpus", f, files(f)) for f in a.corpus]

    return run_cli(run, argv, p, paths)


if __name__ == "__main__":
    sys.exit(main())
