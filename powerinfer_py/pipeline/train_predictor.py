"""Train per-layer activation predictors (numpy, no torch):

    powerinfer train-predictor --samples DIR_OR_NPZ [--model MODEL]
        [--param-budget N | --rank R] [--target-recall 0.95] --out DIR

Each layer gets a low-rank MLP, logit = fc2 · relu(fc1 · x_res) (no biases, no
sigmoid at inference: PowerInfer's predictor), trained with binary cross-entropy on the
(x_res, fired) pairs that `powerinfer profile --samples` recorded, using Adam.

- Inputs are scaled per channel by their root mean square while training; the scale
  is folded back into fc1, so the saved predictor takes the raw residual stream.
  One hidden unit starts aligned with the mean input, so the MLP has a bias to start from.
- Split: 80% of the pairs train, 10% calibrate the threshold, 10% test. The threshold is
  chosen per layer on the calibration pairs as the largest logit threshold whose recall
  reaches --target-recall; recall and precision are then reported on the test pairs.
- Rank per layer (within --param-budget, a total over all layers, each rank unit of a
  layer costing n_embd + n_ff parameters): proportional to the square root of the layer's
  active fraction (denser layers have more firing neurons to get right), rounded to a
  multiple of 32 (whole quantization blocks) and clamped to [32, min(n_embd, n_ff)].
  --rank R gives every layer rank R. Default budget: mean rank n_embd/4 (at least 32).

Writes DIR/model_{i}.pt (state dicts: fc1.weight [r, n_embd], fc2.weight [n_ff, r],
PowerInfer's layout), DIR/config.json (`sparse_threshold`, read by PowerInfer's
converter) and DIR/thresholds.json (ours: the global threshold = the smallest per-layer
one, per-layer thresholds, ranks, recall/precision). `powerinfer convert --predictors DIR`
stores them as `powerinfer.sparse_threshold` and `powerinfer.sparse_thresholds`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..formats import pt_io
from ..formats.gguf_io import field, open_gguf
from .common import PipelineError, Progress, files, run_cli, write_text


# ---------------------------------------------------------------- metrics and thresholds

def recall_precision(logits: np.ndarray, mask: np.ndarray, threshold: float) -> Tuple[float, float]:
    """Micro-averaged recall and precision of `logit >= threshold` (the engine's rule, and
    PowerInfer's: a neuron is skipped iff its logit < threshold) against mask (fired).
    No positives: recall 1; nothing predicted: precision 1."""
    pred = np.asarray(logits) >= threshold
    mask = np.asarray(mask, dtype=bool)
    tp = int(np.count_nonzero(pred & mask))
    pos, npred = int(np.count_nonzero(mask)), int(np.count_nonzero(pred))
    return (tp / pos if pos else 1.0), (tp / npred if npred else 1.0)


def threshold_for_recall(logits: np.ndarray, mask: np.ndarray, target: float) -> float:
    """A threshold t with recall(logit >= t) >= target on these pairs: one float32 step below
    the lowest positive logit that must be kept (the largest such t but for that step, which
    keeps the positive when the engine's float32 arithmetic rounds its logit slightly lower)."""
    if not 0.0 < target <= 1.0:
        raise PipelineError(f"target recall must be in (0, 1], got {target}")
    pos = np.sort(np.asarray(logits, dtype=np.float32)[np.asarray(mask, dtype=bool)])
    if pos.size == 0:
        return float(np.max(logits)) if np.size(logits) else 0.0
    need = math.ceil(target * pos.size - 1e-9)  # positives that must score at least t
    k = pos.size - need  # how many of the lowest may be missed
    return float(np.nextafter(pos[k], np.float32(-np.inf)))


# ---------------------------------------------------------------- samples

def load_samples(path) -> List[Tuple[np.ndarray, np.ndarray]]:
    """[(x [N, n_embd] float32, mask [N, n_ff] bool)] per layer, from a profile output dir,
    its samples/ dir (layer_{i}.npz) or one .npz with x_{i} / mask_{i} arrays."""
    p = Path(path)
    if p.is_dir() and (p / "samples").is_dir():
        p = p / "samples"
    out = []
    if p.is_dir():
        files = sorted(p.glob("layer_*.npz"), key=lambda f: int(f.stem.split("_")[1]))
        if not files:
            raise PipelineError(f"{p}: no layer_{{i}}.npz files (run `powerinfer profile --samples N`)")
        if [int(f.stem.split("_")[1]) for f in files] != list(range(len(files))):
            raise PipelineError(f"{p}: layer_{{i}}.npz files are not numbered 0..{len(files) - 1}")
        for f in files:
            with np.load(f) as z:
                n_ff = int(z["n_ff"])
                out.append((z["x"].astype(np.float32), np.unpackbits(z["mask"], axis=1, count=n_ff).astype(bool)))
    elif p.is_file() and p.suffix == ".npz":
        with np.load(p) as z:
            i = 0
            while f"x_{i}" in z:
                out.append((z[f"x_{i}"].astype(np.float32), z[f"mask_{i}"].astype(bool)))
                i += 1
        if not out:
            raise PipelineError(f"{p}: no x_0/mask_0 arrays")
    else:
        raise PipelineError(f"{p}: no such samples directory or .npz file")
    for i, (x, m) in enumerate(out):
        if x.ndim != 2 or m.ndim != 2 or len(x) != len(m):
            raise PipelineError(f"layer {i}: x {x.shape} and mask {m.shape} do not pair up")
        if len(x) < 20:
            raise PipelineError(f"layer {i}: only {len(x)} samples; record more with --samples")
    return out


# ---------------------------------------------------------------- ranks

def choose_ranks(active_frac: Sequence[float], n_embd: int, n_ff: int, budget: Optional[int] = None,
                 rank: Optional[int] = None) -> List[int]:
    """Per-layer ranks; see the module docstring for the rule."""
    L = len(active_frac)
    hi = max(32, (min(n_embd, n_ff) // 32) * 32)
    if rank is not None:
        if rank < 1:
            raise PipelineError("--rank must be >= 1")
        return [rank] * L
    unit = n_embd + n_ff
    if budget is None:
        budget = L * unit * max(32, 32 * math.ceil(n_embd / 4 / 32))
    if budget < L * 32 * unit:
        raise PipelineError(f"--param-budget {budget} is below the minimum {L * 32 * unit} (rank 32 per layer)")
    w = np.sqrt(np.maximum(np.asarray(active_frac, dtype=np.float64), 1e-6))
    mean_rank = budget / unit / L
    ranks = [int(min(hi, max(32, 32 * round(mean_rank * wi / w.mean() / 32)))) for wi in w]
    while sum(ranks) * unit > budget:  # rounding overshoot: trim the largest
        j = int(np.argmax(ranks))
        if ranks[j] <= 32:
            break
        ranks[j] -= 32
    return ranks


# ---------------------------------------------------------------- training

def _adam(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    state["t"] += 1
    t = state["t"]
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state["m"][i], state["v"][i]
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        p -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def predictor_logits(x: np.ndarray, fc1: np.ndarray, fc2: np.ndarray, batch: int = 4096) -> np.ndarray:
    out = np.empty((len(x), fc2.shape[0]), dtype=np.float32)
    for i in range(0, len(x), batch):
        out[i : i + batch] = np.maximum(x[i : i + batch] @ fc1.T, 0) @ fc2.T
    return out


def train_layer(x: np.ndarray, y: np.ndarray, rank: int, epochs: int = 8, batch: int = 512, lr: float = 3e-3,
                seed: int = 0, min_steps: int = 300) -> Tuple[np.ndarray, np.ndarray]:
    """fc1 [rank, n_embd], fc2 [n_ff, rank] for raw inputs x, by Adam on mean BCE."""
    rng = np.random.default_rng(seed)
    n, e = x.shape
    f = y.shape[1]
    scale = np.sqrt(np.mean(x * x, axis=0)) + 1e-6  # RMS, so constant channels keep a sane scale
    xs = (x / scale).astype(np.float32)
    w1 = (rng.standard_normal((rank, e)) * math.sqrt(2.0 / e)).astype(np.float32)
    mu = xs.mean(axis=0)
    w1[0] = mu / max(float(mu @ mu), 1e-6)  # a unit that is ~1 on typical inputs: a learnable bias
    w2 = (rng.standard_normal((f, rank)) / math.sqrt(rank)).astype(np.float32)
    p0 = float(np.clip(y.mean(), 1e-4, 1 - 1e-4))
    w2[:, 0] = math.log(p0 / (1 - p0))  # start at the base rate
    st = {"t": 0, "m": [np.zeros_like(w1), np.zeros_like(w2)], "v": [np.zeros_like(w1), np.zeros_like(w2)]}
    yf = y.astype(np.float32)
    per_epoch = math.ceil(n / batch)
    epochs = max(epochs, math.ceil(min_steps / per_epoch))  # small sample sets still get enough updates
    steps = epochs * per_epoch
    s = 0
    with np.errstate(over="ignore"):
        for ep in range(epochs):
            order = rng.permutation(n)
            for i in range(0, n, batch):
                idx = order[i : i + batch]
                xb, yb = xs[idx], yf[idx]
                z1 = xb @ w1.T
                h = np.maximum(z1, 0)
                z = h @ w2.T
                g = (1.0 / (1.0 + np.exp(-z)) - yb) / (len(idx) * f)
                dw2 = g.T @ h
                dh = g @ w2
                dh[z1 <= 0] = 0
                dw1 = dh.T @ xb
                cur = lr * 0.5 * (1 + math.cos(math.pi * s / steps))
                _adam([w1, w2], [dw1, dw2], st, cur)
                s += 1
    return (w1 / scale[None, :]).astype(np.float32), w2.astype(np.float32)


def train(samples, out: str, model: Optional[str] = None, budget: Optional[int] = None, rank: Optional[int] = None,
          target_recall: float = 0.95, epochs: int = 8, lr: float = 3e-3, seed: int = 0, progress: bool = True,
          min_steps: int = 300) -> Dict:
    layers = load_samples(samples)
    n_layer = len(layers)
    n_embd, n_ff = layers[0][0].shape[1], layers[0][1].shape[1]
    if any(x.shape[1] != n_embd or m.shape[1] != n_ff for x, m in layers):
        raise PipelineError("layers differ in n_embd or n_ff")
    if model is not None:
        r = open_gguf(model)
        arch = field(r, "general.architecture")
        want = (field(r, f"{arch}.block_count"), field(r, f"{arch}.embedding_length"), field(r, f"{arch}.feed_forward_length"))
        if want != (n_layer, n_embd, n_ff):
            raise PipelineError(f"samples are for n_layer/n_embd/n_ff {(n_layer, n_embd, n_ff)}, the model has {want}")
    if not 0.0 < target_recall <= 1.0:
        raise PipelineError(f"--target-recall must be in (0, 1], got {target_recall}")
    dens = [float(m.mean()) for _, m in layers]
    ranks = choose_ranks(dens, n_embd, n_ff, budget, rank)
    rng = np.random.default_rng(seed)
    preds, rows = [], []
    bar = Progress("train-predictor", n_layer, progress)
    t0 = time.time()
    for il, (x, m) in enumerate(layers):
        order = rng.permutation(len(x))
        n_tr, n_cal = int(0.8 * len(x)), int(0.1 * len(x))
        tr, cal, te = order[:n_tr], order[n_tr : n_tr + n_cal], order[n_tr + n_cal :]
        fc1, fc2 = train_layer(x[tr], m[tr], ranks[il], epochs=epochs, lr=lr, seed=seed + il, min_steps=min_steps)
        t = threshold_for_recall(predictor_logits(x[cal], fc1, fc2), m[cal], target_recall)
        lt = predictor_logits(x[te], fc1, fc2)
        rec, prec = recall_precision(lt, m[te], t)
        rows.append({"layer": il, "rank": ranks[il], "threshold": t, "recall": rec, "precision": prec,
                     "active": float(m[te].mean()), "predicted_active": float((lt > t).mean()),
                     "n_train": len(tr), "n_test": len(te)})
        preds.append((fc1, fc2))
        bar.update(il + 1, f"layer {il}: recall {rec:.3f} precision {prec:.3f}")
    bar.close()
    thr = [r["threshold"] for r in rows]
    glob = float(min(thr))
    pt_io.write_predictor_dir(out, preds)
    # PowerInfer's convert.py reads sparse_threshold from the predictor dir's config.json
    cfg = Path(out) / "config.json"
    write_text(cfg, json.dumps({**(json.loads(cfg.read_text()) if cfg.is_file() else {}), "sparse_threshold": glob},
                               indent=1))
    rep = {"sparse_threshold": glob, "sparse_thresholds": thr, "target_recall": target_recall, "n_layer": n_layer,
           "n_embd": n_embd, "n_ff": n_ff, "params": int(sum(ranks) * (n_embd + n_ff)), "wall_s": time.time() - t0,
           "mean_recall": float(np.mean([r["recall"] for r in rows])),
           "mean_precision": float(np.mean([r["precision"] for r in rows])), "layers": rows}
    write_text(Path(out) / "thresholds.json", json.dumps(rep, indent=1))
    return rep


def format_report(rep: Dict) -> str:
    lines = [f"predictors for {rep['n_layer']} layers, {rep['params']} parameters, target recall "
             f"{rep['target_recall']:.2f} (thresholds chosen on calibration pairs, metrics on test pairs)",
             "| layer | rank | threshold | recall | precision | active | predicted active |", "|---|---|---|---|---|---|---|"]
    for r in rep["layers"]:
        lines.append(f"| {r['layer']} | {r['rank']} | {r['threshold']:.3f} | {r['recall']:.3f} | {r['precision']:.3f} "
                     f"| {r['active']:.1%} | {r['predicted_active']:.1%} |")
    lines.append(f"mean recall {rep['mean_recall']:.3f}, mean precision {rep['mean_precision']:.3f}; "
                 f"global threshold {rep['sparse_threshold']:.3f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer train-predictor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", required=True, help="profile output dir, its samples/ dir, or an .npz")
    p.add_argument("--model", help="the profiled model (checks that the shapes match)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--param-budget", type=int, help="total predictor parameters over all layers")
    g.add_argument("--rank", type=int, help="the same rank for every layer")
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--min-steps", type=int, default=300,
                   help="Adam steps per layer at least, however few the samples (default 300)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (model_{i}.pt, thresholds.json)")

    def run(a):
        rep = train(a.samples, a.out, model=a.model, budget=a.param_budget, rank=a.rank, target_recall=a.target_recall,
                    epochs=a.epochs, lr=a.lr, seed=a.seed, min_steps=a.min_steps)
        print(format_report(rep))
        return 0

    def paths(a):
        return ([("--out", a.out, files(a.out, "model_*.pt", "config.json", "thresholds.json"))],
                [("--samples", a.samples, files(a.samples, "samples", "samples/layer_*.npz", "layer_*.npz")),
                 ("--model", a.model, files(a.model))])

    return run_cli(run, argv, p, paths)


if __name__ == "__main__":
    sys.exit(main())
