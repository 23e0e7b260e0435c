"""Any GGUF faster without retraining: input sparsity on every matrix (TEAL-style).

    powerinfer sparsify MODEL.gguf --sparsity S --out OUT.gguf [--corpus FILE...] [--samples N]
                        [--allocation measured|greedy|uniform] [--text [NAME=]FILE...] [--card CARD]

Each matrix of every layer (q/k/v, o, gate/up, down) reads only the columns of its
input's entries with |x| above a threshold, so a decode step reads that fraction of the
matrices' bytes. This command measures the distribution of |x| at each layer's four
inputs (the attention norm's output, the attention's output, the FFN norm's output,
act(gate) * up) over calibration text, picks the thresholds, and writes OUT: the input
file unchanged (every tensor and key; llama.cpp still runs it, densely) plus the key
`powerinfer.input_thresholds` (f32, four per layer) and `powerinfer.output_threshold` (f32,
the output matrix's input, the final norm's output; < 0: dense), which makes our engine run it in
input mode (`Llama(model_path=OUT)`, `main -m OUT`); `sparse_mode="dense"` still computes
everything.

Calibration text: --corpus files (plain text, or `powerinfer sample` .jsonl) and, with
--samples N, N tokens the model itself writes (`powerinfer sample`; the default when no
corpus is given). --sparsity is the share of the layers' matrices' bytes not read per token;
the allocation may spend that budget on the output matrix too (the bytes read per token are
the same; docs/input-sparsity.md).
--allocation uniform drops that share of every input; greedy spends the same byte budget
where it costs least: per input, the share of the products' energy it drops (sum of the
dropped x^2 over sum of x^2, from the histograms) per byte it saves, the cheapest first;
measured (the default) runs the same greedy on energy curves weighted by the harm measured
on the calibration text per layer and per input kind (measure_weights; docs/input-sparsity.md
shows what each allocation costs on held-out text).

It ends with the trust card (`powerinfer eval`) of OUT against the original on the
--text domains (held-out text: give domains no calibration step saw), written to --card
(default: OUT without .gguf, plus .card.md / .card.json), unless --no-card.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import Context, Model
from .._core.bindings import lib
from ..formats.gguf_io import copy_kv, finish, new_writer, open_gguf
from . import libllama
from .calibrate import decode_calibration
from .common import PipelineError, check_output, files, read_corpus, run_cli, same_file, token_chunks
from .evaluate import passage_logp

KEY_INPUT_THRESHOLDS = "powerinfer.input_thresholds"
KEY_OUTPUT_THRESHOLD = "powerinfer.output_threshold"
KEY_INPUT_SPARSITY = "powerinfer.input_sparsity"
KEY_INPUT_ALLOCATION = "powerinfer.input_allocation"
# The output matrix's top rows per token that the engine computes exactly (POWERINFER_HEAD_EXACT_ROWS)
# when this copy was allocated: the harm the allocation measured on the output matrix assumed them.
KEY_HEAD_EXACT_ROWS = "powerinfer.input_head_exact_rows"
INPUTS = ("qkv", "o", "ffn", "down")
# The matrices that read each input, by tensor name suffix.
INPUT_TENSORS = {
    "qkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight"),
    "o": ("attn_output.weight",),
    "ffn": ("ffn_gate.weight", "ffn_up.weight"),
    "down": ("ffn_down.weight",),
}
STEP = 0.025  # the allocation's grid of per-input sparsities


def collect_input_histograms(model_path: str, texts: Sequence[str], n_tokens: int, n_threads: int = 2, chunk: int = 256,
                             progress: bool = True) -> Tuple[np.ndarray, float, float, int]:
    """Histograms of |x| at every layer's four inputs over up to n_tokens calibration tokens,
    then the output matrix's (row n_layer, input 0): (counts [n_layer + 1, 4, n_bins],
    log10_min, log10_max, tokens used)."""
    (counts, lo, hi), used = decode_calibration(model_path, texts, n_tokens, Context.input_histograms, n_threads, chunk,
                                                progress, spread=True)
    return counts, lo, hi, used


def _bin_edges(n_bins: int, lo: float, hi: float) -> np.ndarray:
    return 10.0 ** np.linspace(lo, hi, n_bins + 1)


def dropped_energy(counts: np.ndarray, lo: float, hi: float, sparsities: np.ndarray) -> np.ndarray:
    """For one histogram of |x|: the share of sum(x^2) that dropping the smallest
    `sparsities` of the entries removes (each bin's entries at its geometric centre)."""
    row = counts.astype(np.float64)
    total = row.sum()
    if total == 0:
        return np.zeros_like(sparsities)
    edges = _bin_edges(len(row), lo, hi)
    centre = np.sqrt(edges[:-1] * edges[1:])
    energy = row * centre ** 2
    cum_n = np.concatenate([[0.0], np.cumsum(row)]) / total
    cum_e = np.concatenate([[0.0], np.cumsum(energy)]) / max(energy.sum(), 1e-300)
    return np.interp(sparsities, cum_n, cum_e)


def threshold_for(counts: np.ndarray, lo: float, hi: float, sparsity: float) -> float:
    """The |x| below which `sparsity` of the histogram's entries fall (log-linear inside a bin)."""
    row = counts.astype(np.float64)
    total = row.sum()
    if total == 0 or sparsity <= 0.0:
        return 0.0
    width = (hi - lo) / len(row)
    cdf = np.cumsum(row) / total
    b = int(np.searchsorted(cdf, sparsity))
    b = min(b, len(row) - 1)
    prev = cdf[b - 1] if b > 0 else 0.0
    frac = (sparsity - prev) / max(cdf[b] - prev, 1e-12)
    return float(10.0 ** (lo + (b + min(max(frac, 0.0), 1.0)) * width))


def input_tensors(reader, n_layer: int):
    """(layer, input) and tensor for every matrix reading an input (INPUT_TENSORS), the output
    matrix as (n_layer, 0) (the token embeddings when the output is tied to them)."""
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is not None:
        yield (n_layer, 0), head
    for t in reader.tensors:
        parts = t.name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or int(parts[1]) >= n_layer:
            continue
        for i, name in enumerate(INPUTS):
            if parts[2] in INPUT_TENSORS[name]:
                yield (int(parts[1]), i), t


def input_bytes(model_path: str, n_layer: int) -> np.ndarray:
    """Bytes of the matrices reading each input: [n_layer + 1, 4], the last row the output
    matrix's (input 0; the token embeddings when the output is tied to them)."""
    out = np.zeros((n_layer + 1, len(INPUTS)))
    for at, t in input_tensors(open_gguf(model_path), n_layer):
        out[at] += int(t.n_bytes)
    return out


# The least sparsity worth an input: below it, reading the kept columns costs as much as
# reading them all (prepare, the scales of every chunk, the partial sums; docs/input-sparsity.md
# has the measurements), so the greedy allocation leaves an input dense or drops at least this.
S_MIN = 0.25


def allocate(counts: np.ndarray, lo: float, hi: float, nbytes: np.ndarray, sparsity: float,
             method: str = "greedy", weights: Optional[np.ndarray] = None, head: bool = False,
             frozen: Optional[np.ndarray] = None) -> np.ndarray:
    """Per (layer, input) sparsity dropping `sparsity` of the bytes. uniform: the same
    everywhere; greedy: minimise the summed dropped-energy shares for those bytes, each step
    the input whose next step of sparsity costs the least energy per byte saved (optimal for
    these convex curves). An input's first step goes from 0 (dense) straight to S_MIN; the
    last step is cut to land on the budget exactly. head: the last row is the output matrix
    (input_bytes): the budget is `sparsity` of the other rows' bytes, which greedy may spend
    on it too, and uniform leaves it dense. frozen: inputs greedy leaves dense."""
    if not 0.0 <= sparsity < 1.0:
        raise PipelineError(f"--sparsity must be in [0, 1), got {sparsity}")
    n_layer, n_in = nbytes.shape
    layers = np.arange(n_layer)[:, None] < (n_layer - 1 if head else n_layer)
    if method == "uniform" or sparsity == 0.0:
        return np.where(layers, sparsity, 0.0) * np.ones((n_layer, n_in))
    if method != "greedy":
        raise PipelineError(f"--allocation must be greedy or uniform, got {method!r}")
    grid = np.concatenate([[0.0], np.arange(S_MIN, 0.95 + 1e-9, STEP)])
    curves = np.array([[dropped_energy(counts[il, i], lo, hi, grid) for i in range(n_in)] for il in range(n_layer)])
    if weights is not None:  # measured harm per unit of dropped energy (measure_sensitivity)
        curves = curves * np.asarray(weights, dtype=np.float64)[..., None]
    level = np.zeros((n_layer, n_in), dtype=np.int64)
    s = np.zeros((n_layer, n_in))
    target = sparsity * np.where(layers, nbytes, 0.0).sum()
    while True:
        saved = (s * nbytes).sum()
        if saved >= target - 1e-6:
            break
        nxt = np.minimum(level + 1, len(grid) - 1)
        cost = np.take_along_axis(curves, nxt[..., None], axis=2)[..., 0] - np.take_along_axis(curves, level[..., None], axis=2)[..., 0]
        gain = nbytes * (grid[nxt] - grid[level])
        price = np.where((level < len(grid) - 1) & (gain > 0), cost / np.maximum(gain, 1e-30), np.inf)
        if frozen is not None:
            price = np.where(frozen, np.inf, price)
        il, i = np.unravel_index(int(np.argmin(price)), price.shape)
        if not np.isfinite(price[il, i]):
            break
        if saved + gain[il, i] > target:
            if level[il, i] == 0:  # a whole first step would overshoot: finish on a sparse input instead
                sparse_price = np.where(level > 0, price, np.inf)
                if np.isfinite(sparse_price.min()):
                    il, i = np.unravel_index(int(np.argmin(sparse_price)), price.shape)
            if level[il, i] > 0:
                s[il, i] += (target - saved) / nbytes[il, i]  # part of a step: the budget exactly
                break
        level[il, i] += 1
        s[il, i] = grid[level[il, i]]
    return s


# The measured allocation (the default): the harm of dropping an input's small entries is
# not its dropped-energy share alone. A layer's errors weigh more or less on the output (on
# Qwen2.5-Coder-1.5B the first and last layers about twice the middle ones), and so does an
# input kind. So one probe allocation (greedy by energy at PROBE_SPARSITY) is run on the
# calibration text: each layer's four inputs alone, then each input kind in every layer
# alone, each scored by its KL divergence from the same model with nothing dropped. The
# ratio of KL to the dropped energy gives a weight per layer and per kind (a separable fit),
# and the greedy allocation runs again on the weighted curves. A fixed probe makes the
# weights depend on the model and the text alone, so every sparsity uses the same ones.
PROBE_SPARSITY = 0.4
PROBE_PASSAGES, PROBE_TOKENS, PROBE_BATCH = 8, 96, 16


class _Probe:
    """The model in input mode with every input mapped (threshold 0 keeps every nonzero
    entry) on PROBE_PASSAGES passages of the calibration text: kl(s) sets the thresholds of
    the allocation s ([n_layer + 1, 4]; 0: dense) on the live context and returns the mean
    KL divergence from the same model with nothing dropped."""

    def __init__(self, model_path: str, texts: Sequence[str], counts: np.ndarray, lo: float, hi: float, threads: int):
        self.counts, self.lo, self.hi = counts, lo, hi
        self.model = Model(model_path, sparse_mode="input", sparse_threshold=0.0)
        try:
            self.ctx = Context(self.model, n_ctx=PROBE_TOKENS + 8, n_threads=threads, n_threads_batch=threads,
                               sparse_max_batch=PROBE_BATCH)
        except BaseException:
            self.model.close()
            raise
        # passages from evenly spaced places of the text (its first tokens when it is short):
        # the corpus's first document alone would weigh its domain's harms only
        self.passages = token_chunks(lambda t: self.model.tokenize(t.encode(), True, False), texts, PROBE_PASSAGES,
                                     PROBE_TOKENS)
        n = sum(len(p) for p in self.passages)
        if n < 2 * PROBE_TOKENS:
            self.close()
            raise PipelineError(f"the calibration text has only {n} tokens; the measured allocation needs "
                                f"{2 * PROBE_TOKENS} (or use --allocation greedy)")
        # an input whose matrices have no column copy (a type the kernels do not take) runs
        # dense in the copy too
        self.mapped = np.array([[self.model.input_sparse(il, i) for i in range(len(INPUTS))] for il in range(counts.shape[0])])
        self._set(np.zeros(self.mapped.shape))
        self.refs = [passage_logp(self.ctx, p, PROBE_BATCH) for p in self.passages]

    def _set(self, s: np.ndarray) -> None:
        for il in range(s.shape[0]):
            for i in range(len(INPUTS)):
                if self.mapped[il, i]:
                    tau = threshold_for(self.counts[il, i], self.lo, self.hi, s[il, i]) if s[il, i] > 0 else 0.0
                    self.ctx.set_input_threshold(il, i, tau)

    def kl(self, s: np.ndarray) -> float:
        self._set(s)
        out = [float((np.exp(r) * (r - passage_logp(self.ctx, p, PROBE_BATCH))).sum(axis=-1).mean())
               for p, r in zip(self.passages, self.refs)]
        return float(np.mean(out))

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> "_Probe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def reuse(opened: Optional["_Probe"], model_path: str, texts: Sequence[str], counts: np.ndarray, lo: float, hi: float,
              threads: int):
        """opened itself (left open) when given, else a new probe: one model load and one set
        of reference log-probabilities serve the weights and the choice."""
        return contextlib.nullcontext(opened) if opened is not None else _Probe(model_path, texts, counts, lo, hi, threads)


def measure_weights(model_path: str, texts: Sequence[str], counts: np.ndarray, lo: float, hi: float, nbytes: np.ndarray,
                    threads: int = 2, progress: bool = True, opened: Optional[_Probe] = None) -> np.ndarray:
    """Per (layer, input) weight of the dropped-energy curves: [n_layer + 1, 4], the output
    matrix last (see PROBE_SPARSITY); opened: an open _Probe on the same text to use."""
    from .._progress import Progress

    n_rows, n_layer = counts.shape[0], counts.shape[0] - 1  # the layers, then the output matrix
    probe = allocate(counts, lo, hi, nbytes, PROBE_SPARSITY, "greedy", head=True)
    if probe[n_layer, 0] == 0.0 and nbytes[n_layer, 0] > 0:  # the output matrix is probed alone: measure it anyway
        probe[n_layer, 0] = S_MIN
    energy = np.array([[dropped_energy(counts[il, i], lo, hi, np.array([probe[il, i]]))[0] if probe[il, i] > 0 else 0.0
                        for i in range(len(INPUTS))] for il in range(n_rows)])
    bar = Progress("measuring sensitivity", 1 + n_rows + len(INPUTS), progress)
    with _Probe.reuse(opened, model_path, texts, counts, lo, hi, threads) as pr:
        bar.advance(1)
        # an input the probe cannot map stays dense, and its weight stays the mean
        probe = np.where(pr.mapped, probe, 0.0)
        energy = np.where(pr.mapped, energy, 0.0)
        rows = np.arange(n_rows)[:, None]
        layer_kl, kind_kl = [], []
        for il in range(n_rows):
            layer_kl.append(pr.kl(np.where(rows == il, probe, 0.0)))
            bar.advance(1)
        for i in range(len(INPUTS)):
            kind_kl.append(pr.kl(np.where((rows < n_layer) & (np.arange(len(INPUTS))[None, :] == i), probe, 0.0)))
            bar.advance(1)
        layer_kl, kind_kl = np.array(layer_kl), np.array(kind_kl)
    bar.close()
    # separable fit KL ~ w_layer * sum_i w_kind[i] * energy[il, i] over the layers (the output
    # matrix, a row of its own, gets its KL / energy); an input the probe left dense (or a
    # kind with nothing dropped) keeps weight 1 relative to the mean
    kind_energy = energy[:n_layer].sum(0)
    w_kind = np.where(kind_energy > 0, kind_kl / np.maximum(kind_energy, 1e-12), np.nan)
    w_kind = np.where(np.isfinite(w_kind) & (w_kind > 0), w_kind, np.nanmean(np.where(w_kind > 0, w_kind, np.nan)))
    per_layer = (energy * w_kind).sum(1)
    w_layer = np.where(per_layer > 0, layer_kl / np.maximum(per_layer, 1e-12), np.nan)
    w_layer = np.where(np.isfinite(w_layer) & (w_layer > 0), w_layer, np.nanmean(np.where(w_layer > 0, w_layer, np.nan)))
    w = w_layer[:, None] * w_kind[None, :]
    if not np.all(np.isfinite(w)):  # nothing measurable (no input dropped anything): plain greedy
        return np.ones_like(w)
    return w / w.mean()


# The output matrix's weight is its KL over its dropped energy at the probe's level, and KL
# grows faster than the energy (SmolLM2's head alone: KL / energy 8.4 at 25%, 12.7 at 80%),
# so at a target that gives it much more than the probe did, the line under-prices it. So
# after the measured allocation the output matrix alone is measured again at the level it
# got, its weight scaled, and the allocation redone, until its level moves less than
# HEAD_TOLERANCE (at most HEAD_ROUNDS measurements): SmolLM2 at 50%, head 87.5% -> 83.8%,
# NLL change on the held-out domains +2.02 / +2.86 / +1.94 -> +1.54 / +2.14 / +1.53.
#
# Then the fit is checked against what it fits: the allocation is scored whole on the probe
# passages beside the same budget with the output matrix dense and beside the plain energy
# greedy (with and without the head), and the lowest KL is kept. The separable fit adds the
# inputs' harms measured one layer or one kind at a time; on SmolLM2 (135M, its head tied to
# the embeddings: a third of its bytes) it mis-ranks whole allocations: at 40% probe KL
# 0.84 measured, 0.50 energy greedy with the head dense, and on the held-out domains +0.82 /
# +1.14 / +0.87 against +0.40 / +0.25 / +0.36. On the 1.5B the measured one wins.
HEAD_TOLERANCE, HEAD_ROUNDS = 0.05, 3


def choose_allocation(model_path: str, texts: Sequence[str], counts: np.ndarray, lo: float, hi: float, nbytes: np.ndarray,
                      sparsity: float, weights: np.ndarray, threads: int = 2, progress: bool = True,
                      opened: Optional[_Probe] = None) -> Tuple[np.ndarray, str, Dict[str, float]]:
    """The measured allocation at `sparsity`, its output matrix's weight measured at its own
    level (see HEAD_ROUNDS), or the candidate on the same budget that scores a lower KL on
    the probe passages: (allocation, its name, every candidate's KL). opened: an open _Probe
    on the same text to use."""
    from .._progress import Progress

    n_layer = counts.shape[0] - 1
    w = np.array(weights, dtype=np.float64)
    s = allocate(counts, lo, hi, nbytes, sparsity, "greedy", w, head=True)
    head = np.zeros(s.shape, dtype=bool)
    head[n_layer, 0] = True
    # the level measure_weights measured the output matrix at (the weights are normalised: a
    # new measurement scales the old weight by the ratio of KL per energy at the two levels)
    ref = float(allocate(counts, lo, hi, nbytes, PROBE_SPARSITY, "greedy", head=True)[n_layer, 0]) or S_MIN

    def energy(level: float) -> float:
        return float(dropped_energy(counts[n_layer, 0], lo, hi, np.array([level]))[0])

    bar = Progress("choosing the allocation", 5 + HEAD_ROUNDS, progress)
    with _Probe.reuse(opened, model_path, texts, counts, lo, hi, threads) as pr:

        def kl(a: np.ndarray) -> float:
            bar.advance(1)
            return pr.kl(a)

        def kl_per_energy(level: float) -> float:
            return kl(np.where(head, level, 0.0)) / energy(level) if energy(level) > 0 else float("nan")

        if pr.mapped[n_layer, 0] and s[n_layer, 0] - ref >= HEAD_TOLERANCE:
            base, measured = kl_per_energy(ref), [ref]
            for _ in range(HEAD_ROUNDS):
                level = float(s[n_layer, 0])
                if not base > 0 or level <= 0.0 or any(abs(level - m) < HEAD_TOLERANCE for m in measured):
                    break
                ratio = kl_per_energy(level) / base
                measured.append(level)
                if not ratio > 0:
                    break
                w[n_layer, 0] = weights[n_layer, 0] * ratio
                s = allocate(counts, lo, hi, nbytes, sparsity, "greedy", w, head=True)
        candidates = {"measured": s}
        if s[n_layer, 0] > 0:
            candidates["measured, output matrix dense"] = allocate(counts, lo, hi, nbytes, sparsity, "greedy", w, head=True,
                                                                   frozen=head)
        candidates["energy"] = allocate(counts, lo, hi, nbytes, sparsity, "greedy", head=True)
        if candidates["energy"][n_layer, 0] > 0:
            candidates["energy, output matrix dense"] = allocate(counts, lo, hi, nbytes, sparsity, "greedy", head=True,
                                                                 frozen=head)
        budget = (s * nbytes).sum() * (1 - 1e-6)  # a candidate the layers cannot pay for is out
        scores = {name: kl(a) for name, a in candidates.items() if (a * nbytes).sum() >= budget}
    bar.close()
    best = min(scores, key=lambda name: (scores[name], name != "measured"))
    return candidates[best], best, scores


def write_sparse_model(src: str, dst: str, taus: np.ndarray, sparsity: float, method: str, progress: bool = True) -> None:
    """Copies src to dst (every key and tensor) adding the thresholds: taus [n_layer + 1, 4],
    the last row's first the output matrix's."""
    if same_file(src, dst):
        raise PipelineError("the output must not be the input file")
    reader = open_gguf(src)
    w = new_writer(dst, reader.get_field("general.architecture").contents())
    copy_kv(reader, w, skip={KEY_INPUT_THRESHOLDS, KEY_OUTPUT_THRESHOLD, KEY_INPUT_SPARSITY, KEY_INPUT_ALLOCATION,
                             KEY_HEAD_EXACT_ROWS})
    w.add_array(KEY_INPUT_THRESHOLDS, [float(t) for t in taus[:-1].reshape(-1)])
    w.add_float32(KEY_OUTPUT_THRESHOLD, float(taus[-1, 0]))
    w.add_float32(KEY_INPUT_SPARSITY, float(sparsity))
    w.add_string(KEY_INPUT_ALLOCATION, method)
    w.add_uint32(KEY_HEAD_EXACT_ROWS, int(lib.POWERINFER_HEAD_EXACT_ROWS))
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    finish(w, dst, progress=progress, inputs=[src])


def calibration_texts(corpus: Sequence[str], samples: int, model_path: str, threads: int) -> List[str]:
    texts = read_corpus(corpus) if corpus else []
    if samples > 0:
        from .sample import sample

        with tempfile.TemporaryDirectory(prefix="powerinfer-sparsify-") as tmp:
            out = os.path.join(tmp, "samples.jsonl")
            sample(model_path, out, samples, threads=threads)
            texts += read_corpus([out])
    if not texts:
        raise PipelineError("no calibration text: give --corpus files or --samples N")
    return texts


ALLOCATIONS = ("measured", "greedy", "uniform")

# The card scores its positions this many per step: on Qwen2.5-Coder-1.5B (2 threads) its
# 3 x 8 x 256 positions took about 17 minutes one token per decode, llama-cpp-python's
# reference included, and about 5 in steps of 16. Input mode keeps for each token of a step
# the entries it keeps alone; the matrices that run dense, and the reference, take ggml's
# batch kernels, which differ from its decode kernels by rounding (see evaluate.Reference).
CARD_BATCH = 16


def check_arguments(model_path: str, out: str, sparsity: float, corpus: Sequence[str] = (), samples: int = 0,
                    n_tokens: int = 8192, allocation: str = "measured", threads: int = 2) -> None:
    """PipelineError for arguments sparsify() cannot take, before it calibrates (on a 1.5B
    model, 20 minutes): a sparsity out of [0, 1), counts below 1, files that are missing, an
    output that is the input or that its folder cannot take (missing, read-only, full)."""
    if allocation not in ALLOCATIONS:
        raise PipelineError(f"--allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    if not 0.0 <= sparsity < 1.0:  # NaN too
        raise PipelineError(f"--sparsity must be in [0, 1), got {sparsity}")
    if n_tokens < 1 or samples < 0 or threads < 1:
        raise PipelineError(f"--n-tokens and --threads must be >= 1 and --samples >= 0, got {n_tokens}, {threads} "
                            f"and {samples}")
    if not os.path.isfile(model_path):
        raise PipelineError(f"model {model_path}: no such file")
    if sparsity > 0.0 and not corpus and samples == 0:
        raise PipelineError("no calibration text: give --corpus files or --samples N")
    for f in corpus:
        if not os.path.isfile(f):
            raise PipelineError(f"corpus file {f}: no such file")
    if same_file(model_path, out):
        raise PipelineError("the output must not be the input file")
    check_output(out, "--out", os.path.getsize(model_path))


def sparsify(model_path: str, out: str, sparsity: float, corpus: Sequence[str] = (), samples: int = 0,
             n_tokens: int = 8192, allocation: str = "measured", threads: int = 2, progress: bool = True,
             histograms: Optional[Tuple[np.ndarray, float, float, int]] = None,
             weights: Optional[np.ndarray] = None) -> Dict:
    """The sparse copy of model_path at this byte-weighted sparsity; `histograms` and `weights`
    (a previous run's results of those names) skip the calibration and the sensitivity
    measurement, so one of each serves several sparsities."""
    check_arguments(model_path, out, sparsity, corpus, samples, n_tokens, allocation, threads)
    if not libllama.native(model_path):
        return sparsify_libllama(model_path, out, sparsity, corpus, samples, n_tokens, allocation, threads, progress)
    reader = open_gguf(model_path)
    arch = str(reader.get_field("general.architecture").contents())
    block_count = reader.get_field(f"{arch}.block_count")
    if block_count is None:
        raise PipelineError(f"{model_path}: no {arch}.block_count (not a model this engine runs)")
    n_layer = int(block_count.contents())
    t0 = time.time()
    nbytes = input_bytes(model_path, n_layer)
    method, scores = allocation, {}
    if sparsity == 0.0:  # nothing to calibrate: nothing is dropped, every input runs dense
        used, s = 0, np.zeros((n_layer + 1, len(INPUTS)))
    else:
        texts: Optional[List[str]] = None
        if histograms is None:
            texts = calibration_texts(corpus, samples, model_path, threads)
            histograms = collect_input_histograms(model_path, texts, n_tokens, threads, progress=progress)
        counts, lo, hi, used = histograms
        if allocation == "measured":
            texts = texts or calibration_texts(corpus, samples, model_path, threads)
            with _Probe(model_path, texts, counts, lo, hi, threads) as pr:
                if weights is None:
                    weights = measure_weights(model_path, texts, counts, lo, hi, nbytes, threads, progress, pr)
                s, chosen, scores = choose_allocation(model_path, texts, counts, lo, hi, nbytes, sparsity, weights, threads,
                                                      progress, pr)
            method = f"measured ({chosen})"
        else:
            s = allocate(counts, lo, hi, nbytes, sparsity, allocation, None, head=True)
    # an input with nothing to drop runs dense (a negative threshold); the others keep |x| > tau
    taus = np.array([[threshold_for(counts[il, i], lo, hi, s[il, i]) if s[il, i] > 0 else -1.0 for i in range(len(INPUTS))]
                     for il in range(n_layer + 1)], dtype=np.float32)
    write_sparse_model(model_path, out, taus, sparsity, method, progress=progress)
    return {"arch": arch, "tokens": used, "sparsity": s, "thresholds": taus, "bytes": nbytes,
            "histograms": histograms, "weights": weights, "allocation": method, "candidates": scores,
            "seconds": time.time() - t0}


def allocate_tensors(counts: np.ndarray, lo: float, hi: float, nbytes: np.ndarray, sparsity: float,
                     method: str) -> np.ndarray:
    """Per weight tensor (counts [n, bins], nbytes [n]), the share of its input entries
    dropped: `sparsity` of all their bytes (allocate, each tensor a row of one input)."""
    return allocate(counts[:, None, :], lo, hi, nbytes[:, None], sparsity, method)[:, 0]


# Matrices of a layer that read one input (libllama's tensor names): they get one threshold,
# so the module runs them from one shared column copy, as the core does (docs/accel.md).
_SHARED_INPUT = re.compile(r"^(blk\.\d+\.)(?:attn_(?:q|k|v)|ffn_(?:gate|up))(\.weight)$")


def input_key(name: str) -> str:
    """The input a weight reads, as a key: q/k/v of a layer share one, gate/up another."""
    m = _SHARED_INPUT.match(name)
    if not m:
        return name
    return m.group(1) + ("attn_in" if ".attn_" in name else "ffn_in")


def allocate_inputs(names: Sequence[str], counts: np.ndarray, lo: float, hi: float, nbytes: np.ndarray,
                    sparsity: float, method: str) -> Tuple[np.ndarray, List[float]]:
    """allocate_tensors with the tensors that read one input as one item (their bytes summed,
    the histograms of that one input summed): per tensor, the share of its input dropped and
    its threshold (the input's, from the summed histogram; -1: dense)."""
    keys = [input_key(n) for n in names]
    items = list(dict.fromkeys(keys))
    at = {k: i for i, k in enumerate(items)}
    gcounts = np.zeros((len(items), counts.shape[1]), dtype=counts.dtype)
    gbytes = np.zeros(len(items), dtype=np.float64)
    for j, k in enumerate(keys):
        gcounts[at[k]] += counts[j]
        gbytes[at[k]] += nbytes[j]
    shares = allocate_tensors(gcounts, lo, hi, gbytes, sparsity, method)
    taus = [threshold_for(gcounts[i], lo, hi, shares[i]) if shares[i] > 0 else -1.0 for i in range(len(items))]
    return np.array([shares[at[k]] for k in keys]), [taus[at[k]] for k in keys]


def sparsify_libllama(model_path: str, out: str, sparsity: float, corpus: Sequence[str], samples: int, n_tokens: int,
                      allocation: str, threads: int, progress: bool = True) -> Dict:
    """sparsify() for an architecture the core does not build (pipeline/libllama.py): a
    threshold per weight tensor, from the module's histograms of its input; the measured
    allocation needs the core's graph, so it is the greedy one there."""
    t0 = time.time()
    method = "greedy" if allocation == "measured" else allocation
    label = method + (" (measured needs the core's graph: libllama runs this architecture)" if allocation == "measured" else "")
    if sparsity == 0.0:
        names, taus, used, s, nbytes = [], [], 0, np.zeros(0), np.zeros(0)
    else:
        texts = calibration_texts(corpus, samples, model_path, threads)
        names, counts, lo, hi, nbytes, used = libllama.tensor_histograms(model_path, texts, n_tokens, threads,
                                                                         progress=progress)
        s, taus = allocate_inputs(names, counts, lo, hi, nbytes, sparsity, method)
    libllama.write_tensor_thresholds(model_path, out, names, taus, {KEY_INPUT_SPARSITY: sparsity},
                                     {KEY_INPUT_ALLOCATION: label}, progress=progress)
    return {"arch": str(open_gguf(model_path).get_field("general.architecture").contents()), "tokens": used,
            "names": names, "sparsity": s, "thresholds": np.array(taus, dtype=np.float32), "bytes": nbytes,
            "allocation": label, "candidates": {}, "seconds": time.time() - t0}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import evaluate

    p = argparse.ArgumentParser(prog="powerinfer sparsify", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--sparsity", type=float, required=True, help="share of the matrices' bytes not read per token")
    p.add_argument("--out", required=True)
    p.add_argument("--corpus", nargs="+", default=[], help="calibration text files (plain, or `powerinfer sample` .jsonl)")
    p.add_argument("--samples", type=int, default=None,
                   help="tokens of the model's own samples to add (default 2048 without --corpus, else 0)")
    p.add_argument("--n-tokens", type=int, default=8192, help="calibration tokens used (default 8192)")
    p.add_argument("--allocation", choices=ALLOCATIONS, default="measured",
                   help="measured (default): greedy over each input's dropped energy weighted by the harm measured "
                        "per layer and input kind; greedy: by dropped energy alone; uniform: the same everywhere")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", nargs="+", metavar="[NAME=]FILE", help="held-out domains for the trust card")
    p.add_argument("--card", help="the card's path without extension (default: OUT without .gguf)")
    p.add_argument("--no-card", action="store_true", help="skip the trust card")
    p.add_argument("--no-speed", action="store_true", help="the card without its speed table")
    evaluate.add_arguments(p, prefix="card-", batch=CARD_BATCH)

    def run(a):
        samples = a.samples if a.samples is not None else (0 if a.corpus else 2048)
        # everything the card will need is checked before the minutes of calibration
        check_arguments(a.model, a.out, a.sparsity, a.corpus, samples, a.n_tokens, a.allocation, a.threads)
        if not a.no_card:
            if not a.text:
                raise PipelineError("the trust card needs held-out text: --text [NAME=]FILE... (or --no-card)")
            evaluate.parse_domains(a.text)
            evaluate.check_options(a.card_passages, a.card_n_tokens, a.card_n_gen, a.card_n_prompt, a.card_batch,
                                   ["input"], prefix="card-")
        r = sparsify(a.model, a.out, a.sparsity, a.corpus, samples, a.n_tokens, a.allocation, a.threads)
        s, b = r["sparsity"], r["bytes"]
        if "names" in r:  # per weight tensor (libllama's architectures): by kind of tensor
            kinds: Dict[str, List[int]] = {}
            for k, name in enumerate(r["names"]):
                kinds.setdefault(name.split(".", 2)[-1] if name.startswith("blk.") else name, []).append(k)
            per_input = ", ".join(f"{kind} {np.average(s[ks], weights=b[ks]):.0%}" for kind, ks in kinds.items()) or "none"
        else:
            # the layers' inputs by kind, then the output matrix (row n_layer, input 0: not a q/k/v)
            per_input = ", ".join(f"{name} {np.average(s[:-1, i], weights=b[:-1, i]):.0%}" for i, name in enumerate(INPUTS))
            per_input += f", output matrix {s[-1, 0]:.0%}"
        print(f"sparsify: {r['tokens']} calibration tokens, {r['allocation']} allocation: {per_input} of each input's entries "
              f"dropped ({a.sparsity:.0%} of the bytes) in {r['seconds']:.0f} s; wrote {a.out}", file=sys.stderr)
        if a.no_card:
            return 0
        card = evaluate.evaluate(a.out, evaluate.parse_domains(a.text), a.model, ["input"], a.card_passages,
                                 a.card_n_tokens, a.threads, a.card_n_gen, a.card_n_prompt, not a.no_speed,
                                 batch=a.card_batch)
        print(evaluate.render(card))
        md, js = evaluate.write_card(card, a.card or _card_base(a.out))
        print(f"card: {md}, {js}", file=sys.stderr)
        return 0

    def paths(a):
        card = a.card or _card_base(a.out)
        written = [f for out in (a.out, *evaluate.card_files(card)) for f in files(out)]
        inputs = [("the model", a.model, files(a.model))] + [("--corpus", f, files(f)) for f in a.corpus]
        return [("--out", a.out, written)], inputs + evaluate.card_inputs(a.text, None)

    return run_cli(run, argv, p, paths)


def _card_base(out: str) -> str:
    return out[:-5] + ".card" if out.endswith(".gguf") else out + ".card"


if __name__ == "__main__":
    sys.exit(main())
