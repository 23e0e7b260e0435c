"""Decode speed of the sparse modes against llama-cpp-python's dense engine, same
machine, same run, same threads:

    python -m powerinfer_py.bench_sparse [--dense PATH --powerinfer PATH] [--threads 2] [--n-gen 128]

Defaults to the 7B-shaped synthetic pair (python -m powerinfer_py.synthetic --preset 7b
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
import os
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

RESULT = "BENCH_SPARSE "
N_CTX = 512
PROMPT = b"The quick brown fox jumps over the lazy dog while the river runs on."
RUNS = [  # (label, engine, file kind, mode)
    ("llama-cpp-python dense", "llama-cpp-python", "dense", None),
    ("powerinfer dense", "powerinfer", "dense", "dense"),
    ("powerinfer gate", "powerinfer", "powerinfer", "gate"),
    ("powerinfer predictor", "powerinfer", "powerinfer", "predictor"),
]


def _default_paths() -> Dict[str, str]:
    from .models import cache_dir

    cache = cache_dir() / "synthetic"
    return {"dense": str(cache / "relu-7b-shaped.gguf"), "powerinfer": str(cache / "relu-7b-shaped.powerinfer.gguf")}


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
        from powerinfer_py._bindings import ffi, lib

        modes = {"dense": lib.POWERINFER_SPARSE_DENSE, "gate": lib.POWERINFER_SPARSE_GATE,
                 "predictor": lib.POWERINFER_SPARSE_PREDICTOR}
        mp = lib.powerinfer_model_default_params()
        mp.sparse_mode = modes[mode]
        mp.n_threads = threads
        model = lib.powerinfer_model_load(path.encode(), mp)
        if model == ffi.NULL:
            raise SystemExit(ffi.string(lib.powerinfer_last_error()).decode())
        cp = lib.powerinfer_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = N_CTX, threads, threads
        ctx = lib.powerinfer_context_new(model, cp)
        n_vocab = lib.powerinfer_model_n_vocab(model)
        buf = ffi.new("int32_t[]", 256)
        n = lib.powerinfer_tokenize(model, PROMPT, len(PROMPT), buf, 256, True, False)
        t_load = time.perf_counter() - t0
        assert lib.powerinfer_decode(ctx, buf, n, 0, False) == 0
        lib.powerinfer_reset_timings(ctx)
        one = ffi.new("int32_t[1]")
        t1 = time.perf_counter()
        for i in range(n_gen):
            logits = np.frombuffer(ffi.buffer(lib.powerinfer_get_logits_ith(ctx, -1), n_vocab * 4), dtype=np.float32)
            one[0] = int(np.argmax(logits))
            assert lib.powerinfer_decode(ctx, one, 1, n + i, False) == 0
        t_gen = time.perf_counter() - t1
        a, b = ffi.new("int64_t*"), ffi.new("int64_t*")
        active = []
        n_layer = lib.powerinfer_model_n_layer(model)
        for il in range(n_layer):
            lib.powerinfer_sparse_stats(ctx, il, a, b)
            active.append(a[0] / b[0] if b[0] else 1.0)
        bytes_per_tok = _weights_read_per_token(lambda n: lib.powerinfer_model_tensor_nbytes(model, n.encode()),
                                                n_layer, mode, active)
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

    from powerinfer_py import Llama

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


def measure_bandwidth(threads: int, n_bytes: int = 1 << 30) -> float:
    """Read bandwidth with `threads` threads, in bytes/s: best of 3 passes in which each
    thread sums its share of a 1 GiB array (numpy releases the GIL in the sum)."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(n_bytes // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, n_bytes / (time.perf_counter() - t))
    return best


def add_pair_arguments(p: argparse.ArgumentParser, dense_help: str, powerinfer_help: str) -> None:
    """The model pair, threads, decoded tokens and --json: shared with bench_hybrid."""
    d = _default_paths()
    p.add_argument("--dense", default=d["dense"], help=dense_help)
    p.add_argument("--powerinfer", default=d["powerinfer"], help=powerinfer_help)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--json", help="also write the results here")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench_sparse", description=__doc__.split("\n\n")[0])
    add_pair_arguments(p, "standard GGUF (llama-cpp-python and our dense mode)",
                       "its PowerInfer twin (gate and predictor modes)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over all runs; each row keeps its best (default 1)")
    p.add_argument("--no-interleave", action="store_true",
                   help="skip the interleaved pairs (each mode against llama-cpp-python step by step)")
    p.add_argument("--child", nargs=3, metavar=("ENGINE", "PATH", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--pair", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pair:
        print(RESULT + json.dumps(run_pair(args.dense, args.pair[0], args.pair[1], args.threads, args.n_gen)), flush=True)
        return 0
    if args.child:
        engine, path, mode = args.child
        res = run_child(engine, path, None if mode == "-" else mode, args.threads, args.n_gen)
        print(RESULT + json.dumps(res), flush=True)
        return 0
    for kind in ("dense", "powerinfer"):
        if not os.path.exists(getattr(args, kind)):
            print(f"error: {getattr(args, kind)} not found; make it with "
                  "`python -m powerinfer_py.synthetic --preset 7b --out ~/.cache/powerinfer-py/synthetic`", file=sys.stderr)
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
            cmd = [sys.executable, "-m", "powerinfer_py.bench_sparse", "--threads", str(args.threads),
                   "--n-gen", str(args.n_gen), "--child", engine, getattr(args, kind), mode or "-"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((l for l in out.stdout.splitlines() if l.startswith(RESULT)), None)
            if out.returncode != 0 or line is None:
                print(f"error: {label} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            res = dict(label=label, **json.loads(line[len(RESULT):]))
            if rows[j] is None or res["decode_tok_s"] > rows[j]["decode_tok_s"]:
                rows[j] = res
    pairs: Dict[str, Dict[str, Any]] = {}
    for label, engine, kind, mode in RUNS[1:] if not args.no_interleave else []:
        print(f"interleaved with llama-cpp-python: {label} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "powerinfer_py.bench_sparse", "--threads", str(args.threads), "--n-gen",
               str(args.n_gen), "--dense", args.dense, "--pair", getattr(args, kind), mode]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith(RESULT)), None)
        if out.returncode != 0 or line is None:
            print(f"error: interleaved {label} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        pairs[label] = json.loads(line[len(RESULT):])
    # After the children: a child's peak RSS would otherwise include this array
    # (Linux carries the parent's high-water mark across fork and exec).
    bw = measure_bandwidth(args.threads)
    ref = rows[0]["decode_tok_s"]
    print(f"\nmodel: {args.dense} (+ PowerInfer twin), threads {args.threads}, {args.n_gen} decoded tokens, "
          f"best of {args.repeat} round(s), "
          f"measured read bandwidth ({args.threads} threads) {bw / 1e9:.1f} GB/s\n")
    hdr = ("engine / mode", "decode tok/s", "vs llama-cpp-python", "active FFN", "weights/token", "GB/s", "of bandwidth", "peak RSS")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        rate = r["bytes_per_token"] * r["decode_tok_s"]
        print(f"| {r['label']} | {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / ref:.2f}x | {100 * r['active']:.1f}% | "
              f"{r['bytes_per_token'] / 2**30:.2f} GiB | {rate / 1e9:.1f} | {100 * rate / bw:.0f}% | {r['peak_rss_mib']:.0f} MiB |")
    if pairs:
        print("\nInterleaved (one process per pair, decode steps alternating with llama-cpp-python):\n")
        print("| engine / mode | decode tok/s | llama-cpp-python tok/s, same steps | ratio |")
        print("|---|---|---|---|")
        for label, r in pairs.items():
            print(f"| {label} | {r['ours_tok_s']:.2f} | {r['ref_tok_s']:.2f} | {r['ours_tok_s'] / r['ref_tok_s']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bw, "rows": rows, "interleaved": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
