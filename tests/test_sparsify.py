"""`powerinfer sparsify` and input mode end to end, on the real SmolLM2-135M (Q4_1, Q8_0) and
Qwen2.5-Coder-0.5B (Q5_0, Q8_0, Q4_K, Q6_K): the copy holds the input's every tensor and key
plus the thresholds, the engine picks input mode up by itself, the kept share follows the
calibration, and the logits follow the dense path. The operator itself is checked against
numpy in tests/test_input_sparse.py.

Tolerances: with every nonzero entry kept (threshold 0) the only difference from the dense
path is how each engine quantizes a matrix's input to 8 bits (ggml per 32 or 256 entries
with its own rounding of the step, ours per 32 or 256 with an f32 step), so the logits stay
within a few percent of their range and the greedy tokens agree; with entries dropped, the
KL divergence from the dense path grows with the sparsity, and what a model loses is the
card's business (docs/input-sparsity.md), not a test's.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
import pytest

from powerinfer_py import Llama
from powerinfer_py._core import Context, Model
from powerinfer_py.pipeline import cli
from powerinfer_py.pipeline import sparsify as sparsify_mod
from powerinfer_py.pipeline.common import tokenize_texts
from powerinfer_py.pipeline.evaluate import model_logp, passages
from powerinfer_py.pipeline.sparsify import (CARD_BATCH, INPUTS, KEY_INPUT_THRESHOLDS, KEY_OUTPUT_THRESHOLD, allocate, dropped_energy,
                                             sparsify, threshold_for)

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep. def parse(line):\n    key, _, value = line.partition('=')\n"
        "    return key.strip(), value.strip()\n") * 30


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _logits(path, tokens, **kw):
    with Model(path, **kw) as m, Context(m, n_ctx=len(tokens) + 8, n_threads=2) as c:
        out = []
        for i, t in enumerate(tokens):
            c.decode([t], i)
            out.append(np.array(c.logits(-1), dtype=np.float64))
        return np.array(out)


def _log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    """The measured allocation's probe on 2 passages of 64 tokens (the tool's 4 x 128 takes
    a minute on SmolLM2's 30 layers; what is checked here does not need them)."""
    monkeypatch.setattr(sparsify_mod, "PROBE_PASSAGES", 2)
    monkeypatch.setattr(sparsify_mod, "PROBE_TOKENS", 64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    f.write_text(TEXT)
    return str(f)


@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_sparse_copy_runs_in_input_mode(which, smollm2_path, qwen_path, corpus, tmp_path):
    src = smollm2_path if which == "smollm2" else qwen_path
    before = _sha(src)
    out = tmp_path / "sparse.gguf"
    # SmolLM2 by the default (measured) allocation on a small probe, Qwen by the energy greedy
    r = sparsify(src, str(out), 0.3, [corpus], n_tokens=512, progress=False,
                 allocation="measured" if which == "smollm2" else "greedy")
    assert _sha(src) == before  # the input is untouched
    n_layer = r["thresholds"].shape[0] - 1  # the last row: the output matrix (input 0)
    if which == "smollm2":
        # every tensor of the input, byte for byte, and the thresholds (the writer is the same for
        # every model; gguf's reader takes a minute over Qwen's 151k-token vocabulary, so once)
        import gguf

        a, b = gguf.GGUFReader(src), gguf.GGUFReader(str(out))
        ta = {t.name: bytes(t.data.tobytes()) for t in a.tensors}
        tb = {t.name: bytes(t.data.tobytes()) for t in b.tensors}
        assert ta == tb
        assert list(b.get_field(KEY_INPUT_THRESHOLDS).contents()) == pytest.approx(r["thresholds"][:-1].reshape(-1).tolist())
        assert b.get_field(KEY_OUTPUT_THRESHOLD).contents() == pytest.approx(float(r["thresholds"][-1, 0]))
    # the bytes dropped are the target's share of the layers' matrices (wherever they are dropped)
    s, nb = r["sparsity"], r["bytes"]
    assert (s * nb).sum() / nb[:-1].sum() == pytest.approx(0.3, abs=1e-6)
    assert (s[-1, 1:] == 0).all()

    with Model(str(out)) as m:
        assert m.sparse_mode() == "input"
        for il in range(n_layer):
            for i in range(len(INPUTS)):
                assert m.input_threshold(il, i) == pytest.approx(float(r["thresholds"][il, i]))
                # an input left dense (below the least sparsity worth it) has a negative threshold
                assert m.input_sparse(il, i) == (s[il, i] > 0) == (r["thresholds"][il, i] >= 0)
                assert s[il, i] == 0 or s[il, i] >= 0.25 - 1e-9
        assert m.input_threshold(n_layer, 0) == pytest.approx(float(r["thresholds"][-1, 0]))
        assert m.input_sparse(n_layer, 0) == (s[-1, 0] > 0)
    with Model(str(out), sparse_mode="dense") as m:
        assert m.sparse_mode() == "dense"

    # on the calibration text, the kept share of each input follows its allocation
    with Model(str(out)) as m, Context(m, n_ctx=160, n_threads=2) as c:
        toks = m.tokenize(TEXT.encode(), True, False)[:96]
        for pos, t in enumerate(toks):
            c.decode([t], pos)
        for i in range(len(INPUTS)):
            sparse_layers = [il for il in range(n_layer) if s[il, i] > 0]
            if not sparse_layers:
                continue
            kept = sum(c.input_stats(il, i)[0] for il in sparse_layers)
            total = sum(c.input_stats(il, i)[1] for il in sparse_layers)
            target = 1.0 - np.mean(s[sparse_layers, i])
            assert abs(kept / total - target) < 0.12, (INPUTS[i], kept / total, target)
        if s[-1, 0] > 0:  # the output matrix's input
            kept, total = c.input_stats(n_layer, 0)
            assert abs(kept / total - (1.0 - s[-1, 0])) < 0.12, ("output", kept / total, s[-1, 0])

    # Llama and the CLI pick the mode up by themselves
    llm = Llama(model_path=str(out), n_ctx=128, n_threads=2, verbose=False)
    try:
        assert llm.sparse_mode_in_use() == "input"
        text = llm.create_completion("The earth was", max_tokens=8, temperature=0)["choices"][0]["text"]
        assert text.strip()
        assert llm.sparse_stats()["mode"] == "input" and 0.4 < llm.sparse_stats()["active"] < 1.0
    finally:
        llm.close()


def test_threshold_zero_follows_the_dense_path(qwen_path):
    with Model(qwen_path, vocab_only=True) as m:
        toks = m.tokenize(TEXT.encode(), True, False)[:40]
    dense = _logits(qwen_path, toks, sparse_mode="dense")
    sparse = _logits(qwen_path, toks, sparse_mode="input", sparse_threshold=0.0)
    assert np.array_equal(dense[0], sparse[0])  # a sequence's first token runs dense
    span = dense.max(axis=1) - dense.min(axis=1)
    assert (np.abs(dense - sparse).max(axis=1) < 0.06 * span).all()
    # the greedy token agrees wherever the dense path decided it: a lead of more than 1% of
    # the span over the second (near-ties go either way with the 8-bit inputs' rounding,
    # which any change of summation order moves: 3 of 40 tokens here, leads of 0.004 to 0.1
    # with spans near 30)
    top2 = np.sort(dense, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 0.01 * span
    assert decided.mean() >= 0.8
    assert (dense.argmax(axis=1) == sparse.argmax(axis=1))[decided].mean() >= 0.95


def _batch_logits(model, tokens, pieces, logits_all=True):
    """The logits of tokens decoded in consecutive batches of the given sizes: every row, or
    the last row of each batch."""
    with Context(model, n_ctx=len(tokens) + 8, n_threads=2, n_threads_batch=2) as c:
        out, pos = [], 0
        for k in pieces:
            c.decode(tokens[pos : pos + k], pos, logits_all=logits_all)
            rows = c.logits(0, k) if logits_all else c.logits(-1)
            out.append(np.asarray(rows, dtype=np.float64).reshape(-1, model.n_vocab()))
            pos += k
    return np.concatenate(out)


def test_prompt_batches_follow_the_rule(qwen_path):
    """Input mode's rule holds however a prompt is cut into batches. A batch above
    sparse_max_batch (8) runs ggml's dense matmuls, but on inputs with the entries the rule
    drops zeroed, so its tokens get what the sparse product gives them up to rounding. Before,
    such a batch ran fully dense, so a token's result depended on how the prompt was cut: a
    prompt cache or a slot adopting another's prefix gave the same text other logits.
    Measured here (threshold 0.05, 40 tokens): one batch against batches of 8, KL 0.005; the
    dense path against batches of 8, KL 0.058 (the old one-batch figure was 0.063). The bar,
    a quarter of the dense distance, leaves room for rounding (amplified where an entry near
    the threshold flips) and fails the old behaviour. A sequence's first token keeps every
    entry (its row equals the dense path's up to the head's exact top rows, computed by
    another kernel), and a batch that keeps only its last row gives that row's logits."""
    with Model(qwen_path, vocab_only=True) as m:
        toks = m.tokenize(TEXT.encode(), True, False)[:40]
    n = len(toks)
    pieces8 = [1] + [8] * ((n - 1) // 8) + ([(n - 1) % 8] if (n - 1) % 8 else [])
    with Model(qwen_path, sparse_mode="input", sparse_threshold=0.05) as ms, Model(qwen_path, sparse_mode="dense") as md:
        small = _batch_logits(ms, toks, pieces8)  # every step sparse (the first token alone, dense)
        whole = _batch_logits(ms, toks, [n])
        cut = _batch_logits(ms, toks, [13, n - 13])
        last = _batch_logits(ms, toks, [n], logits_all=False)
        dense = _batch_logits(md, toks, [n])

    def kl(p, q):
        p, q = _log_softmax(p)[1:], _log_softmax(q)[1:]
        return float((np.exp(p) * (p - q)).sum(axis=1).mean())

    assert kl(dense, small) > 0.02  # the threshold drops enough to matter
    assert kl(whole, small) < 0.25 * kl(dense, small), (kl(whole, small), kl(dense, small))
    assert kl(cut, small) < 0.25 * kl(dense, small), (kl(cut, small), kl(dense, small))
    assert np.allclose(whole[0], dense[0], rtol=0, atol=1e-3)
    assert np.array_equal(last[0], whole[-1])


def test_kl_grows_with_sparsity(smollm2_path):
    with Model(smollm2_path, vocab_only=True) as m:
        toks = m.tokenize(TEXT.encode(), True, False)[:40]
    ref = _log_softmax(_logits(smollm2_path, toks, sparse_mode="dense"))[1:]
    kls = []
    for tau in (0.0, 0.02, 0.2):
        lp = _log_softmax(_logits(smollm2_path, toks, sparse_mode="input", sparse_threshold=tau))[1:]
        kls.append(float((np.exp(ref) * (ref - lp)).sum(axis=1).mean()))
    assert kls[0] < kls[1] < kls[2], kls
    assert kls[0] < 0.05


def test_allocation():
    # two inputs, one whose small entries carry little energy (heavy-tailed): greedy drops more there
    lo, hi, n_bins = -8.0, 4.0, 480
    edges = 10.0 ** np.linspace(lo, hi, n_bins + 1)
    rng = np.random.default_rng(0)
    heavy = np.histogram(np.abs(rng.standard_cauchy(200_000)) * 0.01, bins=edges)[0]
    light = np.histogram(np.abs(rng.standard_normal(200_000)), bins=edges)[0]
    counts = np.array([[light, heavy]], dtype=np.uint64)
    nbytes = np.array([[1000.0, 1000.0]])
    u = allocate(counts, lo, hi, nbytes, 0.4, "uniform")
    g = allocate(counts, lo, hi, nbytes, 0.4, "greedy")
    assert np.allclose(u, 0.4)
    assert (g * nbytes).sum() / nbytes.sum() == pytest.approx(0.4)
    assert g[0, 1] > 0.4 > g[0, 0]
    assert g[0, 0] == 0 or g[0, 0] >= 0.25  # an input is dense or at least S_MIN sparse
    e = lambda s, i: float(dropped_energy(counts[0, i], lo, hi, np.array([s]))[0])  # noqa: E731
    assert e(g[0, 0], 0) + e(g[0, 1], 1) < e(0.4, 0) + e(0.4, 1)
    # frozen: an input greedy leaves dense, the budget spent on the others
    f = allocate(counts, lo, hi, nbytes, 0.4, "greedy", frozen=np.array([[False, True]]))
    assert f[0, 1] == 0 and f[0, 0] == pytest.approx(0.8)
    # thresholds are the histogram's quantiles
    for s in (0.1, 0.5, 0.9):
        tau = threshold_for(light, lo, hi, s)
        assert (np.abs(rng.standard_normal(100_000)) < tau).mean() == pytest.approx(s, abs=0.02)
    with pytest.raises(Exception, match="sparsity"):
        allocate(counts, lo, hi, nbytes, 1.0)
    # head: the last row is the output matrix; the budget is the other rows' share, which
    # greedy may spend on it too, and uniform leaves it dense
    counts_h = np.array([[light, heavy], [heavy, np.zeros_like(heavy)]], dtype=np.uint64)
    nbytes_h = np.array([[1000.0, 1000.0], [500.0, 0.0]])
    u = allocate(counts_h, lo, hi, nbytes_h, 0.4, "uniform", head=True)
    assert np.allclose(u[0], 0.4) and (u[1] == 0).all()
    g = allocate(counts_h, lo, hi, nbytes_h, 0.4, "greedy", head=True)
    assert (g * nbytes_h).sum() == pytest.approx(0.4 * 2000.0)
    assert g[1, 0] > 0 and g[1, 1] == 0


def test_cli_end_to_end_with_card(smollm2_path, corpus, tmp_path, capsys):
    held = tmp_path / "held.txt"
    held.write_text("Whereas the parties agree that the licensee shall keep the notices intact. " * 20)
    out = tmp_path / "s.gguf"
    rc = cli.main(["sparsify", smollm2_path, "--sparsity", "0.25", "--out", str(out), "--corpus", corpus, "--n-tokens", "512",
                   "--text", f"legal={held}", "--card-passages", "1", "--card-n-tokens", "48", "--no-speed"])
    err = capsys.readouterr()
    assert rc == 0, err.err
    assert out.exists() and (tmp_path / "s.card.md").exists() and (tmp_path / "s.card.json").exists()
    assert "| legal | input |" in err.out
    # the card scored CARD_BATCH tokens per step: input mode gives each token of a step what
    # it gets alone, bit for bit where every dense matrix's batch kernel rounds as its decode
    # kernel does (measured so here); bound: the batch-versus-decode rounding of ggml's own
    # kernels (KL 0.003 per position on Qwen2.5's Q4_K)
    assert json.loads((tmp_path / "s.card.json").read_text())["batch"] == CARD_BATCH == 16
    p = passages(tokenize_texts(str(out), [held.read_text()]), 1, 48)[0]
    with Model(str(out), sparse_mode="input") as m:
        alone, _ = model_logp(m, p, 2)
        batched, _ = model_logp(m, p, 2, CARD_BATCH)
    kl = (np.exp(alone) * (alone - batched)).sum(axis=1)
    assert kl.mean() < 0.02 and (alone.argmax(axis=1) == batched.argmax(axis=1)).mean() >= 0.9, kl
    # the summary gives the layers' inputs by kind and the output matrix apart
    line = next(ln for ln in err.err.splitlines() if ln.startswith("sparsify:"))
    assert "qkv " in line and "down " in line and ", output matrix " in line
    # without held-out text there is no card, and the command says why
    assert cli.main(["sparsify", smollm2_path, "--sparsity", "0.25", "--out", str(tmp_path / "t.gguf"), "--corpus", corpus]) == 1
    assert "held-out" in capsys.readouterr().err
    for bad in (["--sparsity", "1.0"], ["--sparsity", "-0.1"]):
        assert cli.main(["sparsify", smollm2_path, *bad, "--out", str(tmp_path / "u.gguf"), "--corpus", corpus,
                         "--no-card"]) == 1
        assert not (tmp_path / "u.gguf").exists()


def test_main_cli_runs_a_sparse_copy(smollm2_path, corpus, tmp_path, cli_path):
    out = tmp_path / "s.gguf"
    sparsify(smollm2_path, str(out), 0.3, [corpus], n_tokens=512, progress=False)
    r = subprocess.run([str(cli_path), "-m", str(out), "-p", "The earth was", "-n", "12", "-t", "2", "--temp", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "sparse mode = input" in r.stderr and "sparse input =" in r.stderr
    r = subprocess.run([str(cli_path), "-m", str(out), "-p", "x", "-n", "2", "--sparse-mode", "input", "--sparse-threshold", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "threshold" in r.stderr


def test_measured_weights_and_runtime_thresholds(smollm2_path, corpus):
    from powerinfer_py.pipeline.common import read_corpus

    counts, lo, hi, _ = sparsify_mod.collect_input_histograms(smollm2_path, read_corpus([corpus]), 512, progress=False)
    n_layer = counts.shape[0] - 1  # and the output matrix's row
    assert counts[n_layer, 0].sum() > 0 and counts[n_layer, 1:].sum() == 0
    nbytes = sparsify_mod.input_bytes(smollm2_path, n_layer)
    w = sparsify_mod.measure_weights(smollm2_path, read_corpus([corpus]), counts, lo, hi, nbytes, progress=False)
    assert w.shape == (n_layer + 1, len(INPUTS)) and np.isfinite(w).all() and (w > 0).all()
    assert w.mean() == pytest.approx(1.0)
    # separable: a layer's weights are the same kind weights scaled
    ratio = w / w[0:1, :]
    assert np.allclose(ratio, ratio[:, :1], rtol=1e-9)
    # the weighted greedy still lands on the budget, with inputs dense or at least S_MIN sparse
    s = allocate(counts, lo, hi, nbytes, 0.4, "greedy", weights=w, head=True)
    assert (s * nbytes).sum() / nbytes[:-1].sum() == pytest.approx(0.4)
    assert ((s == 0) | (s >= sparsify_mod.S_MIN - 1e-9)).all()
    # the candidates scored whole on the probe passages, each on the budget: the lowest KL kept
    r, chosen, scores = sparsify_mod.choose_allocation(smollm2_path, read_corpus([corpus]), counts, lo, hi, nbytes, 0.4, w,
                                                       progress=False)
    assert "measured" in scores and "energy" in scores and chosen == min(scores, key=scores.get)
    assert all(v > 0 for v in scores.values())
    assert (r * nbytes).sum() / nbytes[:-1].sum() == pytest.approx(0.4)
    assert ((r == 0) | (r >= sparsify_mod.S_MIN - 1e-9)).all()
    if chosen.endswith("output matrix dense"):
        assert r[-1, 0] == 0
    # the runtime thresholds: only where a column copy exists, finite and >= 0
    with Model(smollm2_path, sparse_mode="input", sparse_threshold=0.0) as m, Context(m, n_ctx=64, n_threads=2) as c:
        c.set_input_threshold(0, 0, 0.5)
        c.set_input_threshold(n_layer, 0, 0.5)  # the output matrix
        for bad in ((n_layer, 1, 0.1), (n_layer + 1, 0, 0.1), (-1, 0, 0.1), (0, 4, 0.1), (0, 0, -1.0), (0, 0, float("nan")),
                    (0, 0, float("inf"))):
            with pytest.raises(Exception, match="threshold|range"):
                c.set_input_threshold(*bad)
    with Model(smollm2_path, sparse_mode="dense") as m, Context(m, n_ctx=64, n_threads=2) as c:
        with pytest.raises(Exception, match="column copy"):
            c.set_input_threshold(0, 0, 0.1)


def test_output_matrix_alone_against_numpy(smollm2_path, tmp_path):
    # a copy whose layers all run dense and whose output matrix (SmolLM2's tied Q8_0
    # embeddings) runs input-sparse: each token's logits must be the kernel's formula over the
    # file's own blocks (tests/test_input_sparse.py: per block u of 32 columns,
    # y = a_u * dx_u * sum_j (q_j + 128) * q8_j - 128 * a_u * dx_u * sum_j q8_j over the kept j), from
    # the final norm's output of the same step with |x| <= tau dropped, except for the token's
    # POWERINFER_HEAD_EXACT_ROWS largest of those: ggml's dense product over every column
    # (y = sum_u a_u * dx_u * sum_j q_j * q8_j, x quantized to Q8_0 whole, dx as f16); in a batch too,
    # each token by its own rows
    import gguf

    from powerinfer_py._core.bindings import lib
    from powerinfer_py.pipeline.sparsify import write_sparse_model

    reader = gguf.GGUFReader(smollm2_path)
    arch = str(bytes(reader.get_field("general.architecture").parts[-1]), "utf-8")
    n_layer = int(reader.get_field(f"{arch}.block_count").parts[-1][0])
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    assert head.tensor_type == gguf.GGMLQuantizationType.Q8_0  # the formulas below are Q8_0's
    n_vocab, n_in = int(head.shape[1]), int(head.shape[0])
    blocks = np.frombuffer(head.data.tobytes(), dtype=[("d", "<f2"), ("qs", "i1", 32)]).reshape(n_vocab, n_in // 32)
    a = blocks["d"].astype(np.float64)                        # [n_vocab, units]
    qs = blocks["qs"].astype(np.float64)                      # [n_vocab, units, 32]
    k_exact = int(lib.POWERINFER_HEAD_EXACT_ROWS)

    def q8(x):  # float32, as the kernels: q8 = roundf(x * (1 / dx))
        dx = np.abs(x).max(axis=1) / np.float32(127.0)
        v = x * np.where(dx > 0, np.float32(1.0) / np.where(dx > 0, dx, 1), 0).astype(np.float32)[:, None]
        return (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.float64), dx.astype(np.float64)

    def check(y, x, tau):
        x = np.array(x, dtype=np.float32).reshape(-1, 32)
        eps = (n_in // 32 + 2) * np.finfo(np.float32).eps
        kept = np.where(np.abs(x) > np.float32(tau), x, np.float32(0.0))
        qk, dk = q8(kept)
        dot = np.einsum("vuj,uj->vu", qs + 128.0, qk) * a * dk  # [n_vocab, units]
        off = -128.0 * a * (qk.sum(axis=1) * dk)[None, :]
        sparse = (dot + off).sum(axis=1)
        sparse_bound = eps * (np.abs(dot) + np.abs(off)).sum(axis=1) + 1e-6
        qx, dx = q8(x)  # ggml's Q8_0 keeps its scale as f16
        full = np.einsum("vuj,uj->vu", qs, qx) * a * dx.astype(np.float16).astype(np.float64)
        exact, exact_bound = full.sum(axis=1), eps * np.abs(full).sum(axis=1) + 1e-6
        order = np.argsort(-sparse, kind="stable")
        top, rest = order[: k_exact - 2], order[k_exact + 2 :]  # the two either side of the cut may swap on rounding
        assert (np.abs(y[top] - exact[top]) <= exact_bound[top]).all(), float(np.abs(y[top] - exact[top]).max())
        assert (np.abs(y[rest] - sparse[rest]) <= sparse_bound[rest]).all(), float(np.abs(y[rest] - sparse[rest]).max())
        # the exact rows differ from the kept columns' estimate: the test tells them apart
        assert np.abs(exact[top] - sparse[top]).max() > 10 * exact_bound[top].max()

    taus = np.full((n_layer + 1, len(INPUTS)), -1.0, dtype=np.float32)
    taus[-1, 0] = 0.0  # the head's column copy; its threshold is set on the context below
    out = tmp_path / "head.gguf"
    write_sparse_model(smollm2_path, str(out), taus, 0.0, "uniform", progress=False)
    with Model(str(out)) as m, Context(m, n_ctx=64, n_threads=2, embeddings=True) as c:
        assert m.sparse_mode() == "input" and m.input_sparse(n_layer, 0)
        assert not any(m.input_sparse(il, i) for il in range(n_layer) for i in range(len(INPUTS)))
        toks = m.tokenize(TEXT.encode(), True, False)[:14]
        c.decode([toks[0]], 0)  # a sequence's first token runs dense
        tau = float(np.quantile(np.abs(c.embeddings(0)), 0.4))
        c.set_input_threshold(n_layer, 0, tau)
        for pos, t in enumerate(toks[1:10], start=1):
            c.decode([t], pos)
            check(np.array(c.logits(-1), dtype=np.float64), c.embeddings(0)[0], tau)
        n_kept, n_total = c.input_stats(n_layer, 0)
        assert n_total == n_in * 9 and 0.45 < n_kept / n_total < 0.75
        c.decode(toks[10:], 10, logits_all=True)  # a batch of 4: each token its own top rows
        n = len(toks) - 10
        ys, xs = np.array(c.logits(0, n), dtype=np.float64), np.array(c.embeddings(0, n))
        for j in range(n):
            check(ys[j], xs[j], tau)

    # The exact rows are chosen by one op and computed by the next, dealt out to the threads
    # (pi_head_exact_top): the logits must be the same bits at 1, 2 and 3 threads, alone and
    # in a batch of 2 (fewer tokens than threads, as many, more).
    runs = []
    for n_threads in (1, 2, 3):
        with Model(str(out)) as m, Context(m, n_ctx=64, n_threads=n_threads, n_threads_batch=n_threads) as c:
            c.decode([toks[0]], 0)
            c.set_input_threshold(n_layer, 0, tau)
            rows = []
            for pos, t in enumerate(toks[1:6], start=1):
                c.decode([t], pos)
                rows.append(np.array(c.logits(-1), dtype=np.float32))
            c.decode(toks[6:8], 6, logits_all=True)
            rows.append(np.array(c.logits(0, 2), dtype=np.float32).ravel())
            runs.append(rows)
    for rows in runs[1:]:
        for a, b in zip(runs[0], rows):
            assert np.array_equal(a, b)


def test_dense_inputs_keep_the_repacked_layouts(tmp_path, capfd):
    """In input mode a matrix whose input runs dense (a negative threshold) computes as in
    dense mode: in the CPU backend's repacked layout where it has one, up as gate (the two
    share the FFN's input). Until 2026-12-08 up stayed plain there, and such layers ran up
    through ggml's row dot products (the 1.5B's 25% copy decoded 10% slower, its 0% copy 12%).
    The synthetic "small" model is Q4_0, which ggml repacks on x86 and ARM, and a Q4_0 matrix
    keeps its repacked layout beside a column copy (only K-quants stay plain for ggml's tiled
    prompts): with layer 0's q/k/v input sparse and the rest dense, both loads repack every
    matrix."""
    import gguf

    from powerinfer_py._core.bindings import set_log_level
    from powerinfer_py.assets.synthetic import PRESETS, generate
    from powerinfer_py.pipeline.sparsify import write_sparse_model

    src = generate(PRESETS["small"], tmp_path / "m", progress=False)["dense"]
    n_layer = int(gguf.GGUFReader(src).get_field("llama.block_count").parts[-1][0])
    taus = np.full((n_layer + 1, len(INPUTS)), -1.0, dtype=np.float32)
    taus[0, 0] = 0.01
    out = tmp_path / "qkv0.gguf"
    write_sparse_model(src, str(out), taus, 0.0, "uniform", progress=False)
    set_log_level(True)
    try:
        capfd.readouterr()
        counts = []
        for path, kw in ((src, {"sparse_mode": "dense"}), (str(out), {})):
            with Model(path, **kw) as m:
                assert m.sparse_mode() == kw.get("sparse_mode", "input")
            err = capfd.readouterr().err
            line = [ln for ln in err.splitlines() if "repacked into" in ln]
            counts.append(int(line[0].split("powerinfer: ")[1].split()[0]) if line else 0)
    finally:
        set_log_level(False)
    if counts[0] == 0:
        pytest.skip("the CPU backend repacks no Q4_0 weight on this CPU")
    assert counts[1] == counts[0], counts


@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_bench_counts_the_column_kernels_bytes(which, smollm2_path, qwen_path):
    """The bench's ceiling counts what the column copy reads: every matrix's quants (bits per
    weight from the type alone) and its scales, the file's per block (its type size less the
    quants; K-quants' 6-bit sc and mins stay packed)."""
    import gguf

    from powerinfer_py.bench.input_sparse import _column_bytes

    path = smollm2_path if which == "smollm2" else qwen_path
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    n_layer = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("blk."))
    quants, scales = _column_bytes(path, n_layer)
    bits = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
    want_q, want_s = np.zeros_like(quants), np.zeros_like(scales)
    for name, t in tensors.items():
        parts = name.split(".")
        at = (n_layer, 0) if name == ("output.weight" if "output.weight" in tensors else "token_embd.weight") else None
        for i, inp in enumerate(INPUTS):
            if parts[0] == "blk" and ".".join(parts[2:]) in sparsify_mod.INPUT_TENSORS[inp]:
                at = (int(parts[1]), i)
        if at is None:
            continue
        n = int(np.prod([int(x) for x in t.shape]))
        q = n * bits[t.tensor_type.name] / 8
        want_q[at] += q
        want_s[at] += int(t.n_bytes) - q
    assert np.count_nonzero(want_q) > 4 * n_layer  # every layer's four inputs and the head
    np.testing.assert_allclose(quants, want_q)
    np.testing.assert_allclose(scales, want_s)
