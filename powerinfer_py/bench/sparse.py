"""Decode speed of the sparse modes against llama-cpp-python's dense engine, same
machine, same run, same threads:

    python -m powerinfer_py.bench sparse [--dense PATH --powerinfer PATH] [--threads 2] [--n-gen 128]

Defaults to the 7B-shaped synthetic pair (python -m powerinfer_py.assets.synthetic --preset 7b
--out ~/.cache/powerinfer-py/synthetic). llama-cpp-python runs the standard GGUF; our
engine runs it in dense mode, and the PowerInfer twin in gate and predictor modes.
Each run is its own subprocess (so peak RSS is its own): load, a 16-token prompt, then
n_gen greedy tokens one at a time. The table also shows the active-neuron fraction, the
weight bytes each token reads and that rate against the machine's measured memory
bandwidth. A second table runs each of our modes interleaved with llama-cpp-python
(one process, decode steps alternating), which cancels the machine's bandwidth drift.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .common import ChildError, add_pair_arguments, measure_bandwidth, missing_pair, print_table, spawn

N_CTX = 512
PROMPT = b"The quick brown fox jumps over the lazy dog while the river runs on."
RUNS = [  # (label, engine, file kind, mode)
    ("llama-cpp-python dense", "llama-cpp-python", "dense", None),
    ("powerinfer dense", "powerinfer", "dense", "dense"),
    ("powerinfer gate", "powerinfer", "powerinfer", "gate"),
    ("powerinfer predictor", "powerinfer", "powerinfer", "predictor"),
]


# ---- child ---------------------------------------------------------------------------


# Per-layer tensors and which modes read only the active rows of them.
_LAYER_TENSORS = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down", "ffn_down_t", "fc1", "fc2"]
_SPARSE_ROWS = {"gate": {"ffn_up", "ffn_down_t"}, "predictor": {"ffn_gate", "ffn_up", "ffn_down_t"}}


def _weights_read_per_token(nbytes, n_layer: int, mode: Optional[str], active: List[float]) -> float:
    """Bytes of weights one decode step reads: all but the embedding table (one row),
    the predictor only in predictor mode, and in the sparse modes only the active
    fraction of the FFN matrices they skip rows of. nbytes(name) -> size or -1."""
    total = sum(max(nbytes(n), 0) for n in ("output_norm.weight", "output.weight"))
    for il in range(n_layer):
        for kind in _LAYER_TENSORS:
            size = nbytes(f"blk.{il}.{kind}.weight")
            if size < 0 or (kind in ("fc1", "fc2") and mode != "predictor"):
                continue
            total += size * (active[il] if kind in _SPARSE_ROWS.get(mode, ()) else 1.0)
    return total


def run_child(engine: str, path: str, mode: Optional[str], threads: int, n_gen: int) -> Dict[str, Any]:
    """One run, in its own process (each engine is imported here, so the other's library
    does not count in this process's peak RSS)."""
    t0 = time.perf_counter()
    if engine == "llama-cpp-python":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, verbose=False)
        toks = llm.tokenize(PROMPT)
        t_load = time.perf_counter() - t0
        llm.eval(toks)
        t1 = time.perf_counter()
        for _ in range(n_gen):
            tok = int(np.argmax(llm._scores[-1]))
            llm.eval([tok])
        t_gen = time.perf_counter() - t1
        import gguf

        sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
        n_layer = llm.n_layer() if hasattr(llm, "n_layer") else llama_cpp.llama_model_n_layer(llm.model)
        bytes_per_tok = _weights_read_per_token(lambda n: sizes.get(n, -1), n_layer, None, [1.0] * n_layer)
        active = None
    else:
        from .._core import Context, Model

        with Model(path, sparse_mode=mode, n_threads=threads) as model, \
                Context(model, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads) as ctx:
            toks = model.tokenize(PROMPT, True, False)
            t_load = time.perf_counter() - t0
            ctx.decode(toks, 0)
            ctx.reset_timings()
            t1 = time.perf_counter()
            for i in range(n_gen):
                ctx.decode([int(np.argmax(ctx.logits(-1)))], len(toks) + i)
            t_gen = time.perf_counter() - t1
            n_layer = model.n_layer()
            active = [a / b if b else 1.0 for a, b in (ctx.sparse_stats(il) for il in range(n_layer))]
            bytes_per_tok = _weights_read_per_token(model.tensor_nbytes, n_layer, mode, active)
    return {
        "t_load": t_load,
        "decode_tok_s": n_gen / t_gen,
        "active": float(np.mean(active)) if active else 1.0,
        "bytes_per_token": bytes_per_tok,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }


def run_pair(dense_path: str, path: str, mode: str, threads: int, n_gen: int) -> Dict[str, Any]:
    """llama-cpp-python and one of our modes in one process, decode steps alternating, so
    both see the same memory bandwidth at every moment (this machine's drifts by ~30%
    from minute to minute). Each follows its own greedy tokens."""
    import llama_cpp

    from ..llama import Llama

    ref = llama_cpp.Llama(model_path=dense_path, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, verbose=False)
    ours = Llama(model_path=path, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, sparse_mode=mode,
                 verbose=False)
    ref.eval(ref.tokenize(PROMPT))
    ours.eval(ours.tokenize(PROMPT))
    t_ref = t_ours = 0.0
    for _ in range(n_gen):
        t = time.perf_counter()
        ref.eval([int(np.argmax(ref._scores[-1]))])
        t_ref += time.perf_counter() - t
        t = time.perf_counter()
        ours.eval([int(np.argmax(ours._last_logits_view()))])
        t_ours += time.perf_counter() - t
    return {"ref_tok_s": n_gen / t_ref, "ours_tok_s": n_gen / t_ours}


# ---- parent ----------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench sparse", description=__doc__.split("\n\n")[0])
    add_pair_arguments(p, "standard GGUF (llama-cpp-python and our dense mode)",
                       "its PowerInfer twin (gate and predictor modes)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over all runs; each row keeps its best (default 1)")
    p.add_argument("--no-interleave", action="store_true",
                   help="skip the interleaved pairs (each mode against llama-cpp-python step by step)")
    args = p.parse_args(argv)
    missing = missing_pair([args.dense, args.powerinfer])
    if missing:
        print(missing, file=sys.stderr)
        return 1
    if args.repeat < 1:
        print("error: --repeat must be >= 1", file=sys.stderr)
        return 1
    # Rounds over all runs, so a slow spell of this shared machine hits every engine;
    # each row keeps its best round.
    rows: List[Optional[Dict[str, Any]]] = [None] * len(RUNS)
    for rnd in range(args.repeat):
        for j, (label, engine, kind, mode) in enumerate(RUNS):
            print(f"round {rnd + 1}/{args.repeat}: running {label} ...", file=sys.stderr, flush=True)
            try:
                res = spawn(run_child, engine=engine, path=getattr(args, kind), mode=mode, threads=args.threads,
                            n_gen=args.n_gen)
            except ChildError as e:
                print(f"error: {label} failed:\n{e.output[-2000:]}", file=sys.stderr)
                return 1
            res = dict(label=label, **res)
            if rows[j] is None or res["decode_tok_s"] > rows[j]["decode_tok_s"]:
                rows[j] = res
    pairs: Dict[str, Dict[str, Any]] = {}
    for label, engine, kind, mode in RUNS[1:] if not args.no_interleave else []:
        print(f"interleaved with llama-cpp-python: {label} ...", file=sys.stderr, flush=True)
        try:
            pairs[label] = spawn(run_pair, dense_path=args.dense, path=getattr(args, kind), mode=mode,
                                 threads=args.threads, n_gen=args.n_gen)
        except ChildError as e:
            print(f"error: interleaved {label} failed:\n{e.output[-2000:]}", file=sys.stderr)
            return 1
    # After the children: a child's peak RSS would otherwise include this array
    # (Linux carries the parent's high-water mark across fork and exec).
    bw = measure_bandwidth(args.threads)
    ref = rows[0]["decode_tok_s"]
    table = []
    for r in rows:
        rate = r["bytes_per_token"] * r["decode_tok_s"]
        table.append([r["label"], f"{r['decode_tok_s']:.2f}", f"{r['decode_tok_s'] / ref:.2f}x", f"{100 * r['active']:.1f}%",
                      f"{r['bytes_per_token'] / 2**30:.2f} GiB", f"{rate / 1e9:.1f}", f"{100 * rate / bw:.0f}%",
                      f"{r['peak_rss_mib']:.0f} MiB"])
    print()
    print_table(f"model: {args.dense} (+ PowerInfer twin), threads {args.threads}, {args.n_gen} decoded tokens, "
                f"best of {args.repeat} round(s), measured read bandwidth ({args.threads} threads) {bw / 1e9:.1f} GB/s",
                ("engine / mode", "decode tok/s", "vs llama-cpp-python", "active FFN", "weights/token", "GB/s",
                 "of bandwidth", "peak RSS"), table)
    if pairs:
        print()
        print_table("Interleaved (one process per pair, decode steps alternating with llama-cpp-python):",
                    ("engine / mode", "decode tok/s", "llama-cpp-python tok/s, same steps", "ratio"),
                    [[label, f"{r['ours_tok_s']:.2f}", f"{r['ref_tok_s']:.2f}", f"{r['ours_tok_s'] / r['ref_tok_s']:.2f}x"]
                     for label, r in pairs.items()])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bw, "rows": rows, "interleaved": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
