"""Sparse inference against llama-cpp-python's dense engine, same machine, same run,
same threads: decode in each sparse mode, prompt processing, and peak memory.

    python -m powerinfer_py.bench sparse [--dense PATH --powerinfer PATH] [--threads 2]
                                         [--n-gen 64] [--prompts 64,512] [--modes dense,gate,predictor]
    python -m powerinfer_py.bench sparse --model MODEL.gguf [--sparsities 0,0.25,0.4,0.5] ...
                                         input sparsity on any GGUF (bench/input_sparse.py)

Defaults to the 7B-shaped synthetic pair (python -m powerinfer_py.assets.synthetic --preset 7b
--out ~/.cache/powerinfer-py/synthetic). llama-cpp-python runs the standard GGUF; our
engine runs its PowerInfer twin in each mode. The machine's bandwidth drifts by tens of
percent from minute to minute, so every comparison holds both engines in one process and
alternates their steps (decode tokens, or whole prompts), and the ratios are what to read.

Decode: after a 16-token prompt, --n-gen greedy tokens one at a time. For each mode the
table gives the weight bytes a token reads (attention, norms, output, predictor, and of
the FFN matrices only the active rows the engine counted) and the ideal speed-up, dense
bytes / sparse bytes, then the achieved ratio and its fraction of that ideal. Prompt
processing: prompts of --prompts tokens evaluated in one call. Peak RSS: each engine
alone in its own process (load, the longest prompt, the decode).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._machine import best_alternating, cpu_model, measure_bandwidth
from ..pipeline.evaluate import prompt_timer
from .common import (add_pair_arguments, ChildError, greedy_steps_interleaved, missing_pair, peak_rss, print_rss_table,
                     print_table, prompt_tokens, spawn)

PROMPT_TEXT = (
    "In the beginning of the industrial age, the cities of northern England grew faster than anyone had "
    "planned. Mills rose along every river, and the people who came to work in them lived in narrow streets. "
)
MODES = ("dense", "gate", "predictor")

# Per-layer weight tensors, and which of them each mode reads only the active rows of
# (dense mode on a file with only ffn_down_t adds the rows with a nonzero activation).
_LAYER_TENSORS = ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down", "ffn_down_t", "fc1", "fc2")
_SPARSE_ROWS = {"dense": {"ffn_down_t"}, "gate": {"ffn_up", "ffn_down_t"},
                "predictor": {"ffn_gate", "ffn_up", "ffn_down_t"}}


def weights_read_per_token(nbytes: Callable[[str], int], n_layer: int, mode: Optional[str],
                           active: Sequence[float]) -> float:
    """Bytes of weights one decode step reads: all but the token embeddings (one row),
    the predictor only in predictor mode, and in the sparse modes only the active fraction
    of the FFN rows they skip. nbytes(name) -> size or -1; mode None: llama.cpp's dense read."""
    total = sum(max(nbytes(n), 0) for n in ("output_norm.weight", "output_norm.bias", "output.weight"))
    if nbytes("output.weight") < 0:  # tied output: the embeddings are read whole by the LM head
        total += max(nbytes("token_embd.weight"), 0)
    for il in range(n_layer):
        for kind in _LAYER_TENSORS:
            for suffix in ("weight", "bias"):
                size = nbytes(f"blk.{il}.{kind}.{suffix}")
                if size < 0 or (kind in ("fc1", "fc2") and mode != "predictor"):
                    continue
                total += size * (active[il] if mode and kind in _SPARSE_ROWS[mode] else 1.0)
    return total


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _engines(dense_path: str, path: str, mode: str, threads: int, n_ctx: int):
    import llama_cpp

    from ..llama import Llama

    ref = llama_cpp.Llama(model_path=dense_path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    ours = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 sparse_mode=mode, verbose=False)
    return ref, ours


# ---- children -------------------------------------------------------------------------------


def decode_pair(dense_path: str, path: str, mode: str, threads: int, n_gen: int) -> Dict[str, Any]:
    """Both engines in this process, decode steps alternating; each follows its own greedy
    tokens after the same 16-token prompt. Also the bytes each engine's token reads."""
    import gguf

    ref, ours = _engines(dense_path, path, mode, threads, 512)
    prompt = prompt_tokens(ref.tokenize, 16, PROMPT_TEXT)
    ref.eval(prompt)
    ours.eval(prompt_tokens(ours.tokenize, 16, PROMPT_TEXT))
    ours.reset_timings()
    t_ref, t_ours = greedy_steps_interleaved(ref, ours, n_gen)
    stats = ours.sparse_stats()
    n_layer = len(stats["layers"])
    active = [1.0 if a is None else a for a in stats["layers"]]
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(dense_path).tensors}
    return {
        "mode": stats["mode"],
        "ref_tok_s": n_gen / t_ref,
        "ours_tok_s": n_gen / t_ours,
        "active": stats["active"],
        "dense_bytes": weights_read_per_token(lambda n: sizes.get(n, -1), n_layer, None, [1.0] * n_layer),
        "sparse_bytes": weights_read_per_token(ours._model.tensor_nbytes, n_layer, stats["mode"], active),
    }


def prompt_pair(dense_path: str, path: str, mode: str, threads: int, lengths: Sequence[int], reps: int) -> Dict[str, Any]:
    """Both engines in this process; each prompt length evaluated `reps` times by each,
    alternating; the best time of each."""
    ref, ours = _engines(dense_path, path, mode, threads, max(lengths) + 64)
    out: Dict[str, Any] = {}
    for n in lengths:
        toks_ref = prompt_tokens(ref.tokenize, n, PROMPT_TEXT)
        toks_ours = prompt_tokens(ours.tokenize, n, PROMPT_TEXT)
        best_ref, best_ours = best_alternating([prompt_timer(ref, toks_ref), prompt_timer(ours, toks_ours)], reps)
        out[str(n)] = {"ref_tok_s": n / best_ref, "ours_tok_s": n / best_ours}
    return out


# ---- parent -------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    if argv is not None and "--model" in argv or argv is None and "--model" in sys.argv[1:]:
        from . import input_sparse  # input sparsity on any GGUF (powerinfer sparsify)

        return input_sparse.main(argv)
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench sparse", description=__doc__.split("\n\n")[0])
    add_pair_arguments(p, "standard GGUF (llama-cpp-python)", "its PowerInfer twin (our engine, every mode)")
    p.set_defaults(n_gen=64)
    p.add_argument("--modes", default=",".join(MODES), help="our modes on the PowerInfer file (default: all three)")
    p.add_argument("--prompts", default="64,512", help="prompt lengths in tokens, comma-separated ('' skips)")
    p.add_argument("--prompt-reps", type=int, default=2, help="evaluations of each prompt per engine (best kept)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs")
    args = p.parse_args(argv)
    missing = missing_pair([args.dense, args.powerinfer])
    if missing:
        print(missing, file=sys.stderr)
        return 1
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    try:
        lengths = [int(n) for n in args.prompts.split(",") if n.strip()]
    except ValueError:
        lengths = [-1]
    if bad or not modes or any(n < 1 or n > 4096 for n in lengths) or args.n_gen < 1 or args.prompt_reps < 1:
        print("error: --modes takes dense, gate, predictor; --prompts lengths in [1, 4096]; --n-gen and "
              "--prompt-reps >= 1", file=sys.stderr)
        return 1

    results: Dict[str, Any] = {"decode": {}, "prompt": {}, "rss": {}}
    try:
        for mode in modes:
            print(f"decode, interleaved with llama-cpp-python: {mode} ...", file=sys.stderr, flush=True)
            results["decode"][mode] = spawn(decode_pair, dense_path=args.dense, path=args.powerinfer, mode=mode,
                                            threads=args.threads, n_gen=args.n_gen)
        for mode in [m for m in ("predictor", "dense") if m in modes] if lengths else []:
            print(f"prompt processing, interleaved: {mode} ...", file=sys.stderr, flush=True)
            results["prompt"][mode] = spawn(prompt_pair, dense_path=args.dense, path=args.powerinfer, mode=mode,
                                            threads=args.threads, lengths=lengths, reps=args.prompt_reps)
        if not args.no_rss:
            n_prompt = max(lengths) if lengths else 16
            for label, engine, path, mode in (("llama-cpp-python", "llama-cpp-python", args.dense, None),
                                              ("powerinfer " + modes[-1], "powerinfer", args.powerinfer, modes[-1])):
                print(f"peak RSS: {label} ...", file=sys.stderr, flush=True)
                results["rss"][label] = spawn(peak_rss, engine=engine, path=path, threads=args.threads, n_prompt=n_prompt,
                                              n_gen=args.n_gen, prompt_text=PROMPT_TEXT, sparse_mode=mode)
    except ChildError as e:
        print(f"error: a benchmark run failed ({e.reason}):\n{e.output[-2000:]}", file=sys.stderr)
        return 1
    # After the children: a child's peak RSS would otherwise include this array
    # (Linux carries the parent's high-water mark across fork and exec).
    bw = measure_bandwidth(args.threads)
    results["bandwidth"] = bw
    results["cpu"] = cpu_model()

    print(f"\nmodels: {args.dense} (llama-cpp-python) and {args.powerinfer} (powerinfer); {args.threads} threads; "
          f"measured read bandwidth ({args.threads} threads) {bw / 1e9:.1f} GB/s\n")
    rows = []
    for mode, r in results["decode"].items():
        ideal = r["dense_bytes"] / r["sparse_bytes"]
        achieved = r["ours_tok_s"] / r["ref_tok_s"]
        rows.append([f"{mode} ({r['mode']})" if r["mode"] != mode else mode,
                     "-" if r["active"] is None else f"{100 * r['active']:.1f}%",
                     f"{_size(r['sparse_bytes'])} / {_size(r['dense_bytes'])}", f"{ideal:.2f}x",
                     f"{r['ref_tok_s']:.2f}", f"{r['ours_tok_s']:.2f}", f"{achieved:.2f}x", f"{100 * achieved / ideal:.0f}%"])
    print_table(f"Decode, {args.n_gen} tokens, steps interleaved with llama-cpp-python in one process:",
                ("mode", "active FFN", "weights/token (ours / dense)", "ideal (dense / sparse bytes)",
                 "llama-cpp-python tok/s", "powerinfer tok/s", "achieved", "of ideal"), rows)
    if results["prompt"]:
        print()
        rows = [[mode, n, f"{r['ref_tok_s']:.1f}", f"{r['ours_tok_s']:.1f}", f"{r['ours_tok_s'] / r['ref_tok_s']:.2f}x"]
                for mode, by_len in results["prompt"].items() for n, r in by_len.items()]
        print_table(f"Prompt processing (one call per prompt, best of {args.prompt_reps}, engines alternating):",
                    ("mode", "prompt tokens", "llama-cpp-python tok/s", "powerinfer tok/s", "ratio"), rows)
    print_rss_table(results["rss"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
