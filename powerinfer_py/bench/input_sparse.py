"""Input sparsity on any GGUF (`powerinfer sparsify`) against llama-cpp-python on the
original file, same machine, same run, same threads:

    python -m powerinfer_py.bench sparse --model MODEL.gguf [--sparsities 0,0.25,0.4,0.5]
        [--corpus FILE...] [--text [NAME=]FILE...] [--threads 2] [--n-gen 128] [--reps 3]

For each sparsity a sparse copy of MODEL is made once (`powerinfer sparsify`, measured
allocation, calibrated on --corpus, else on 2048 tokens of the model's own samples) and
kept under <cache>/sparse/. Then, per sparsity:
- decode: after a 16-token prompt, --n-gen greedy tokens, the two engines' steps
  alternating in one process (the machine's bandwidth drifts), --reps times in fresh
  processes; the median of the runs' ratios. Beside it the byte-count ideal: the weight
  bytes llama.cpp reads per token over the bytes the kept input entries leave (every matrix
  at its measured kept share, the output matrix too when the allocation made it sparse;
  norms and embeddings whole), and the share of that ideal reached;
- prompts of --prompts tokens (one call each, best of --prompt-reps, alternating);
- with --text (held-out domains), the card's quality columns against the original run by
  llama-cpp-python: NLL change, KL and top-1 agreement per domain (passages teacher-forced
  one token per decode, so the sparse path runs as in generation);
- peak RSS of our engine in input mode and of llama-cpp-python, each alone in a process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .._machine import best_alternating, cpu_model, measure_bandwidth
from ..assets.models import cache_dir
from ..pipeline.evaluate import prompt_timer
from .common import (ChildError, greedy_steps_interleaved, peak_rss, print_rss_table, print_table, prompt_tokens, spawn,
                     upstream_last_logits)

INPUTS = ("qkv", "o", "ffn", "down")
PROMPT_TEXT = (
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n"
    "    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
)


def sparse_path(model: str, sparsity: float, allocation: str = "measured") -> str:
    tag = "" if allocation == "measured" else f".{allocation}"
    return str(cache_dir() / "sparse" / f"{Path(model).stem}.input{round(100 * sparsity):02d}{tag}.gguf")


def make_sparse(model: str, sparsities: Sequence[float], corpus: Sequence[str], threads: int,
                allocation: str = "measured") -> Dict[str, str]:
    """The sparse copies of model at these sparsities, made once (sparsify, one calibration
    for all of them) and reused while newer than the model and written by a sparsify that
    allocates the output matrix too, knowing its exact top rows (they carry those keys)."""
    from .._core import Model
    from ..pipeline.sparsify import KEY_HEAD_EXACT_ROWS, KEY_OUTPUT_THRESHOLD, sparsify

    def current(path: str) -> bool:  # the core reads the keys in 0.5 s where gguf's reader takes 7 (151k-token vocabulary)
        with Model(path, vocab_only=True) as m:
            return {KEY_OUTPUT_THRESHOLD, KEY_HEAD_EXACT_ROWS} <= m.metadata().keys()

    paths, histograms, weights = {}, None, None
    for sparsity in sparsities:
        out = paths[f"{sparsity:.2f}"] = sparse_path(model, sparsity, allocation)
        if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(model) or not current(out):
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            print(f"sparsify {model} at {sparsity:.0%} -> {out}", file=sys.stderr, flush=True)
            r = sparsify(model, out, sparsity, corpus, 0 if corpus else 2048, threads=threads, histograms=histograms,
                         weights=weights, allocation=allocation)
            histograms = r["histograms"] or histograms
            weights = r["weights"] if r["weights"] is not None else weights
    return paths


def _matrix_bytes(path: str, n_layer: int) -> np.ndarray:
    from ..pipeline.sparsify import input_bytes

    return input_bytes(path, n_layer)


def _dense_bytes(path: str) -> float:
    """Weight bytes llama.cpp reads per token: all but the token embeddings (one row), unless
    the output is tied to them."""
    import gguf

    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    total = sum(v for k, v in sizes.items() if k != "token_embd.weight")
    return float(total + (sizes.get("token_embd.weight", 0) if "output.weight" not in sizes else 0))


# Per ggml block type: (bytes of a block in the file, of its quants, of the scales the column
# copy keeps for it). The copy keeps the quants and, per row and block, the file's scales (K-
# quants' 6-bit sc and mins packed as in the file, input_sparse.c), and reads a block's scales
# whenever any of its columns is kept: at these sparsities, nearly always.
_COLUMN_BLOCKS = {"Q4_0": (18, 16, 2), "Q4_1": (20, 16, 4), "Q5_0": (22, 20, 2), "Q5_1": (24, 20, 4),
                  "Q8_0": (34, 32, 2), "Q4_K": (144, 128, 16), "Q5_K": (176, 160, 16), "Q6_K": (210, 192, 18)}


def _column_bytes(path: str, n_layer: int) -> tuple:
    """Per (layer, input), as input_bytes: (quants, scales), the bytes of the matrices' quants
    (what the kept columns read) and of the scales the column kernel reads per token whatever
    the kept share; an input at kept share k reads quants * k + scales. NaN where a matrix's
    type has no column form."""
    from ..formats.gguf_io import open_gguf
    from ..pipeline.sparsify import INPUTS as NAMES, input_tensors

    quants, scales = np.zeros((n_layer + 1, len(NAMES))), np.zeros((n_layer + 1, len(NAMES)))
    for at, t in input_tensors(open_gguf(path), n_layer):
        block, q, sc = _COLUMN_BLOCKS.get(t.tensor_type.name, (float("nan"),) * 3)
        quants[at] += int(t.n_bytes) / block * q
        scales[at] += int(t.n_bytes) / block * sc
    return quants, scales


# ---- children -------------------------------------------------------------------------------


def decode_pair(model: str, path: str, threads: int, n_gen: int) -> Dict[str, Any]:
    """Both engines in this process, their decode steps alternating; each follows its own
    greedy tokens after the same 16-token prompt. Our engine's kept shares per input."""
    import llama_cpp

    from ..llama import Llama

    kw = dict(n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    ref = llama_cpp.Llama(model_path=model, **kw)
    ours = Llama(model_path=path, sparse_mode="input", **kw)
    prompt = prompt_tokens(ref.tokenize, 16, PROMPT_TEXT)
    ref.eval(prompt)
    ours.eval(prompt)
    for _ in range(4):  # warm-up steps, not timed
        ref.eval([int(np.argmax(upstream_last_logits(ref)))])
        ours.eval([int(np.argmax(ours._last_logits_view()))])
    ours.reset_timings()
    t_ref, t_ours = greedy_steps_interleaved(ref, ours, n_gen)
    ctx = ours._require_ctx()
    n_layer = ours._model.n_layer()

    def share(il: int, i: int) -> float:  # row n_layer: the output matrix, input 0 only
        k = ctx.input_stats(il, i) if il < n_layer or i == 0 else (0, 0)
        return k[0] / k[1] if k[1] else 1.0

    kept = [[share(il, i) for i in range(4)] for il in range(n_layer + 1)]
    sparse = [[ours._model.input_sparse(il, i) for i in range(4)] for il in range(n_layer + 1)]
    from .._core.bindings import kernel_level

    return {"ref_tok_s": n_gen / t_ref, "ours_tok_s": n_gen / t_ours, "kept": kept, "sparse": sparse,
            "kernels": kernel_level()}


def prompt_pair(model: str, path: str, threads: int, lengths: Sequence[int], reps: int) -> Dict[str, Any]:
    import llama_cpp

    from ..llama import Llama

    kw = dict(n_ctx=max(lengths) + 64, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    ref = llama_cpp.Llama(model_path=model, **kw)
    ours = Llama(model_path=path, sparse_mode="input", **kw)
    out: Dict[str, Any] = {}
    for n in lengths:
        toks = prompt_tokens(ref.tokenize, n, PROMPT_TEXT)
        best_ref, best_ours = best_alternating([prompt_timer(ref, toks), prompt_timer(ours, toks)], reps)
        out[str(n)] = {"ref_tok_s": n / best_ref, "ours_tok_s": n / best_ours}
    return out


def quality(model: str, paths: Dict[str, str], domains: List[List[str]], passages: int, n_tokens: int,
            threads: int) -> Dict[str, Any]:
    """Per sparsity and domain: NLL change, KL and top-1 agreement against llama-cpp-python on
    the original (its log-probabilities computed once per passage)."""
    from .._core import Model
    from ..pipeline.evaluate import Reference, Score, file_passages, model_logp

    out: Dict[str, Any] = {}
    texts = {name: file_passages(model, f, passages, n_tokens) for name, f in domains}
    with Reference(model, max(len(p) for ps in texts.values() for p in ps) + 8, threads) as ref:
        refs = {name: [ref.logp(p) for p in ps] for name, ps in texts.items()}
    for key, path in paths.items():
        with Model(path, sparse_mode="input") as m:
            out[key] = {}
            for name, ps in texts.items():
                ref_score, score = Score(), Score()
                for p, ref in zip(ps, refs[name]):
                    targets = np.asarray(p[1:], dtype=np.int64)
                    ref_score.add(ref, targets, None)
                    logp, _ = model_logp(m, p, threads)
                    score.add(logp, targets, ref)
                r = score.row(True)
                out[key][name] = {"nll": r["nll"], "nll_ref": ref_score.row(False)["nll"], "kl": r["kl"], "top1": r["top1"]}
    return out


# ---- parent ---------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench sparse --model", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a standard GGUF (llama-cpp-python runs it; our engine its sparse copies)")
    p.add_argument("--sparsities", default="0,0.25,0.4,0.5")
    p.add_argument("--corpus", nargs="*", default=[], help="calibration text for sparsify (default: the model's samples)")
    p.add_argument("--text", nargs="*", default=[], metavar="[NAME=]FILE", help="held-out domains for the quality columns")
    p.add_argument("--passages", type=int, default=4)
    p.add_argument("--n-tokens", type=int, default=128, help="tokens per held-out passage")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="decode runs per sparsity (fresh processes; the median ratio)")
    p.add_argument("--prompts", default="64,512")
    p.add_argument("--prompt-reps", type=int, default=3)
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--allocation", choices=("measured", "greedy"), default="measured",
                   help="sparsify's allocation of the copies (greedy: no sensitivity probe, quicker to make)")
    p.add_argument("--levels", default="simd",
                   help="kernel levels to run ours at, comma-separated (POWERINFER_KERNELS), or 'simd': every level this "
                        "CPU runs that has a SIMD column product (all but scalar), or 'auto': the library's choice")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    from .._core.bindings import kernel_levels

    runnable = kernel_levels()
    if a.levels == "auto":
        levels = [runnable[0]]
    elif a.levels == "simd":
        levels = [lv for lv in runnable if lv != "scalar"] or ["scalar"]
    else:
        levels = [lv.strip() for lv in a.levels.split(",") if lv.strip()]
        bad = [lv for lv in levels if lv not in runnable]
        if bad or not levels:
            print(f"error: --levels: this CPU runs {', '.join(runnable)}; not {', '.join(bad) or 'nothing'}", file=sys.stderr)
            return 1
    from ..pipeline.evaluate import parse_domains

    try:
        sparsities = [float(v) for v in a.sparsities.split(",") if v.strip()]
        lengths = [int(v) for v in a.prompts.split(",") if v.strip()]
    except ValueError:
        sparsities, lengths = [], [-1]
    if not os.path.isfile(a.model) or not sparsities or any(not 0 <= s < 1 for s in sparsities) or \
            any(n < 1 for n in lengths) or a.n_gen < 1 or a.reps < 1:
        print("error: --model must be a file, --sparsities in [0, 1), --prompts >= 1, --n-gen and --reps >= 1",
              file=sys.stderr)
        return 1
    domains = [list(d) for d in parse_domains(a.text)] if a.text else []
    paths = make_sparse(a.model, sparsities, a.corpus, a.threads, a.allocation)
    results: Dict[str, Any] = {"model": a.model, "threads": a.threads, "decode": {}, "prompt": {}, "rss": {}}
    try:
        for level in levels:
            env = {"POWERINFER_KERNELS": level}
            for key, path in paths.items():
                runs = []
                for r in range(a.reps):
                    print(f"decode {key} ({level}) run {r + 1}/{a.reps}, interleaved with llama-cpp-python ...",
                          file=sys.stderr, flush=True)
                    runs.append(spawn(decode_pair, _env=env, model=a.model, path=path, threads=a.threads, n_gen=a.n_gen))
                results["decode"][f"{level} {key}"] = runs
                if lengths:
                    print(f"prompts {key} ({level}) ...", file=sys.stderr, flush=True)
                    results["prompt"][f"{level} {key}"] = spawn(prompt_pair, _env=env, model=a.model, path=path,
                                                                threads=a.threads, lengths=lengths, reps=a.prompt_reps)
        if not a.no_rss:
            top = paths[max(paths)]
            for label, engine, path in (("llama-cpp-python", "llama-cpp-python", a.model), (f"powerinfer input {max(paths)}", "powerinfer", top)):
                print(f"peak RSS: {label} ...", file=sys.stderr, flush=True)
                results["rss"][label] = spawn(peak_rss, engine=engine, path=path, threads=a.threads,
                                              n_prompt=max(lengths) if lengths else 16, n_gen=a.n_gen,
                                              prompt_text=PROMPT_TEXT, sparse_mode="input")
        if domains:
            print("quality on the held-out domains ...", file=sys.stderr, flush=True)
            results["quality"] = spawn(quality, model=a.model, paths=paths, domains=domains, passages=a.passages,
                                       n_tokens=a.n_tokens, threads=a.threads)
    except ChildError as e:
        print(f"error: a benchmark run failed ({e.reason}):\n{e.output[-2000:]}", file=sys.stderr)
        return 1
    bw = measure_bandwidth(a.threads)
    results["bandwidth"], results["cpu"] = bw, cpu_model()

    n_layer = len(next(iter(results["decode"].values()))[0]["kept"]) - 1  # and the output matrix
    mat = _matrix_bytes(a.model, n_layer)
    quants, scales = _column_bytes(a.model, n_layer)
    dense = _dense_bytes(a.model)
    print(f"\nmodel: {a.model}; {a.threads} threads; measured read bandwidth ({a.threads} threads) {bw / 1e9:.1f} GB/s\n")
    rows = []
    for lkey, runs in results["decode"].items():
        level, key = lkey.split(" ")
        kept = np.array(runs[0]["kept"])
        sparse = np.array(runs[0]["sparse"], dtype=bool)
        read = dense - float((mat * np.where(sparse, 1.0 - kept, 0.0)).sum())
        ideal = dense / read
        # what the column kernel reads: the kept quants and every scale
        kread = dense - float(np.nansum(np.where(sparse, mat - quants * kept - scales, 0.0)))
        ceiling = dense / kread
        ratios = [r["ours_tok_s"] / r["ref_tok_s"] for r in runs]
        med = statistics.median(ratios)
        ref_ts = statistics.median(r["ref_tok_s"] for r in runs)
        ours_ts = statistics.median(r["ours_tok_s"] for r in runs)
        dropped = float((mat * (1.0 - kept)).sum() / mat[:n_layer].sum())  # of the layers' bytes: the budget's base
        rows.append([runs[0].get("kernels", level), f"{float(key):.0%}", f"{dropped:.1%}", f"{read / 2**20:.0f} / {dense / 2**20:.0f} MiB", f"{ideal:.2f}x",
                     f"{ref_ts:.2f}", f"{ours_ts:.2f}", f"{med:.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})",
                     f"{100 * med / ideal:.0f}%", f"{kread / 2**20:.0f} MiB, {ceiling:.2f}x", f"{100 * med / ceiling:.0f}%"])
    print_table(f"Decode, {a.n_gen} tokens, steps interleaved with llama-cpp-python, {a.reps} runs each (median):",
                ("kernels", "sparsity", "matrix bytes dropped", "weights/token (ideal / dense)", "byte-count ideal",
                 "llama-cpp-python tok/s", "powerinfer tok/s", "ratio (runs)", "of ideal",
                 "column kernel reads (its ceiling)", "of ceiling"), rows)
    print("(the column kernel's ceiling counts the bytes it reads: the kept columns' quants and the scales of every "
          "block with a kept column, which the file-byte ideal drops with the columns)")
    if results["prompt"]:
        print()
        rows = [[lkey.split(" ")[0], f"{float(lkey.split(' ')[1]):.0%}", n, f"{r['ref_tok_s']:.1f}", f"{r['ours_tok_s']:.1f}",
                 f"{r['ours_tok_s'] / r['ref_tok_s']:.2f}x"]
                for lkey, by_len in results["prompt"].items() for n, r in by_len.items()]
        print_table(f"Prompt processing (one call per prompt, best of {a.prompt_reps}, engines alternating):",
                    ("kernels", "sparsity", "prompt tokens", "llama-cpp-python tok/s", "powerinfer tok/s", "ratio"), rows)
    if results.get("quality"):
        print()
        rows = []
        for key, by_dom in results["quality"].items():
            for name, q in by_dom.items():
                rows.append([f"{float(key):.0%}", name, f"{q['nll_ref']:.4f}", f"{q['nll']:.4f}", f"{q['nll'] - q['nll_ref']:+.4f}",
                             f"{q['kl']:.4f}", f"{100 * q['top1']:.1f}%"])
        print_table(f"Quality on held-out text ({a.passages} passages x {a.n_tokens} tokens per domain, one token per decode):",
                    ("sparsity", "domain", "NLL original", "NLL sparse", "change (nats)", "KL", "top-1 agreement"), rows)
    print_rss_table(results["rss"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
