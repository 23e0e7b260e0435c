"""Hybrid placement benchmark: decode and prompt speed with budgets of 25%, 50% and 75% of the
model's size on the device, against llama-cpp-python given the same memory through
n_gpu_layers, same machine, same run, same threads:

    python -m powerinfer_py.bench hybrid [--dense PATH --powerinfer PATH] [--threads N] [--n-gen 128]
                                         [--n-prompt 256]

Defaults to the 7B-shaped synthetic pair (python -m powerinfer_py.assets.synthetic --preset 7b).
Without a GPU backend in the installed ggml the "device" is emulated in host memory
(--emulate, chosen automatically): the split graph, the scheduler and the accounting
all run, but both sides share the CPU, so the speed column then measures the split's
overhead, not a GPU's gain. The table also shows what the engine put on the device
(its own accounting, never above the budget) and each run's peak host RSS.

Placement needs per-neuron activation counts: the model's blk.N.ffn_act_count when it
has them, else the benchmark profiles --profile-tokens tokens with the engine (FFN
capture) and hands them over as PowerInfer's activation/activation_{i}.pt files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .common import add_pair_arguments, ChildError, missing_pair, peak_rss_mib, print_table, spawn, upstream_last_logits

N_CTX = 512
N_BATCH = 32  # decode-only benchmark: a short prompt, small compute buffers (both engines)
PROMPT = b"The quick brown fox jumps over the lazy dog while the river runs on."


def _layer_bytes(path: str) -> List[int]:
    """Per-layer weight bytes of a GGUF."""
    import gguf

    per_layer: Dict[int, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk."):
            il = int(t.name.split(".")[1])
            per_layer[il] = per_layer.get(il, 0) + int(t.n_bytes)
    return [per_layer[i] for i in sorted(per_layer)]


def gpu_layers_for(path: str, budget: int) -> int:
    """The n_gpu_layers llama.cpp can hold in `budget` bytes of weights (its KV cache and
    compute buffers are not counted, which favours it)."""
    layers = _layer_bytes(path)
    used, n = 0, 0
    for b in layers:
        if used + b > budget:
            break
        used += b
        n += 1
    return n


def has_gpu_backend() -> bool:
    # Not llama_cpp.llama_supports_gpu_offload(): true for any build with the RPC backend.
    from .._core import gpu_count

    return gpu_count() > 0


# ---- child -------------------------------------------------------------------------------


def _decode(eval_fn, logits_fn, prompt_tokens, n_gen: int) -> float:
    eval_fn(prompt_tokens)
    t = time.perf_counter()
    for _ in range(n_gen):
        eval_fn([int(np.argmax(logits_fn()))])
    return n_gen / (time.perf_counter() - t)


def _prompt(eval_fn, reset_fn, tokens) -> float:
    """Prompt tok/s: the tokens through a fresh sequence, in the context's n_batch batches."""
    reset_fn()
    t = time.perf_counter()
    eval_fn(tokens)
    return len(tokens) / (time.perf_counter() - t)


def _prompt_tokens(tokenize, n: int) -> List[int]:
    """n tokens of the benchmark's text, repeated (the first is BOS)."""
    toks, more = tokenize(PROMPT), tokenize(b" " + PROMPT, add_bos=False)
    while len(toks) < n:
        toks = toks + more
    return toks[:n]


def run_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One run, in its own process (each engine is imported here, so the other's library
    does not count in this process's peak RSS)."""
    out: Dict[str, Any] = {}
    if spec["engine"] == "llama-cpp-python":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=N_CTX, n_batch=N_BATCH, n_threads=spec["threads"],
                              n_threads_batch=spec["threads"], n_gpu_layers=spec["n_gpu_layers"], verbose=False)
        out["decode_tok_s"] = _decode(llm.eval, lambda: upstream_last_logits(llm), llm.tokenize(PROMPT), spec["n_gen"])
        if spec.get("n_prompt"):
            out["prompt_tok_s"] = _prompt(llm.eval, llm.reset, _prompt_tokens(llm.tokenize, spec["n_prompt"]))
    else:
        from ..llama import Llama

        llm = Llama(model_path=spec["path"], n_ctx=N_CTX, n_batch=N_BATCH, n_threads=spec["threads"],
                    n_threads_batch=spec["threads"],
                    sparse_mode="predictor", vram_budget=spec["budget"] / 2**30, emulate_device=spec["emulate"],
                    activation_dir=spec.get("activation_dir"), verbose=False)
        out["placement"] = llm.placement()
        out["decode_tok_s"] = _decode(llm.eval, llm._last_logits_view, llm.tokenize(PROMPT), spec["n_gen"])
        if spec.get("n_prompt"):
            out["prompt_tok_s"] = _prompt(llm.eval, llm.reset, _prompt_tokens(llm.tokenize, spec["n_prompt"]))
    out["peak_rss_mib"] = peak_rss_mib()
    return out


# ---- counts --------------------------------------------------------------------------------


def _model_has_counts(path: str) -> bool:
    from .._core import Model, PowerInferError

    try:
        with Model(path, vocab_only=True) as model:
            return model.tensor_nbytes("blk.0.ffn_act_count") > 0
    except PowerInferError as e:
        raise SystemExit(f"error: {path}: {e.core_message}") from None


def profile_counts(path: str, n_tokens: int, threads: int, out_dir: str) -> str:
    """Activation counts over n_tokens tokens of the benchmark's prompt text, by
    `powerinfer profile`; returns its activation/ folder (activation_{i}.pt)."""
    from ..pipeline.profile import profile

    corpus = os.path.join(out_dir, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(" ".join([PROMPT.decode()] * (n_tokens // 8 + 1)))
    profile(path, [corpus], out_dir, n_tokens=n_tokens, ctx_len=n_tokens, n_threads=threads, progress=False)
    return os.path.join(out_dir, "activation")


# ---- parent --------------------------------------------------------------------------------


def _run(spec: Dict[str, Any]) -> Dict[str, Any]:
    try:
        return spawn(run_child, spec=spec)
    except ChildError as e:
        raise SystemExit(f"error: {spec['engine']} run failed:\n{e.output[-3000:]}") from None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench hybrid", description=__doc__.split("\n\n")[0])
    add_pair_arguments(p, "standard GGUF (llama-cpp-python)", "its PowerInfer twin (predictor mode, hybrid)")
    p.add_argument("--budgets", default="0.25,0.5,0.75", help="fractions of the model's size")
    p.add_argument("--emulate", choices=("auto", "yes", "no"), default="auto",
                   help="emulate the device in host memory (auto: when ggml has no GPU backend)")
    p.add_argument("--profile-tokens", type=int, default=64)
    p.add_argument("--n-prompt", type=int, default=256,
                   help=f"prompt tokens for the prompt tok/s column, in batches of {N_BATCH} (0: no prompt column)")
    args = p.parse_args(argv)
    if not 0 <= args.n_prompt <= N_CTX:
        print(f"error: --n-prompt must be in [0, {N_CTX}], not {args.n_prompt}", file=sys.stderr)
        return 1
    missing = missing_pair([args.dense, args.powerinfer])
    if missing:
        print(missing, file=sys.stderr)
        return 1
    emulate = args.emulate == "yes" or (args.emulate == "auto" and not has_gpu_backend())
    try:
        fractions = [float(f) for f in args.budgets.split(",")]
    except ValueError:
        print(f"error: --budgets must be comma-separated fractions, not {args.budgets!r}", file=sys.stderr)
        return 1
    if not all(0.0 < f <= 1.0 for f in fractions):
        print("error: each budget fraction must be in (0, 1]", file=sys.stderr)
        return 1
    size = os.path.getsize(args.dense)
    base = {"threads": args.threads, "n_gen": args.n_gen, "n_prompt": args.n_prompt}
    with tempfile.TemporaryDirectory() as tmp:
        act_dir = None
        if not _model_has_counts(args.powerinfer):
            print(f"profiling {args.profile_tokens} tokens for activation counts ...", file=sys.stderr, flush=True)
            act_dir = profile_counts(args.powerinfer, args.profile_tokens, args.threads, tmp)
        rows = []
        print("running llama-cpp-python on the CPU ...", file=sys.stderr, flush=True)
        cpu = _run(dict(base, engine="llama-cpp-python", path=args.dense, n_gpu_layers=0))
        for f in fractions:
            budget = int(f * size)
            ngl = gpu_layers_for(args.dense, budget)
            print(f"budget {100 * f:.0f}%: powerinfer ...", file=sys.stderr, flush=True)
            ours = _run(dict(base, engine="powerinfer", path=args.powerinfer, budget=budget, emulate=emulate,
                             activation_dir=act_dir))
            print(f"budget {100 * f:.0f}%: llama-cpp-python -ngl {ngl} ...", file=sys.stderr, flush=True)
            ref = _run(dict(base, engine="llama-cpp-python", path=args.dense, n_gpu_layers=ngl))
            rows.append({"fraction": f, "budget": budget, "n_gpu_layers": ngl, "powerinfer": ours, "llama_cpp": ref})
    where = "device EMULATED in host memory (no GPU backend): speed shows the split's overhead" if emulate \
        else "device: " + next((r["powerinfer"]["placement"]["device"] for r in rows
                                 if r["powerinfer"]["placement"]["active"]), "none (nothing was placed)")
    mib = 2**20
    table = []
    for r in rows:
        pl = r["powerinfer"]["placement"]
        speed = r["powerinfer"]["decode_tok_s"] / r["llama_cpp"]["decode_tok_s"]
        prompt = ["-"] * 3
        if args.n_prompt:
            pp, pp_ref = r["powerinfer"]["prompt_tok_s"], r["llama_cpp"]["prompt_tok_s"]
            prompt = [f"{pp:.1f}", f"{pp_ref:.1f}", f"{pp / pp_ref:.2f}x"]
        table.append([f"{100 * r['fraction']:.0f}% ({r['budget'] / mib:.0f} MiB)",
                      f"{pl['bytes_total'] / mib:.0f} MiB ({pl['bytes_dense'] / mib:.0f} / {pl['bytes_kv'] / mib:.0f} / "
                      f"{pl['bytes_compute'] / mib:.0f} / {pl['bytes_ffn'] / mib:.0f})",
                      f"{100 * pl['n_hot'] / pl['n_neurons']:.1f}%", f"{r['powerinfer']['peak_rss_mib']:.0f} MiB",
                      f"{r['powerinfer']['decode_tok_s']:.2f}", str(r["n_gpu_layers"]),
                      f"{r['llama_cpp']['decode_tok_s']:.2f}", f"{r['llama_cpp']['peak_rss_mib']:.0f} MiB", f"{speed:.2f}x", *prompt])
    print()
    print_table(f"model: {args.dense} ({size / 2**30:.2f} GiB) + PowerInfer twin, predictor mode, threads {args.threads}, "
                f"{args.n_gen} decoded tokens, prompt {args.n_prompt} tokens in batches of {N_BATCH}; {where}. "
                f"llama-cpp-python CPU only: {cpu['decode_tok_s']:.2f} tok/s decode"
                + (f", {cpu['prompt_tok_s']:.1f} prompt" if args.n_prompt else ""),
                ("budget", "on device (dense / KV / compute / FFN rows)", "FFN neurons on device", "host RSS",
                 "powerinfer tok/s", "llama-cpp-python -ngl", "llama-cpp-python tok/s", "host RSS (lcp)", "decode speedup",
                 "powerinfer prompt tok/s", "lcp prompt tok/s", "prompt speedup"),
                table)
    for r in rows:
        pl = r["powerinfer"]["placement"]
        if pl["bytes_total"] > pl["budget"]:
            print(f"error: the engine placed {pl['bytes_total']} bytes over a budget of {pl['budget']}", file=sys.stderr)
            return 1
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"emulated": emulate, "cpu_only": cpu, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
