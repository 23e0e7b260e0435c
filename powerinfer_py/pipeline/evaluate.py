"""A trust card for a (sparse) model: how close it stays to its original on text of
several domains, how sparse it runs there, and how fast it is against llama-cpp-python.

    powerinfer eval MODEL --text [NAME=]FILE... [--reference ORIGINAL.gguf] [--modes dense,predictor]
                    [--passages 8] [--n-tokens 256] [--batch 1] [--threads 2] [--out CARD]
                    (writes CARD.md, CARD.json)

Each --text file is one domain (named NAME, else by the file's stem). From each, --passages
windows of --n-tokens tokens spread evenly over the whole file, its start to its end (over
its bytes for a file above 8 MiB, read only where the windows fall), are scored,
teacher-forced and one token per decode, so the sparse path runs exactly as it does in
generation (--batch B scores B tokens per step after a passage's first, on both engines:
about 3x faster, on ggml's batch kernels where a matrix runs dense; input mode keeps for
each token of a step the input entries it keeps alone, where gate and predictor modes
would compute the union of the step's neurons, so they take --batch 1 only):
- per domain and engine: perplexity and mean next-token NLL;
- with --reference (the original model, run by llama-cpp-python on the same tokens): the NLL
  difference, the KL divergence KL(reference || model) of the next-token distributions and
  the top-1 agreement (the share of positions where both pick the same token), the figures
  llama.cpp's perplexity tool reports with --kl-divergence;
- per layer: the share of FFN neurons that fired (dense FFN, activation > 0: the model's own
  sparsity), the share each sparse mode computed in its sparse steps (the engine's counters:
  every scored position but a passage's first, which runs dense), and for a file with
  predictors their recall on this text (of the neurons that fired, the share the predictor chose);
- with --reference: decode and prompt-processing speed of every mode against
  llama-cpp-python on the reference, both engines in this process with their steps
  alternating (the bandwidth of a machine drifts), and the CPU it ran on.

The modes default to dense plus the mode the file itself selects (predictor for a
PowerInfer file with predictors, gate for a calibrated one). A card is only as honest as
its text: give text of domains that no training or calibration step saw, and name them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import Context, Model, accel
from .._core.bindings import kernel_level
from .._machine import best_alternating, cpu_model, timed
from ..formats.gguf_io import open_gguf, tensor_f32
from . import libllama
from .common import PipelineError, Progress, files, run_cli, tokenize_texts, write_text

MODES = ("dense", "gate", "predictor", "input")


# ---- the text --------------------------------------------------------------------------------


def parse_domain(spec: str) -> Tuple[str, str]:
    """[NAME=]FILE -> (name, path): a file whose name holds "=" is the file."""
    name, sep, path = spec.partition("=")
    return (Path(spec).stem, spec) if not sep or os.path.isfile(spec) else (name, path)


def parse_domains(specs: Sequence[str]) -> List[Tuple[str, str]]:
    """[NAME=]FILE -> (name, path); names unique."""
    out: List[Tuple[str, str]] = []
    for spec in specs:
        name, path = parse_domain(spec)
        if not os.path.isfile(path):
            raise PipelineError(f"--text {spec}: no such file")
        if any(n == name for n, _ in out):
            raise PipelineError(f"--text: two domains named {name!r}; name them NAME=FILE")
        out.append((name, path))
    if not out:
        raise PipelineError("--text: at least one file")
    return out


def passages(tokens: np.ndarray, n_passages: int, n_tokens: int) -> List[np.ndarray]:
    """n_passages windows of n_tokens spread evenly over tokens (fewer if the text is short)."""
    if len(tokens) < 2:
        return []
    n = min(n_tokens, len(tokens))
    k = max(1, min(n_passages, len(tokens) // n))
    starts = np.linspace(0, len(tokens) - n, k).astype(np.int64)
    return [tokens[s : s + n] for s in starts]


# A file up to this size is tokenized whole and its windows spread over its tokens; a larger
# one is read only where its windows fall. Tokenizing ran at about 2 MiB/s (SmolLM2's and
# Qwen2.5's vocabularies, 2 shared EPYC cores): 4 s a model for 8 MiB, where a 1 GiB dump
# would take 9 minutes and gigabytes of token lists for a few thousand tokens scored.
WHOLE_FILE_BYTES = 8 << 20


def file_passages(model_path: str, path: str, n_passages: int, n_tokens: int) -> List[np.ndarray]:
    """n_passages windows of n_tokens spread evenly over the whole file, in the model's tokens:
    passages() of the file's tokens, or for a file above WHOLE_FILE_BYTES, spread evenly over
    its bytes: the first is the file's start (with BOS), the last ends with the file, and each
    other begins at the first line (else word) after its share of the way through."""
    size = os.path.getsize(path)
    span = max(1 << 16, 64 * n_tokens)  # bytes read for a window: many times what its tokens take
    if size <= WHOLE_FILE_BYTES or n_passages * span > size:
        return passages(tokenize_texts(model_path, [Path(path).read_text(errors="replace")]), n_passages, n_tokens)
    out: List[np.ndarray] = []
    with open(path, "rb") as f, Model(model_path, vocab_only=True) as model:
        for i in range(n_passages):
            tail = 0 < i == n_passages - 1
            at = (size - span) * i // max(n_passages - 1, 1)
            width = span
            while True:
                lo = size - width if tail else at
                f.seek(lo)
                raw = f.read(width)
                to_end = lo + len(raw) >= size
                if lo > 0:  # a word cut in two tokenizes as no text does
                    cut = raw.find(b"\n", 0, len(raw) // 2)
                    raw = raw[(cut if cut >= 0 else raw.find(b" ", 0, len(raw) // 2)) + 1 :]
                toks = model.tokenize(raw.decode(errors="replace").encode(), lo == 0, False)
                # Not the tokens at a read's edges: the first after a cut (sentencepiece begins a
                # text with a space of its own), the last before one (perhaps half a word).
                toks = toks[1 if lo > 0 else 0 : len(toks) if to_end else -1]
                if len(toks) >= n_tokens or width >= size:
                    break
                width = min(2 * width, size)
            out.append(np.array(toks[-n_tokens:] if tail else toks[:n_tokens], dtype=np.int32))
    return out


# ---- scoring ---------------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Score:
    """Sums over scored positions: NLL, and against the reference KL and top-1 agreement."""

    def __init__(self) -> None:
        self.n = 0
        self.nll = 0.0
        self.kl = 0.0
        self.top1 = 0

    def add(self, logp: np.ndarray, targets: np.ndarray, ref_logp: Optional[np.ndarray]) -> None:
        self.n += len(targets)
        self.nll -= float(logp[np.arange(len(targets)), targets].sum())
        if ref_logp is not None:
            self.kl += float((np.exp(ref_logp) * (ref_logp - logp)).sum())
            self.top1 += int((ref_logp.argmax(axis=1) == logp.argmax(axis=1)).sum())

    def row(self, with_ref: bool) -> Dict[str, Any]:
        nll = self.nll / max(self.n, 1)
        r: Dict[str, Any] = {"tokens": self.n, "nll": nll, "ppl": math.exp(min(nll, 700.0))}
        if with_ref:
            r["kl"] = self.kl / max(self.n, 1)
            r["top1"] = self.top1 / max(self.n, 1)
        return r


# A batch of up to this many tokens takes the sparse path (the context's sparse_max_batch limit
# and the input-sparse operator's).
MAX_BATCH = 32


class Reference:
    """llama-cpp-python on the original model, loaded once: logp(passage) is the log-softmax
    of its logits at every position of the passage but the last. batch 1: one token per
    decode like our engine, so that the comparison holds no batch-versus-decode rounding (the
    same file scored by both engines in dense mode gives KL 0 exactly). batch B > 1: the
    passage's first token alone, then the rest in micro-batches of B, on llama.cpp's batch
    kernels (on Qwen2.5-Coder-1.5B Q4_K_M they differ from its decode kernels by a KL of
    about 0.003 per position)."""

    def __init__(self, path: str, n_ctx: int, threads: int, batch: int = 1):
        import llama_cpp

        # micro-batches of `batch` tokens (n_ubatch 1 runs the kernels a decode runs), every
        # position's logits kept
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, logits_all=True,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)

    def logp(self, passage: np.ndarray) -> np.ndarray:
        llm, n = self.llm, len(passage)
        llm.reset()
        llm.eval([int(passage[0])])
        llm.eval([int(t) for t in passage[1 : n - 1]])
        return log_softmax(np.asarray(llm.scores[: n - 1], dtype=np.float32))

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> "Reference":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_LAYER = re.compile(r"^blk\.(\d+)\.")


class LibllamaScorer:
    """One mode of a file whose architecture the core does not build, on llama-cpp-python's
    engine: input mode with the module (docs/accel.md) armed, dense without it. logp(passage)
    as Reference's, and the kept share of the module's sparse products per layer over that
    passage: [n_layer, 2] (kept, considered)."""

    def __init__(self, path: str, mode: str, n_layer: int, n_ctx: int, threads: int, batch: int):
        if mode not in ("dense", "input"):
            raise PipelineError(f"mode {mode!r}: an architecture the core does not build runs dense or input "
                                "(through libllama and the sparse module)")
        self.n_layer = n_layer
        arm = accel.armed(path) if mode == "input" else contextlib.nullcontext((None, 0))
        with arm as (tag, n):
            self.ref = Reference(path, n_ctx, threads, batch)
        self.tag = tag if n else None

    def logp_counts(self, passage: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        if self.tag is not None:
            accel.reset_stats(self.tag)
        logp = self.ref.logp(passage)
        counts = np.zeros((self.n_layer, 2))
        if self.tag is not None:
            for w in accel.weights(self.tag):
                m = _LAYER.match(w["name"])
                if w["sparse"] and m and int(m.group(1)) < self.n_layer:
                    counts[int(m.group(1))] += (w["n_active"], w["n_total"])
        return logp, counts

    def close(self) -> None:
        self.ref.close()


def passage_logp(ctx: Context, passage: Sequence[int], batch: int = 1) -> np.ndarray:
    """log-softmax of ctx's logits at every position of the passage but its last: its first
    token alone, then the rest batch tokens per decode (teacher-forced). Up to the context's
    sparse_max_batch, input mode keeps for each token of a batch the input entries it keeps
    alone (the matrices that run dense take ggml's batch kernels, which round otherwise than
    its decode kernels); gate and predictor modes compute the union of the batch's neurons."""
    n = len(passage)
    out = np.empty((n - 1, ctx.n_vocab), dtype=np.float32)
    pos = 0
    while pos < n - 1:
        k = 1 if pos == 0 else min(batch, n - 1 - pos)
        ctx.decode([int(t) for t in passage[pos : pos + k]], pos, logits_all=True)
        out[pos : pos + k] = ctx.logits(0, k)
        pos += k
    return log_softmax(out)


def model_logp(model: Model, passage: np.ndarray, threads: int, batch: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """log-softmax of our engine's logits (passage_logp: one token per decode by default, so
    the sparse path runs as in generation), and the engine's own counters of those steps:
    per layer (neurons computed, neurons considered)."""
    n = len(passage)
    params = dict(n_ctx=n + 8, n_threads=threads, n_threads_batch=threads)
    if batch > 1:  # a step of batch tokens takes the sparse path
        params["sparse_max_batch"] = batch
    with Context(model, **params) as ctx:
        logp = passage_logp(ctx, passage, batch)
        counts = np.array([ctx.sparse_stats(il) for il in range(model.n_layer())], dtype=np.float64)
    return logp, counts


def _predictors(path: str, n_layer: int) -> Optional[List[Tuple[np.ndarray, np.ndarray]]]:
    """(fc1 [r, n_embd], fc2 [n_ff, r]) per layer as float32, or None without predictors."""
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    if "blk.0.fc1.weight" not in tensors:
        return None
    return [(tensor_f32(tensors[f"blk.{i}.fc1.weight"]), tensor_f32(tensors[f"blk.{i}.fc2.weight"]))
            for i in range(n_layer)]


def activity(path: str, texts: Sequence[np.ndarray], threads: int, with_predictor: bool) -> Dict[str, Any]:
    """Per layer over the passages: the share of neurons that fired (dense FFN, act > 0) and,
    with predictors, their recall and the share they choose, at the file's thresholds."""
    with Model(path, sparse_mode="predictor" if with_predictor else "dense") as model:
        n_layer, n_ff = model.n_layer(), model.n_ff()
        preds = _predictors(path, n_layer) if with_predictor else None
        taus = [model.sparse_threshold(il) for il in range(n_layer)] if preds else []
        fired = np.zeros(n_layer)
        chosen = np.zeros(n_layer)
        hit = np.zeros(n_layer)
        n_tok = 0
        for p in texts:
            with Context(model, n_ctx=len(p) + 8, n_batch=len(p), n_threads=threads, n_threads_batch=threads) as ctx:
                ctx.set_ffn_capture(True)
                ctx.decode([int(t) for t in p], 0)
                for il in range(n_layer):
                    x, act = ctx.ffn_capture(il)
                    f = act > 0
                    fired[il] += f.sum()
                    if preds:
                        fc1, fc2 = preds[il]
                        pick = (np.maximum(x @ fc1.T, 0) @ fc2.T) >= taus[il]
                        chosen[il] += pick.sum()
                        hit[il] += (pick & f).sum()
            n_tok += len(p)
    out: Dict[str, Any] = {"tokens": n_tok, "fired": (fired / (n_tok * n_ff)).tolist()}
    if preds:
        out["predictor_recall"] = (hit / np.maximum(fired, 1)).tolist()
        out["predictor_chosen"] = (chosen / (n_tok * n_ff)).tolist()
    return out


# ---- speed -----------------------------------------------------------------------------------


def prompt_timer(engine: Any, tokens: Sequence[int]) -> Callable[[], float]:
    """A run for best_alternating: an empty cache, then the whole prompt in one eval call
    (llama-cpp-python's Llama and ours alike); returns the seconds of the eval."""
    def run() -> float:
        engine.reset()
        return timed(lambda: engine.eval(tokens))

    return run


def speed(path: str, reference: str, modes: Sequence[str], prompt: Sequence[int], threads: int, n_gen: int,
          reps: int = 3) -> Dict[str, Any]:
    """Decode (n_gen teacher-forced single-token steps after a 16-token prompt and 4 untimed
    steps) and prompt
    processing (the whole prompt in one call, best of reps) of each mode against
    llama-cpp-python on the reference, steps alternating in this process."""
    import llama_cpp

    from ..llama import Llama

    n_ctx = len(prompt) + n_gen + 32
    kw = dict(n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    ref = llama_cpp.Llama(model_path=reference, **kw)
    toks = [int(t) for t in prompt]
    out: Dict[str, Any] = {}
    try:
        for mode in modes:
            ours = Llama(model_path=path, sparse_mode=mode, **kw)
            try:
                t_ref = t_ours = 0.0
                ref.reset()
                ours.reset()
                ref.eval(toks[:16])
                ours.eval(toks[:16])
                for tok in toks[16:20]:  # warm-up: the first single-token steps set up the sparse path
                    ref.eval([tok])
                    ours.eval([tok])
                feed = (toks[16:] * (n_gen // max(len(toks) - 16, 1) + 1))[:n_gen]
                for tok in feed:
                    t = time.perf_counter()
                    ref.eval([tok])
                    t_ref += time.perf_counter() - t
                    t = time.perf_counter()
                    ours.eval([tok])
                    t_ours += time.perf_counter() - t
                p_ref, p_ours = best_alternating([prompt_timer(ref, toks), prompt_timer(ours, toks)], reps)
                out[mode] = {"decode_ref": n_gen / t_ref, "decode": n_gen / t_ours,
                             "prompt_ref": len(toks) / p_ref, "prompt": len(toks) / p_ours}
            finally:
                ours.close()
    finally:
        ref.close()
    return out


# ---- the card --------------------------------------------------------------------------------


def default_modes(path: str) -> List[str]:
    if not libllama.native(path):  # libllama's engine: dense, and input mode through the module
        return ["dense"] + (["input"] if open_gguf(path).get_field(libllama.KEY_NAMES) is not None else [])
    with Model(path) as m:
        own = m.sparse_mode()
    return ["dense"] + ([own] if own in MODES and own != "dense" else [])


def check_options(n_passages: int, n_tokens: int, n_gen: int, n_prompt: int, batch: int, modes: Sequence[str],
                  prefix: str = "") -> None:
    """PipelineError for options evaluate() cannot take: a command that makes a model and
    then its card (convert, sparsify) checks them before it makes the model."""
    o = f"--{prefix}"
    if n_tokens < 2 or n_passages < 1 or n_gen < 1 or n_prompt < 17:
        raise PipelineError(f"{o}n-tokens must be >= 2, {o}passages and {o}n-gen >= 1, {o}n-prompt >= 17")
    if not 1 <= batch <= MAX_BATCH:
        raise PipelineError(f"{o}batch must be between 1 and {MAX_BATCH}, got {batch}")
    for m in modes:
        if m not in MODES:
            raise PipelineError(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    union = [m for m in modes if m in ("gate", "predictor")]
    if batch > 1 and union:
        raise PipelineError(f"{o}batch {batch}: {' and '.join(union)} mode computes the union of a batch's neurons, "
                            f"so a token scores better than in generation; score it with {o}batch 1")


def evaluate(path: str, domains: Sequence[Tuple[str, str]], reference: Optional[str] = None,
             modes: Optional[Sequence[str]] = None, n_passages: int = 8, n_tokens: int = 256, threads: int = 2,
             n_gen: int = 64, n_prompt: int = 128, measure_speed: bool = True, progress: bool = True,
             batch: int = 1) -> Dict[str, Any]:
    modes = list(modes or default_modes(path))
    check_options(n_passages, n_tokens, n_gen, n_prompt, batch, modes)
    with Model(path, vocab_only=True) as m:
        n_vocab = m.n_vocab()
    if reference is not None:
        if not os.path.isfile(reference):
            raise PipelineError(f"--reference {reference}: no such file")
        with Model(reference, vocab_only=True) as r:
            if r.n_vocab() != n_vocab:
                raise PipelineError(f"the reference has {r.n_vocab()} tokens in its vocabulary, the model {n_vocab}: "
                                    "KL and top-1 agreement need the same vocabulary")
    texts: Dict[str, List[np.ndarray]] = {}
    for name, f in domains:
        texts[name] = file_passages(path, f, n_passages, n_tokens)
        if reference is not None:
            ref_ps = file_passages(reference, f, n_passages, n_tokens)
            if len(ref_ps) != len(texts[name]) or not all(np.array_equal(a, b) for a, b in zip(texts[name], ref_ps)):
                raise PipelineError(f"{f}: the model and the reference tokenize this text differently; "
                                    "KL and top-1 agreement need the same tokenizer")
        if not texts[name]:
            raise PipelineError(f"--text {f}: fewer than 2 tokens")
    engines = (["reference"] if reference else []) + modes
    total = sum(len(p) - 1 for ps in texts.values() for p in ps) * len(engines)
    bar = Progress("eval", total, progress)
    done = 0
    quality: Dict[str, Dict[str, Any]] = {}
    with_ref = reference is not None
    n_ctx = max(len(p) for ps in texts.values() for p in ps) + 8
    on_core = libllama.native(path)
    models: Dict[str, Any] = {}
    counts: Dict[str, np.ndarray] = {}
    ref = None
    try:
        for m in modes:
            if on_core:
                models[m] = Model(path, sparse_mode=m)
                counts[m] = np.zeros((models[m].n_layer(), 2))
            else:  # libllama's engine, input mode through the module
                n_layer = libllama.n_layer(path)
                models[m] = LibllamaScorer(path, m, n_layer, n_ctx, threads, batch)
                counts[m] = np.zeros((n_layer, 2))
        if with_ref:
            ref = Reference(reference, n_ctx, threads, batch)
        for name, ps in texts.items():
            scores = {e: Score() for e in engines}
            for p in ps:
                targets = np.asarray(p[1:], dtype=np.int64)
                ref_lp = ref.logp(p) if ref is not None else None
                if ref_lp is not None:
                    scores["reference"].add(ref_lp, targets, None)
                    done += len(targets)
                for m in modes:
                    logp, c = model_logp(models[m], p, threads, batch) if on_core else models[m].logp_counts(p)
                    scores[m].add(logp, targets, ref_lp)
                    counts[m] += c
                    done += len(targets)
                    bar.update(done)
            quality[name] = {e: s.row(with_ref and e != "reference") for e, s in scores.items()}
        # the share each sparse mode computed, from the engine's own counters of the scoring steps
        # (None: a layer with nothing sparse, as the module's files may leave some)
        stats = {m: [float(a / n) if n else None for a, n in c] for m, c in counts.items() if m != "dense"}
    finally:
        if ref is not None:
            ref.close()
        for mod in models.values():
            mod.close()
    bar.close()
    all_passages = [p for ps in texts.values() for p in ps]
    # over the positions that were scored: each passage's inputs, its last token only a target
    act = (activity(path, [p[:-1] for p in all_passages], threads, with_predictor="predictor" in modes) if on_core
           else {"fired": []})  # (the FFN's own activity needs the core's graph)
    card: Dict[str, Any] = {
        "model": os.path.abspath(path), "reference": os.path.abspath(reference) if reference else None,
        "domains": {name: {"file": os.path.abspath(f), "passages": len(texts[name]),
                           "tokens_per_passage": int(len(texts[name][0]))} for name, f in domains},
        "modes": modes, "threads": threads, "batch": batch, "quality": quality,
        "layers": {"fired": act["fired"], "computed": stats,
                   **({"predictor_recall": act["predictor_recall"], "predictor_chosen": act["predictor_chosen"]}
                      if "predictor_recall" in act else {})},
    }
    if measure_speed and reference is not None:
        prompt = np.concatenate(all_passages)[:n_prompt]
        if len(prompt) < n_prompt:
            prompt = np.resize(prompt, n_prompt)
        card["speed"] = {"cpu": cpu_model(), "kernels": kernel_level(), "n_gen": n_gen, "n_prompt": n_prompt,
                         "modes": speed(path, reference, modes, prompt.tolist(), threads, n_gen)}
    return card


def scoring(batch: int) -> str:
    """How the card's positions were scored, in words."""
    if batch == 1:
        return "every position scored one token per decode, teacher-forced"
    return (f"positions scored teacher-forced, {batch} tokens per step after each passage's first (both engines; "
            "input mode keeps for each token the entries it keeps alone)")


def render(card: Dict[str, Any]) -> str:
    """The card as Markdown."""
    with_ref = card["reference"] is not None
    L = [f"# Trust card: {Path(card['model']).name}", "",
         f"- model: `{card['model']}`",
         f"- reference: `{card['reference']}` (llama-cpp-python)" if with_ref else "- reference: none",
         f"- modes: {', '.join(card['modes'])}; {card['threads']} threads; " + scoring(card.get("batch", 1)),
         "- held-out domains (text that no training or calibration step may have seen): "
         + "; ".join(f"**{n}** (`{Path(d['file']).name}`, {d['passages']} x {d['tokens_per_passage']} tokens)"
                     for n, d in card["domains"].items()), "",
         "## Quality per domain", ""]
    hdr = "| domain | engine | perplexity | NLL (nats) |"
    if with_ref:
        hdr += " NLL vs reference | KL from reference | top-1 agreement |"
    L += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for dom, rows in card["quality"].items():
        base = rows.get("reference", {}).get("nll")
        for eng, r in rows.items():
            line = f"| {dom} | {eng} | {r['ppl']:.3f} | {r['nll']:.4f} |"
            if with_ref:
                line += (" — | — | — |" if eng == "reference" else
                         f" {r['nll'] - base:+.4f} | {r['kl']:.4f} | {r['top1']:.1%} |")
            L.append(line)
    lay = card["layers"]
    n_layer = len(lay["fired"]) or max((len(v) for v in lay["computed"].values()), default=0)
    module = not lay["fired"]  # libllama's engine: the module's counters, every sparse matrix's input
    L += ["", "## FFN activity per layer (all domains)" if not module else "## Input entries kept per layer (all domains)", "",
          ("fired: neurons with act > 0 in the dense FFN; computed: what each sparse mode computed in its "
           "sparse steps (a passage's first token runs dense)" if not module else
           "the module inside libllama (docs/accel.md): computed = the share of the input entries its sparse matrices "
           "kept, over the scored steps; —: no sparse matrix in the layer (the FFN's own activity needs the core's graph)")
          + ("; recall: of the neurons that fired, the share the predictor chose" if "predictor_recall" in lay else ""),
          "", "| layer | " + " | ".join(str(i) for i in range(n_layer)) + " | mean |",
          "|---|" + "---|" * (n_layer + 1)]

    def row(name, vals, fmt):
        known = [v for v in vals if v is not None]
        mean = fmt(float(np.mean(known))) if known else "—"
        return f"| {name} | " + " | ".join("—" if v is None else fmt(v) for v in vals) + f" | {mean} |"

    if not module:
        L.append(row("fired", lay["fired"], lambda v: f"{v:.1%}"))
    for m, vals in lay["computed"].items():
        L.append(row(f"computed ({m})", vals, lambda v: f"{v:.1%}"))
    if "predictor_recall" in lay:
        L.append(row("predictor recall", lay["predictor_recall"], lambda v: f"{v:.3f}"))
    if "speed" in card:
        sp = card["speed"]
        L += ["", f"## Speed against llama-cpp-python on the reference ({card['threads']} threads, same process, "
              "steps alternating)", "", f"CPU: {sp['cpu']}; sparse kernels: {sp.get('kernels', 'unknown')}", "",
              f"| mode | decode tok/s | llama-cpp-python | ratio | prompt ({sp['n_prompt']} tokens) tok/s | "
              "llama-cpp-python | ratio |", "|---|---|---|---|---|---|---|"]
        for m, r in sp["modes"].items():
            L.append(f"| {m} | {r['decode']:.1f} | {r['decode_ref']:.1f} | {r['decode'] / r['decode_ref']:.2f}x | "
                     f"{r['prompt']:.1f} | {r['prompt_ref']:.1f} | {r['prompt'] / r['prompt_ref']:.2f}x |")
    return "\n".join(L) + "\n"


def card_files(out: str) -> Tuple[str, str]:
    """The CARD.md and CARD.json of --out (with or without its .md/.json suffix)."""
    base = out[:-3] if out.endswith(".md") else out[:-5] if out.endswith(".json") else out
    return base + ".md", base + ".json"


def write_card(card: Dict[str, Any], out: str) -> Tuple[str, str]:
    """CARD.md and CARD.json (card_files(out))."""
    md, js = card_files(out)
    Path(md).parent.mkdir(parents=True, exist_ok=True)
    write_text(md, render(card))
    write_text(js, json.dumps(card, indent=1))
    return md, js


def card_inputs(texts: Optional[Sequence[str]], reference: Optional[str], options=("--text", "--reference")):
    """check_paths' inputs of a card beside its model: the domains' files and the reference."""
    return [(options[0], t, files(parse_domain(t)[1])) for t in texts or ()] + [(options[1], reference, files(reference))]


def add_arguments(p: argparse.ArgumentParser, prefix: str = "", batch: int = 1) -> None:
    """The card's options (also offered by `powerinfer convert` and `sparsify` with prefix
    "card-"); batch: the default of --batch."""
    p.add_argument(f"--{prefix}passages", type=int, default=8, help="passages per domain (default 8)")
    p.add_argument(f"--{prefix}batch", type=int, default=batch,
                   help=f"tokens scored per step, 1 to {MAX_BATCH} (default {batch}; 1: as generation decodes, and "
                        "dense mode matches llama-cpp-python bit for bit; above 1: about 3x faster, on both "
                        "engines' batch kernels; not for gate or predictor mode)")
    p.add_argument(f"--{prefix}n-tokens", type=int, default=256, help="tokens per passage (default 256)")
    p.add_argument(f"--{prefix}n-gen", type=int, default=64, help="decode steps timed per mode (default 64)")
    p.add_argument(f"--{prefix}n-prompt", type=int, default=128, help="prompt length timed (default 128)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--text", nargs="+", required=True, metavar="[NAME=]FILE", help="one file per domain")
    p.add_argument("--reference", help="the original model (GGUF), run by llama-cpp-python")
    p.add_argument("--modes", help="comma-separated, from dense,gate,predictor,input (default: dense and the file's own)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-speed", action="store_true", help="skip the speed table")
    p.add_argument("--out", help="write OUT.md and OUT.json (default: only print the Markdown)")
    add_arguments(p)

    def run(a):
        if not os.path.isfile(a.model):
            raise PipelineError(f"{a.model}: no such file")
        card = evaluate(a.model, parse_domains(a.text), a.reference,
                        a.modes.split(",") if a.modes else None, a.passages, a.n_tokens, a.threads,
                        a.n_gen, a.n_prompt, not a.no_speed, batch=a.batch)
        print(render(card))
        if a.out:
            md, js = write_card(card, a.out)
            print(f"card: {md}, {js}", file=sys.stderr)

    def paths(a):  # --out itself too: `--out MODEL` is a slip, even if the card lands beside it
        written = [f for out in ([a.out, *card_files(a.out)] if a.out else []) for f in files(out)]
        return [("--out", a.out, written)], [("the model", a.model, files(a.model))] + card_inputs(a.text, a.reference)

    return run_cli(run, argv, p, paths)


if __name__ == "__main__":
    sys.exit(main())
