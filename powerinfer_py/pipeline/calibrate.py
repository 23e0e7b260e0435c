"""Training-free gate sparsity for SiLU/GELU models (CATS-style): from a text corpus,
pick per layer the threshold tau on |act(gate)| that skips a target fraction of FFN
neurons, and write a copy of the GGUF that gate mode can run:

    powerinfer calibrate MODEL.gguf --corpus FILE [FILE...] --sparsity 0.4 --out OUT.gguf [--eval HELD_OUT]

The copy holds every key and tensor of the input, plus `blk.N.ffn_down_t.weight` (the
down projection transposed, Q8_0, so down can be sparse) and
`powerinfer.gate_thresholds` (f32 per layer). The input file is never modified; the
output is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .._core import Context, Model
from ..formats.gguf_io import KEY_GATE_THRESHOLDS, copy_kv, finish, new_writer, open_gguf
from .common import PipelineError, check_output, files, read_corpus, run_chunks, run_cli, same_file

T = TypeVar("T")


def decode_calibration(model_path: str, texts: Sequence[str], n_tokens: int, read: Callable[[Context], T],
                       n_threads: int = 2, chunk: int = 256, progress: bool = True, spread: bool = False) -> Tuple[T, int]:
    """Runs up to n_tokens calibration tokens (whole chunks) through the dense model with the
    core's activation histograms on; returns (read(context) afterwards, tokens used). The
    tokens are the texts' first, or with spread, one chunk from each of n_tokens / chunk
    evenly spaced places of the texts (common.spread_pieces; the first when the texts are
    too short for that)."""
    with Model(model_path, sparse_mode="dense") as model, \
            Context(model, n_ctx=chunk, n_batch=chunk, n_threads=n_threads, collect_activations=True) as ctx:
        used = run_chunks(lambda t: model.tokenize(t.encode(), True, False), lambda c: ctx.decode(c, 0), texts, n_tokens,
                          chunk, spread, progress)
        return read(ctx), used


def collect_histograms(model_path: str, texts: Sequence[str], n_tokens: int, n_threads: int = 2,
                       chunk: int = 256, progress: bool = True):
    """Per-layer histograms of |act(gate)| over up to n_tokens corpus tokens.
    Returns (counts [n_layer, n_bins], log10_min, log10_max)."""
    return decode_calibration(model_path, texts, n_tokens, Context.activation_histograms, n_threads, chunk, progress)[0]


def thresholds_for_sparsity(counts: np.ndarray, log10_min: float, log10_max: float, sparsity: float) -> np.ndarray:
    """Per layer, the |act| value below which `sparsity` of the samples fall
    (interpolated log-linearly inside the histogram bin)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    n_bins = counts.shape[1]
    width = (log10_max - log10_min) / n_bins
    taus = np.zeros(counts.shape[0], dtype=np.float32)
    for il, row in enumerate(counts.astype(np.float64)):
        total = row.sum()
        if total == 0 or sparsity == 0.0:
            continue
        cdf = np.cumsum(row) / total
        b = int(np.searchsorted(cdf, sparsity))
        prev = cdf[b - 1] if b > 0 else 0.0
        frac = (sparsity - prev) / max(cdf[b] - prev, 1e-12)
        taus[il] = 10.0 ** (log10_min + (b + frac) * width)
    return taus


def write_gate_model(src: str, dst: str, taus: np.ndarray, progress: bool = True) -> None:
    """Copies src to dst adding ffn_down_t (Q8_0, or F16 if rows do not fit Q8_0 blocks)
    and the per-layer thresholds."""
    import gguf

    if same_file(src, dst):
        raise PipelineError("the output must not be the input file")
    reader = open_gguf(src)
    w = new_writer(dst, reader.get_field("general.architecture").contents())
    copy_kv(reader, w, skip={KEY_GATE_THRESHOLDS})
    w.add_array(KEY_GATE_THRESHOLDS, [float(t) for t in taus])
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order, in elements
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # quantized data: byte shape, converted by gguf
        if t.name.endswith(".ffn_down.weight"):
            down = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)  # [n_embd, n_ff]
            down_t = np.ascontiguousarray(down.T.astype(np.float32))           # [n_ff, n_embd]
            if down_t.shape[1] % 32 == 0:
                q = gguf.quants.quantize(down_t, gguf.GGMLQuantizationType.Q8_0)
                w.add_tensor(t.name.replace("ffn_down", "ffn_down_t"), q, raw_shape=q.shape,
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(t.name.replace("ffn_down", "ffn_down_t"), down_t.astype(np.float16))
    finish(w, dst, progress=progress, inputs=[src])


def evaluate(model_path: str, text: str, mode: str, n_tokens: int = 200, n_threads: int = 2):
    """Mean next-token NLL (nats) over the first n_tokens of text, fed one token at a
    time so the sparse path runs, and the decode speed (tokens/s) of those steps."""
    with Model(model_path, sparse_mode=mode) as model, Context(model, n_ctx=n_tokens + 8, n_threads=n_threads) as ctx:
        toks = model.tokenize(text.encode(), True, False)[:n_tokens]
        nll = []
        t0 = time.perf_counter()
        for pos, tok in enumerate(toks[:-1]):
            ctx.decode([tok], pos)
            x = ctx.logits(-1).astype(np.float64)
            m = x.max()
            nll.append(m + np.log(np.exp(x - m).sum()) - x[toks[pos + 1]])
        dt = time.perf_counter() - t0
        return float(np.mean(nll)), (len(toks) - 1) / dt


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--corpus", nargs="+", required=True, help="text files")
    p.add_argument("--sparsity", type=float, default=0.4, help="fraction of FFN neurons to skip per layer (default 0.4)")
    p.add_argument("--n-tokens", type=int, default=4096, help="corpus tokens to sample (default 4096)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--eval", metavar="FILE", help="held-out text: print NLL and decode speed, dense vs gate")

    def run(args):
        # every argument before the minutes of calibration
        if not 0.0 <= args.sparsity < 1.0:  # NaN too
            raise PipelineError(f"--sparsity must be in [0, 1), got {args.sparsity}")
        if args.n_tokens < 1 or args.threads < 1:
            raise PipelineError(f"--n-tokens and --threads must be >= 1, got {args.n_tokens} and {args.threads}")
        if not os.path.isfile(args.model):
            raise PipelineError(f"model {args.model}: no such file")
        if args.eval and not os.path.isfile(args.eval):
            raise PipelineError(f"--eval {args.eval}: no such file")
        check_output(args.out, "--out", os.path.getsize(args.model))
        texts = read_corpus(args.corpus)
        counts, lo, hi = collect_histograms(args.model, texts, args.n_tokens, args.threads)
        taus = thresholds_for_sparsity(counts, lo, hi, args.sparsity)
        print("per-layer thresholds: " + " ".join(f"{t:.4g}" for t in taus), file=sys.stderr)
        write_gate_model(args.model, args.out, taus)
        if args.eval:
            held_out = Path(args.eval).read_text(errors="replace")
            d_nll, d_speed = evaluate(args.out, held_out, "dense", n_threads=args.threads)
            g_nll, g_speed = evaluate(args.out, held_out, "gate", n_threads=args.threads)
            print(f"| mode | mean NLL (nats) | decode tok/s |\n|---|---|---|\n| dense | {d_nll:.4f} | {d_speed:.2f} |\n"
                  f"| gate {args.sparsity:.0%} | {g_nll:.4f} (+{g_nll - d_nll:.4f}) | {g_speed:.2f} ({g_speed / d_speed:.2f}x) |")
        print(args.out)
        return 0

    def paths(a):
        inputs = [("the model", a.model, files(a.model))] + [("--corpus", f, files(f)) for f in a.corpus]
        return [("--out", a.out, files(a.out))], inputs + [("--eval", a.eval, files(a.eval))]

    return run_cli(run, argv, p, paths)


if __name__ == "__main__":
    sys.exit(main())
