"""The sparse module inside libllama (docs/accel.md) against llama-cpp-python, same machine,
same run, same threads:

    python -m powerinfer_py.bench accel --model MODEL.gguf --sparse S1.gguf [S2.gguf ...]
        [--threads 2] [--n-gen 64] [--n-prompt 512] [--reps 3] [--no-passthrough] [--no-core] [--no-repack]

MODEL is the original file, each S a sparse copy of it (`powerinfer sparsify`). Per copy, in
a fresh process, these engines decode after the same 16-token prompt, each its own greedy
tokens, one step of each in turn (the machine's bandwidth drifts):
- llama-cpp-python on MODEL (the reference);
- the module in pass-through on S (the same weights placed in it, computed by ggml: its own
  cost), for the first copy;
- the module running S's thresholds (llama-cpp-python's engine with the module armed);
- our core's input mode on S, where the core builds the architecture (llama, qwen2).
--no-repack loads every engine with llama.cpp's --no-repack (no CPU_REPACK layouts, ours
included): the pass-through row then measures the module's own dispatch cost alone, apart
from the repacked kernels a covered weight gives up. --reps processes per copy; the table gives medians of the per-run ratios to the reference,
and the byte-count ideal: the weight bytes llama.cpp reads per token over those the kept
input entries leave (each sparse weight at its measured kept share; an MoE expert stack at
its used experts' share), and the share of that ideal reached. Before decoding, each engine
computes a prompt of --n-prompt tokens (one batch, n_batch = n_ubatch = the prompt; best
of 2, the engines in turn): the second table, prompt tok/s against llama-cpp-python's (0
skips it). A prompt is a batch above the module's max, so it runs ggml's matmuls on the
input under the rule.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .._machine import cpu_model, measure_bandwidth
from ..pipeline.libllama import expert_share
from .common import ChildError, print_table, prompt_tokens, spawn, upstream_last_logits

PROMPT_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made books "
               "cheaper to produce and spread ideas faster than ever before. ")


def _bytes_per_token(path: str, kept: Dict[str, float]) -> Dict[str, float]:
    """Weight bytes a decode step reads: dense (llama.cpp) and with the kept shares."""
    import gguf

    r = gguf.GGUFReader(path)
    exp_share = expert_share(path)
    names = {t.name for t in r.tensors}
    dense = sparse = 0.0
    for t in r.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # a row per token
        b = float(t.n_bytes) * (exp_share if "_exps." in t.name else 1.0)
        dense += b
        sparse += b * kept.get(t.name, 1.0)
    return {"dense": dense, "sparse": sparse}


def decode_run(model: str, sparse: str, threads: int, n_gen: int, passthrough: bool, core: bool,
               repack: bool = True, n_prompt: int = 0) -> Dict[str, Any]:
    """One process: a prompt of n_prompt tokens per engine (best of 2, interleaved), then the
    engines' greedy steps interleaved; tok/s of each and the kept shares."""
    import llama_cpp

    from .._core import accel
    from .._core import PowerInferError
    from .._llama import overrides
    from ..llama import Llama

    batch = max(512, n_prompt)
    kw = dict(n_ctx=max(n_gen + 64, n_prompt + 16), n_batch=batch, n_threads=threads, n_threads_batch=threads,
              verbose=False)
    up = dict(kw, n_ubatch=batch)  # llama-cpp-python's micro-batch: the whole prompt at once, as ours
    fields = {} if repack else {"use_extra_bufts": False}
    with overrides.installed(None, **fields):
        engines: Dict[str, Any] = {"llama-cpp-python": llama_cpp.Llama(model_path=model, **up)}
        if passthrough:
            with accel.armed(sparse, accel.PASSTHROUGH):
                engines["module, pass-through"] = llama_cpp.Llama(model_path=sparse, **up)
        with accel.armed(sparse) as (tag, _):
            engines["module"] = llama_cpp.Llama(model_path=sparse, **up)
    if core and accel.core_builds(str(engines["module"].metadata.get("general.architecture", ""))):
        try:  # a copy of the core's format (per-layer thresholds); a per-tensor one is the module's alone
            engines["core input mode"] = Llama(model_path=sparse, sparse_mode="input", repack=repack, **kw)
        except PowerInferError:
            pass

    def last(name: str, e: Any) -> np.ndarray:
        return e._last_logits_view() if name == "core input mode" else upstream_last_logits(e)

    prompt_s = {name: float("inf") for name in engines}
    if n_prompt > 0:
        long = prompt_tokens(engines["llama-cpp-python"].tokenize, n_prompt, PROMPT_TEXT)
        for _ in range(2):
            for name, e in engines.items():
                e.reset()
                t = time.perf_counter()
                e.eval(long)
                prompt_s[name] = min(prompt_s[name], time.perf_counter() - t)
    prompt = prompt_tokens(engines["llama-cpp-python"].tokenize, 16, PROMPT_TEXT)
    for name, e in engines.items():
        e.reset()
        e.eval(prompt)
    for name, e in engines.items():  # warm-up: the first steps write the column copies
        for _ in range(4):
            e.eval([int(np.argmax(last(name, e)))])
    accel.reset_stats(tag)
    if "core input mode" in engines:
        engines["core input mode"].reset_timings()
    spent = {name: 0.0 for name in engines}
    for _ in range(n_gen):
        for name, e in engines.items():
            tok = int(np.argmax(last(name, e)))
            t = time.perf_counter()
            e.eval([tok])
            spent[name] += time.perf_counter() - t
    ws = accel.weights(tag)
    kept = {w["name"]: w["n_active"] / w["n_total"] for w in ws if w["sparse"] and w["n_total"]}
    out = {"tok_s": {name: n_gen / s for name, s in spent.items()}, "bytes": _bytes_per_token(model, kept),
           "prompt_tok_s": {name: n_prompt / s for name, s in prompt_s.items()} if n_prompt > 0 else {},
           "n_sparse": len(kept), "n_placed": len(ws)}
    if "core input mode" in engines:
        out["core_active"] = engines["core input mode"].sparse_stats()["active"]
    for e in engines.values():
        e.close()
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench accel", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the original GGUF (llama-cpp-python's reference)")
    p.add_argument("--sparse", nargs="+", required=True, help="sparse copies of it (powerinfer sparsify)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--n-prompt", type=int, default=512, help="prompt tokens timed per engine (0: none)")
    p.add_argument("--reps", type=int, default=3, help="processes per copy (medians of the ratios)")
    p.add_argument("--no-passthrough", action="store_true", help="skip the pass-through engine")
    p.add_argument("--no-core", action="store_true", help="skip our core's input mode")
    p.add_argument("--no-repack", action="store_true",
                   help="every engine without CPU_REPACK layouts (llama.cpp's --no-repack)")
    a = p.parse_args(argv)
    if a.threads < 1 or a.n_gen < 1 or a.reps < 1 or a.n_prompt < 0:
        print("error: --threads, --n-gen and --reps must be >= 1, --n-prompt >= 0", file=sys.stderr)
        return 1
    rows, prompt_rows = [], []
    try:
        for i, s in enumerate(a.sparse):
            runs = []
            for rep in range(a.reps):
                print(f"decode, {s}, run {rep + 1}/{a.reps} ...", file=sys.stderr, flush=True)
                runs.append(spawn(decode_run, model=a.model, sparse=s, threads=a.threads, n_gen=a.n_gen,
                                  passthrough=i == 0 and not a.no_passthrough, core=not a.no_core,
                                  repack=not a.no_repack, n_prompt=a.n_prompt))
            b = runs[0]["bytes"]
            ideal = b["dense"] / b["sparse"]
            for name in runs[0]["tok_s"]:
                if name == "llama-cpp-python":
                    continue
                ratio = statistics.median(r["tok_s"][name] / r["tok_s"]["llama-cpp-python"] for r in runs)
                ref = statistics.median(r["tok_s"]["llama-cpp-python"] for r in runs)
                mine = statistics.median(r["tok_s"][name] for r in runs)
                is_sparse = name != "module, pass-through"
                rows.append([s.rsplit("/", 1)[-1], name, f"{ref:.2f}", f"{mine:.2f}", f"{ratio:.3f}x",
                             f"{ideal:.2f}x" if is_sparse else "1.00x",
                             f"{100 * ratio / (ideal if is_sparse else 1.0):.0f}%"])
                if a.n_prompt > 0:
                    pt = [r["prompt_tok_s"] for r in runs]
                    prompt_rows.append([s.rsplit("/", 1)[-1], name, f"{statistics.median(r['llama-cpp-python'] for r in pt):.1f}",
                                        f"{statistics.median(r[name] for r in pt):.1f}",
                                        f"{statistics.median(r[name] / r['llama-cpp-python'] for r in pt):.3f}x"])
    except ChildError as e:
        print(f"error: a benchmark run failed ({e.reason}):\n{e.output[-2000:]}", file=sys.stderr)
        return 1
    bw = measure_bandwidth(a.threads)
    from .._core.bindings import kernel_level

    print(f"\nmodel: {a.model} (llama-cpp-python); {a.threads} threads; measured read bandwidth "
          f"({a.threads} threads) {bw / 1e9:.1f} GB/s; CPU {cpu_model()}; sparse kernels {kernel_level()}; "
          f"CPU_REPACK {'off in every engine (--no-repack)' if a.no_repack else 'on'}\n")
    print_table(f"Decode, {a.n_gen} tokens, engines' steps interleaved in one process, median of {a.reps} runs:",
                ("file", "engine", "llama-cpp-python tok/s", "engine tok/s", "ratio", "ideal (bytes)", "of ideal"), rows)
    if prompt_rows:
        print_table(f"\nPrompt, {a.n_prompt} tokens in one batch, best of 2 per run, median of {a.reps} runs:",
                    ("file", "engine", "llama-cpp-python tok/s", "engine tok/s", "ratio"), prompt_rows)
    return 0
