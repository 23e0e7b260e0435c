"""The sparse engine end to end on tiny synthetic ReLU models (powerinfer_py.assets.synthetic):
gate and predictor modes against dense, thread-count agreement, PowerInfer-format
round trip, and malformed PWRI files."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from powerinfer_py._core import Context, Model
from powerinfer_py._core.bindings import ffi, lib
from powerinfer_py.assets.synthetic import PRESETS, generate
from powerinfer_py import Llama, kernel_level

ROOT = Path(__file__).resolve().parent.parent
CLI = ROOT / "build" / "bin" / "main"
MODES = {"dense": lib.POWERINFER_SPARSE_DENSE, "gate": lib.POWERINFER_SPARSE_GATE,
         "predictor": lib.POWERINFER_SPARSE_PREDICTOR, "auto": lib.POWERINFER_SPARSE_AUTO}
PROMPT = b"the cat sat on the mat and"
N_GEN = 24


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    return {name: generate(PRESETS[name], out, progress=False) for name in ("tiny", "tiny-q8")}


def _error() -> str:
    return ffi.string(lib.powerinfer_last_error()).decode()


class Engine:
    """Just enough of the C API to decode greedily and read logits and stats."""

    def __init__(self, path, mode="auto", threads=2, threshold=float("nan")):
        mp = lib.powerinfer_model_default_params()
        mp.sparse_mode = MODES[mode]
        mp.sparse_threshold = threshold
        self.model = lib.powerinfer_model_load(str(path).encode(), mp)
        if self.model == ffi.NULL:
            raise ValueError(_error())
        cp = lib.powerinfer_context_default_params()
        cp.n_threads = threads
        cp.n_ctx = 256
        self.ctx = lib.powerinfer_context_new(self.model, cp)
        assert self.ctx != ffi.NULL, _error()
        self.n_vocab = lib.powerinfer_model_n_vocab(self.model)

    def close(self):
        lib.powerinfer_context_free(self.ctx)
        lib.powerinfer_model_free(self.model)

    def mode(self) -> str:
        return ffi.string(lib.powerinfer_sparse_mode_name(lib.powerinfer_model_sparse_mode(self.model))).decode()

    def _logits(self):
        return np.frombuffer(ffi.buffer(lib.powerinfer_get_logits_ith(self.ctx, -1), self.n_vocab * 4), dtype=np.float32).copy()

    def greedy(self, prompt=PROMPT, n=N_GEN, one_by_one=True):
        """Greedy tokens and the logits each was chosen from. Tokens go in one at a
        time (the sparse path) unless one_by_one is False."""
        buf = ffi.new("int32_t[]", 256)
        n_tok = lib.powerinfer_tokenize(self.model, prompt, len(prompt), buf, 256, True, False)
        toks = list(buf[0:n_tok])
        if one_by_one:
            for pos, t in enumerate(toks):
                assert lib.powerinfer_decode(self.ctx, ffi.new("int32_t[]", [t]), 1, pos, False) == 0, _error()
        else:
            assert lib.powerinfer_decode(self.ctx, ffi.new("int32_t[]", toks), len(toks), 0, False) == 0, _error()
        out, logits = [], []
        for _ in range(n):
            lg = self._logits()
            t = int(np.argmax(lg))
            out.append(t)
            logits.append(lg)
            assert lib.powerinfer_decode(self.ctx, ffi.new("int32_t[]", [t]), 1, len(toks) + len(out) - 1, False) == 0
        return out, np.array(logits)

    def logits_along(self, tokens, count_from=0):
        """Logits after each of tokens, decoded one at a time (the sparse path from the
        second token on). The active-neuron counters start at position COUNT_FROM."""
        out = []
        for pos, t in enumerate(tokens):
            if pos == count_from:
                lib.powerinfer_reset_timings(self.ctx)
            assert lib.powerinfer_decode(self.ctx, ffi.new("int32_t[]", [t]), 1, pos, False) == 0, _error()
            out.append(self._logits())
        return np.array(out)

    def active_fraction(self):
        a, b = ffi.new("int64_t*"), ffi.new("int64_t*")
        fr = []
        for il in range(lib.powerinfer_model_n_layer(self.model)):
            assert lib.powerinfer_sparse_stats(self.ctx, il, a, b) == 0
            fr.append(a[0] / max(b[0], 1))
        return np.array(fr)


def _run(path, mode, **kw):
    e = Engine(path, mode, **kw)
    try:
        toks, logits = e.greedy()
        return toks, logits, e.active_fraction(), e.mode()
    finally:
        e.close()


# Logit tolerance, relative to the largest logit. F32 weights: the sparse and dense
# paths differ only in float32 summation order (~n * eps). Q8_0 weights: activations
# are rounded to 8 bits (step 1/127 of a block's max) before every dot product, and a
# different summation order can flip a rounding, so allow two such steps.
TOL = {"tiny": 1e-4, "tiny-q8": 2.0 / 127}


@pytest.mark.parametrize("name", ["tiny", "tiny-q8"])
@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_modes_match_dense(tiny, name, mode):
    path = tiny[name]["powerinfer"]
    d_toks, d_logits, _, d_mode = _run(path, "dense")
    s_toks, s_logits, frac, s_mode = _run(path, mode)
    assert (d_mode, s_mode) == ("dense", mode)
    assert s_toks == d_toks
    scale = np.abs(d_logits).max()
    assert np.abs(s_logits - d_logits).max() <= TOL[name] * scale
    # The planted sparsity is real: about 10% of neurons fire (power law, capped at 95%).
    assert np.all((frac > 0.03) & (frac < 0.3)), frac


def test_auto_mode_picks_predictor_for_powerinfer_files_and_gate_needs_down_t(tiny):
    e = Engine(tiny["tiny"]["powerinfer"], "auto")
    assert e.mode() == "predictor"
    e.close()
    e = Engine(tiny["tiny"]["dense"], "auto")  # standard twin: no ffn_down_t, no predictor
    assert e.mode() == "dense"
    e.close()
    with pytest.raises(ValueError, match="ffn_down_t"):
        Engine(tiny["tiny"]["dense"], "gate")
    with pytest.raises(ValueError, match="predictor"):
        Engine(tiny["tiny"]["dense"], "predictor")


def test_standard_twin_matches_powerinfer_file_in_dense_mode(tiny):
    """Same weights, down stored as ffn_down (mul_mat) vs ffn_down_t (AXPY)."""
    a_toks, a_logits, _, _ = _run(tiny["tiny"]["dense"], "dense")
    b_toks, b_logits, _, _ = _run(tiny["tiny"]["powerinfer"], "dense")
    assert a_toks == b_toks
    assert np.abs(a_logits - b_logits).max() <= TOL["tiny"] * np.abs(a_logits).max()


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_thread_counts_agree(tiny, mode):
    results = [_run(tiny["tiny-q8"]["powerinfer"], mode, threads=t) for t in (1, 2, 3)]
    for toks, logits, _, _ in results[1:]:
        assert toks == results[0][0]
        assert np.array_equal(logits, results[0][1])


def test_threshold_trades_sparsity(tiny):
    """A higher predictor threshold activates fewer neurons; the override works."""
    _, _, base, _ = _run(tiny["tiny"]["powerinfer"], "predictor")
    _, _, high, _ = _run(tiny["tiny"]["powerinfer"], "predictor", threshold=5.0)
    assert high.mean() < base.mean()


def test_batched_prompt_matches_token_by_token(tiny):
    e = Engine(tiny["tiny"]["powerinfer"], "predictor")
    a, _ = e.greedy(one_by_one=True)
    e.close()
    e = Engine(tiny["tiny"]["powerinfer"], "predictor")
    b, _ = e.greedy(one_by_one=False)
    e.close()
    assert a == b


# ---- PowerInfer-format round trip ------------------------------------------------------


def test_powerinfer_file_round_trip(tiny, tmp_path):
    """The PWRI file as the gguf package reads it (standard magic) and as the engine does:
    its metadata, and predictor mode against tests/numpy_llama.py's forward pass of the
    file's own tensors with the FFN masked to what its predictor (fc1, fc2, threshold)
    selects, neuron for neuron."""
    import gguf

    from numpy_llama import forward, read_f32_model

    path = Path(tiny["tiny"]["powerinfer"])
    assert path.read_bytes()[:4] == b"PWRI"
    # The same bytes with the standard magic are readable by the gguf package.
    copy = tmp_path / "as-gguf.gguf"
    shutil.copy(path, copy)
    with open(copy, "r+b") as f:
        f.write(b"GGUF")
    reader = gguf.GGUFReader(str(copy))
    names = {t.name for t in reader.tensors}
    assert {"blk.0.ffn_down_t.weight", "blk.0.fc1.weight", "blk.0.fc2.weight"} <= names
    assert "blk.0.ffn_down.weight" not in names
    threshold = float(reader.fields["powerinfer.sparse_threshold"].contents())

    e = Engine(path, "predictor")
    try:
        buf = ffi.new("char[]", 256)
        n = lib.powerinfer_model_meta_val_str(e.model, b"powerinfer.ffn_activation", buf, 256)
        assert ffi.string(buf, n) == b"relu"
        assert lib.powerinfer_model_meta_val_str(e.model, b"general.architecture", buf, 256) > 0
        assert ffi.string(buf) == b"llama"
        assert lib.powerinfer_model_sparse_threshold(e.model, 0) == threshold == 0.0
        assert ffi.string(lib.powerinfer_model_ffn_activation(e.model)) == b"relu"
        assert e.mode() == "predictor"
        ids = ffi.new("int32_t[]", 64)
        prompt = list(ids[0 : lib.powerinfer_tokenize(e.model, PROMPT, len(PROMPT), ids, 64, True, False)])
        toks, logits = e.greedy(n=8)  # every token decoded alone: the sparse path
        a, c, counts = ffi.new("int64_t*"), ffi.new("int64_t*"), []
        for il in range(PRESETS["tiny"].n_layer):
            assert lib.powerinfer_sparse_stats(e.ctx, il, a, c) == 0
            counts.append((a[0], c[0]))
    finally:
        e.close()

    tensors, hp = read_f32_model(path, tmp_path)
    margins, expected = [], []

    def predicted(il, x_res):
        logit = np.maximum(x_res @ tensors[f"blk.{il}.fc1.weight"].T, 0) @ tensors[f"blk.{il}.fc2.weight"].T
        margins.append(np.abs(logit - threshold).min())
        mask = logit >= threshold
        expected.append((int(mask[1:].sum()), mask[1:].size))  # position 0 is a dense step: not counted
        return mask.astype(np.float64)

    seq = prompt + toks  # greedy() decoded all of them, one at a time
    ref = forward(tensors, hp, seq, predicted)[len(prompt) - 1 : -1]
    scale = np.abs(ref).max()
    err = np.abs(logits - ref).max()
    assert err <= TOL["tiny"] * scale, f"max |logit - reference| {err:.3g}, {err / scale:.3g} of the largest"
    for i, (t, r) in enumerate(zip(toks, ref)):  # greedy on the reference but for a near-tie
        assert r[t] >= r.max() - 2 * TOL["tiny"] * scale, (i, t)
    # Neuron for neuron: the engine computed exactly what the predictor selects, no more
    # (a neuron selected without firing changes no logit), no fewer; no predictor logit of
    # the reference lies within float32 reach of the threshold. About 10% fire (planted).
    assert min(margins) > 1e-5, min(margins)
    assert counts == expected
    assert all(0.03 < active / total < 0.3 for active, total in counts), counts
    # and decodes like its standard twin (the planted predictor is exact)
    assert toks == _tokens(tiny["tiny"]["dense"], n=8)


def test_dense_mode_ignores_thresholds(tiny):
    """Dense computes every neuron: a threshold (here absurdly high; FATReLU models carry
    per-layer gate thresholds) must not drop any (the down projection's AXPY over
    ffn_down_t skips only exact zeros)."""
    path = tiny["tiny"]["powerinfer"]
    _, plain, _, _ = _run(path, "dense")
    _, high, _, mode = _run(path, "dense", threshold=1e3)
    assert mode == "dense"
    assert np.array_equal(plain, high)


def _with_fc2(path, tmp_path, make_fc2):
    """A copy of the F32 PWRI file at `path` whose blk.N.fc2.weight is make_fc2(layer, shape)."""
    import gguf

    data = bytearray(Path(path).read_bytes())
    view = bytearray(data)
    view[:4] = b"GGUF"
    probe = tmp_path / "probe.gguf"
    probe.write_bytes(bytes(view))
    for t in gguf.GGUFReader(str(probe)).tensors:
        m = re.fullmatch(r"blk\.(\d+)\.fc2\.weight", t.name)
        if m:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            new = np.ascontiguousarray(make_fc2(int(m.group(1)), t.data.shape), dtype=np.float32).tobytes()
            assert len(new) == t.n_bytes
            data[t.data_offset:t.data_offset + t.n_bytes] = new
    out = tmp_path / "fc2.powerinfer.gguf"
    out.write_bytes(bytes(data))
    return out


def _tokens(engine_path, n=20):
    e = Engine(engine_path, "dense")
    try:
        toks, _ = e.greedy(n=n)
    finally:
        e.close()
    return toks


def test_numpy_reference_matches_dense(tiny, tmp_path):
    """The numpy reference (tests/numpy_llama.py) against the engine's dense mode, so the
    predictor tests below compare with something checked."""
    from numpy_llama import forward, read_f32_model

    path = tiny["tiny"]["powerinfer"]
    tokens = _tokens(path)
    ref = forward(*read_f32_model(path, tmp_path), tokens)
    e = Engine(path, "dense")
    got = e.logits_along(tokens)
    e.close()
    assert np.abs(got - ref).max() <= TOL["tiny"] * np.abs(ref).max()


def test_wrong_predictor_matches_masked_reference(tiny, tmp_path):
    """A predictor that is wrong on purpose: fc2 row i = s_i * ones with random signs s_i, so
    neuron i is predicted active (logit = s_i * sum(relu(fc1 . x)) >= 0) for every token
    when s_i = +1 and never otherwise, whatever it would really do. Predictor mode must
    equal the model with exactly that mask on its FFN, not the dense model, from the
    second token on: a sequence's first token takes every neuron."""
    from numpy_llama import forward, read_f32_model

    rng = np.random.default_rng(5)
    n_ff = PRESETS["tiny"].n_ff
    signs = {il: np.where(rng.random(n_ff) < 0.4, 1.0, -1.0) for il in range(PRESETS["tiny"].n_layer)}
    path = _with_fc2(tiny["tiny"]["powerinfer"], tmp_path, lambda il, shape: signs[il][:, None] * np.ones(shape))
    tensors, hp = read_f32_model(path, tmp_path)
    tokens = _tokens(tiny["tiny"]["powerinfer"])
    def mask(il, x_res):
        m = np.tile((signs[il] > 0).astype(np.float64), (len(x_res), 1))
        m[0] = 1.0  # position 0: dense
        return m

    masked = forward(tensors, hp, tokens, mask)
    dense = forward(tensors, hp, tokens)
    e = Engine(path, "predictor")
    got = e.logits_along(tokens, count_from=1)  # the mask's share, over the sparse steps
    frac = e.active_fraction()
    e.close()
    scale = np.abs(masked).max()
    assert np.abs(got - masked).max() <= TOL["tiny"] * scale
    assert np.abs(dense - masked).max() > 100 * TOL["tiny"] * scale  # the mask matters
    assert np.abs(got[0] - dense[0]).max() <= TOL["tiny"] * scale  # the first token is dense
    np.testing.assert_allclose(frac, [np.mean(signs[il] > 0) for il in sorted(signs)])


def test_predictor_ties_are_computed(tiny, tmp_path):
    """PowerInfer skips a neuron iff its logit < threshold, so a logit equal to it is
    computed. fc2 = 0 makes every logit exactly 0, the file's threshold: every neuron is
    active and predictor mode equals dense."""
    path = _with_fc2(tiny["tiny"]["powerinfer"], tmp_path, lambda il, shape: np.zeros(shape))
    tokens = _tokens(tiny["tiny"]["powerinfer"])
    e = Engine(path, "dense")
    dense = e.logits_along(tokens)
    e.close()
    e = Engine(path, "predictor")
    got = e.logits_along(tokens, count_from=1)
    frac = e.active_fraction()
    e.close()
    assert np.all(frac == 1.0), frac
    assert np.abs(got - dense).max() <= TOL["tiny"] * np.abs(dense).max()


def test_env_threshold_overrides_file(tiny, monkeypatch):
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "1.5")
    e = Engine(tiny["tiny"]["powerinfer"], "predictor")
    assert lib.powerinfer_model_sparse_threshold(e.model, 1) == 1.5
    e.close()
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "abc")
    with pytest.raises(ValueError, match="LLAMA_SPARSE_PRED_THRESHOLD"):
        Engine(tiny["tiny"]["powerinfer"], "predictor")


# ---- malformed PWRI files ----------------------------------------------------------------


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_str(key, val):
    return _s(key) + struct.pack("<I", 8) + _s(val)


def _tensor_info(name, dims, ggml_type=0, offset=0):
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset)


def _pwri(kvs=(), infos=(), n_kv=None, n_tensors=None, version=3, data=b"", magic=b"PWRI"):
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % 32)
    return body + data


ARCH = _kv_str("general.architecture", "llama")
MALFORMED = {
    "bad version": (_pwri([ARCH], version=2), "version"),
    "truncated header": (_pwri([ARCH])[:12], "truncated"),
    "huge key count": (_pwri([ARCH], n_kv=1 << 40), "implausible"),
    "key count past the end": (_pwri([ARCH], n_kv=5), "key is empty|truncated"),
    "empty key": (_pwri([_kv_str("", "x")]), "key is empty"),
    "bad alignment": (_pwri([_s("general.alignment") + struct.pack("<II", 4, 24)]), "power of two"),
    "alignment of the wrong type": (_pwri([_kv_str("general.alignment", "32")]), "bad type"),
    "bad value type": (_pwri([_s("a.b") + struct.pack("<I", 99)]), "bad type"),
    "duplicate key": (_pwri([ARCH, ARCH]), "twice"),
    "nested array": (_pwri([_s("a.b") + struct.pack("<IIQ", 9, 9, 1)]), "not supported"),
    "array longer than file": (_pwri([_s("a.b") + struct.pack("<IIQ", 9, 6, 1 << 40)]), "longer than the file"),
    "string longer than file": (_pwri([_s("a.b") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 50)]), "truncated"),
    "zero dimensions": (_pwri([ARCH], [_tensor_info("t", [])]), "dimensions"),
    "five dimensions": (_pwri([ARCH], [_tensor_info("t", [1, 1, 1, 1, 1])]), "dimensions"),
    "overflowing shape": (_pwri([ARCH], [_tensor_info("t", [1 << 40, 1 << 40])]), "overflowing"),
    "unknown tensor type": (_pwri([ARCH], [_tensor_info("t", [32], ggml_type=200)]), "unknown type"),
    "duplicate tensor": (_pwri([ARCH], [_tensor_info("t", [4]), _tensor_info("t", [4], offset=32)], data=b"\0" * 64), "twice"),
    "misaligned offset": (_pwri([ARCH], [_tensor_info("t", [4], offset=3)], data=b"\0" * 64), "aligned"),
    "data past the end": (_pwri([ARCH], [_tensor_info("t", [1024])], data=b"\0" * 64), "truncated"),
    "long tensor name": (_pwri([ARCH], [_tensor_info("x" * 80, [4])]), "longer than"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_powerinfer_files(tmp_path, case):
    blob, pattern = MALFORMED[case]
    path = tmp_path / "bad.powerinfer.gguf"
    path.write_bytes(blob)
    with pytest.raises(ValueError, match=pattern):
        Engine(path)
    if CLI.exists():
        r = subprocess.run([str(CLI), "-m", str(path), "-p", "x", "-n", "1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and re.search(pattern, r.stderr), r.stderr


def test_malformed_sparse_tensors(tiny, tmp_path):
    """Well-formed PWRI layout, wrong predictor pieces: caught by the model's checks."""
    import gguf

    src = Path(tiny["tiny"]["powerinfer"])
    copy = tmp_path / "gguf-view.gguf"
    shutil.copy(src, copy)
    with open(copy, "r+b") as f:
        f.write(b"GGUF")
    reader = gguf.GGUFReader(str(copy))
    names = [t.name for t in reader.tensors]
    # Rename blk.1.fc2.weight (same length name) so layer 1 has fc1 without fc2.
    blob = bytearray(src.read_bytes())
    i = blob.find(b"blk.1.fc2.weight")
    assert i > 0 and "blk.1.fc2.weight" in names
    blob[i : i + len(b"blk.1.fc2.weight")] = b"blk.1.fcX.weight"
    bad = tmp_path / "half-predictor.powerinfer.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="only one of blk.1.fc1.weight and blk.1.fc2.weight"):
        Engine(bad)


def _retyped(src, dst, name, ggml_type):
    """A copy of src whose tensor `name` claims ggml_type in its header (data untouched)."""
    blob = bytearray(Path(src).read_bytes())
    i = blob.find(_s(name))
    assert i > 0, name
    j = i + len(_s(name))
    (n_dims,) = struct.unpack_from("<I", blob, j)
    struct.pack_into("<I", blob, j + 4 + 8 * n_dims, ggml_type)
    Path(dst).write_bytes(bytes(blob))
    return dst


I32, Q8_0 = 26, 8


@pytest.mark.parametrize("name,ggml_type,mode", [
    ("blk.0.ffn_up.weight", I32, "predictor"),      # the sparse rows: no vec_dot for I32
    ("blk.1.ffn_down_t.weight", I32, "dense"),
    ("blk.0.fc2.weight", I32, "predictor"),
    ("blk.1.attn_q.weight", I32, "dense"),
    ("token_embd.weight", I32, "dense"),
    ("blk.0.ffn_norm.weight", Q8_0, "dense"),       # norms and biases are F32 only
    ("output_norm.weight", Q8_0, "dense"),
])  # fmt: skip
def test_unsupported_tensor_types(tiny, tmp_path, name, ggml_type, mode):
    """A tensor of a type its operation cannot run gets a clear error at load, never a
    crash in a kernel (run in a child process, so a crash fails only this test)."""
    bad = _retyped(tiny["tiny"]["powerinfer"], tmp_path / "retyped.powerinfer.gguf", name, ggml_type)
    code = (
        "import sys\n"
        "from powerinfer_py import Llama\n"
        "try:\n"
        f"    llm = Llama({str(bad)!r}, n_ctx=64, n_threads=2, verbose=False, sparse_mode={mode!r}, fallback=False)\n"
        "    llm.create_completion('the cat', max_tokens=2, temperature=0)\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e); sys.exit(0)\n"
        "print('loaded'); sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    assert name in r.stdout and "type" in r.stdout, r.stdout


def test_python_llama_runs_sparse_modes(tiny):
    path = tiny["tiny"]["powerinfer"]
    texts = {}
    for mode in ("dense", "gate", "predictor", "auto"):
        with Llama(path, n_ctx=256, n_threads=2, verbose=False, sparse_mode=mode) as llm:
            assert llm.sparse_mode_in_use() == ("predictor" if mode == "auto" else mode)
            texts[mode] = llm.create_completion("the cat", max_tokens=16, temperature=0)["choices"][0]["text"]
    assert len(set(texts.values())) == 1, texts
    with pytest.raises(ValueError, match="ffn_down_t"):
        Llama(tiny["tiny"]["dense"], verbose=False, sparse_mode="gate", fallback=False)
    with pytest.raises(ValueError, match="sparse_mode"):
        Llama(path, verbose=False, sparse_mode="fast")


def test_sparse_stats_reports_the_active_share(tiny):
    """Llama.sparse_stats(): per-layer active share of the sparse steps since the last reset,
    the same figure as the C counters; None before any sparse step and in dense mode."""
    path = tiny["tiny-q8"]["powerinfer"]
    with Llama(path, n_ctx=256, n_threads=2, verbose=False, sparse_mode="predictor") as llm:
        assert llm.sparse_stats()["active"] is None
        llm.create_completion("the cat sat", max_tokens=8, temperature=0)
        stats = llm.sparse_stats()
        assert stats["mode"] == "predictor" and len(stats["layers"]) == 3
        assert all(0.0 < a < 1.0 for a in stats["layers"])
        counts = [llm._ctx.sparse_stats(il) for il in range(3)]
        assert stats["active"] == pytest.approx(sum(a for a, _ in counts) / sum(n for _, n in counts))
        llm.reset_timings()
        assert llm.sparse_stats()["active"] is None
    with Llama(tiny["tiny-q8"]["dense"], n_ctx=256, n_threads=2, verbose=False, sparse_mode="dense") as llm:
        llm.create_completion("the cat sat", max_tokens=4, temperature=0)
        assert llm.sparse_stats() == {"mode": "dense", "layers": [None] * 3, "active": None, "kernels": kernel_level(),
                                      "counts": [(0, 0)] * 3}


LONG_PROMPT = b"the cat sat on the mat and the dog sat on the log, then the bird sang in the tree by the old"


def test_sparse_stats_count_only_sparse_steps(tiny, tmp_path):
    """Issue 28, item 11: the counters count the sparse steps only. A prompt in batches above
    sparse_max_batch runs dense, its last layer's output row included (that row took the
    sparse path, and a dense step's AXPY over ffn_down_t counted its nonzero activations:
    `[None, 1.0]`-like figures after a prompt alone, and short runs overstated the share).
    After the prompt no layer has counted anything; after N decode steps each layer's count
    is, neuron for neuron, what the numpy reference's predictor selects at those N positions
    (the planted predictor is exact, so that is also the share that fires)."""
    from numpy_llama import forward, read_f32_model

    path = tiny["tiny"]["powerinfer"]
    n_layer, n_ff, n_gen = PRESETS["tiny"].n_layer, PRESETS["tiny"].n_ff, 8
    e = Engine(path, "predictor")
    try:
        buf = ffi.new("int32_t[]", 256)
        prompt = list(buf[0 : lib.powerinfer_tokenize(e.model, LONG_PROMPT, len(LONG_PROMPT), buf, 256, True, False)])
        # two chunks above sparse_max_batch (8): the first holds position 0, the second not
        assert len(prompt) >= 24
        for p0, p1 in ((0, 12), (12, len(prompt))):
            assert lib.powerinfer_decode(e.ctx, ffi.new("int32_t[]", prompt[p0:p1]), p1 - p0, p0, False) == 0, _error()
        a, c = ffi.new("int64_t*"), ffi.new("int64_t*")

        def counts():
            out = []
            for il in range(n_layer):
                assert lib.powerinfer_sparse_stats(e.ctx, il, a, c) == 0
                out.append((a[0], c[0]))
            return out

        assert counts() == [(0, 0)] * n_layer
        gen = []
        for _ in range(n_gen):
            gen.append(int(np.argmax(e._logits())))
            assert lib.powerinfer_decode(e.ctx, ffi.new("int32_t[]", gen[-1:]), 1, len(prompt) + len(gen) - 1, False) == 0
        got = counts()
        thresholds = [lib.powerinfer_model_sparse_threshold(e.model, il) for il in range(n_layer)]
    finally:
        e.close()

    tensors, hp = read_f32_model(path, tmp_path)
    margins, expected = [], []

    def predicted(il, x_res):
        logit = np.maximum(x_res @ tensors[f"blk.{il}.fc1.weight"].T, 0) @ tensors[f"blk.{il}.fc2.weight"].T
        decode = logit[len(prompt):]
        margins.append(np.abs(decode - thresholds[il]).min())
        expected.append((int((decode >= thresholds[il]).sum()), decode.size))
        return np.ones_like(logit)  # the prompt runs dense; the decoded rows' mask changes nothing (exact)

    forward(tensors, hp, prompt + gen, predicted)
    assert min(margins) > 1e-5, min(margins)
    assert got == expected and all(t == n_gen * n_ff for _, t in got), (got, expected)
    assert all(0.03 < act / tot < 0.3 for act, tot in got), got


def test_llama_sparse_stats_after_a_prompt_alone(tiny):
    """Llama.sparse_stats() and the CLI's "sparse FFN" line after a prompt and no decode step:
    no sparse step ran, so no layer has a share (the CLI prints no such line); after decode
    steps the CLI's share is the counters' share of the same steps."""
    path = tiny["tiny"]["powerinfer"]
    with Llama(path, n_ctx=256, n_threads=2, verbose=False, sparse_mode="predictor") as llm:
        toks = llm.tokenize(LONG_PROMPT)
        llm.eval(toks[:16])
        llm.eval(toks[16:])  # a chunk without position 0, above sparse_max_batch
        assert llm.sparse_stats() == {"mode": "predictor", "layers": [None] * 2, "active": None, "kernels": kernel_level(),
                                      "counts": [(0, 0)] * 2}
        for t in toks[:5]:
            llm.eval([t])
        counts = [llm._ctx.sparse_stats(il) for il in range(2)]
        assert all(tot == 5 * PRESETS["tiny"].n_ff for _, tot in counts)
        assert llm.sparse_stats()["layers"] == [act / tot for act, tot in counts]
        assert llm.sparse_stats()["counts"] == counts  # what the shares are of (the server's page adds them up)
    if not CLI.exists():
        pytest.skip("no build/bin/main")
    cmd = [str(CLI), "-m", str(path), "-p", LONG_PROMPT.decode(), "--temp", "0", "-t", "2"]
    run = dict(capture_output=True, encoding="utf-8", errors="replace", timeout=60)  # the tokens are bytes
    r = subprocess.run(cmd + ["-n", "0"], **run)
    assert r.returncode == 0 and "sparse mode = predictor" in r.stderr and "sparse FFN" not in r.stderr, r.stderr
    r = subprocess.run(cmd + ["-n", "6"], **run)
    m = re.search(r"sparse FFN  = ([\d.]+)% of neurons active \(per layer, %: (\d+) (\d+)\)", r.stderr)
    assert r.returncode == 0 and m, r.stderr
    # the same run through the engine: the prompt in one batch, then the greedy tokens alone
    e = Engine(path, "predictor")
    try:
        e.greedy(LONG_PROMPT, n=6, one_by_one=False)
        frac = e.active_fraction()
    finally:
        e.close()
    assert abs(float(m.group(1)) - 100 * frac.mean()) < 0.051, (m.group(0), frac)
    assert [int(m.group(2)), int(m.group(3))] == [round(100 * f) for f in frac]


def test_bench_bytes_per_token(tiny):
    """The benchmark's ideal: the dense read counts every weight but the embeddings; a
    sparse mode counts only the active share of the rows it skips."""
    import gguf

    from powerinfer_py.bench import sparse as bench_sparse

    paths = tiny["tiny-q8"]
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(paths["dense"]).tensors}
    dense = bench_sparse.weights_read_per_token(lambda n: sizes.get(n, -1), 3, None, [1.0] * 3)
    assert dense == sum(v for k, v in sizes.items() if k != "token_embd.weight")
    with Llama(paths["powerinfer"], verbose=False, sparse_mode="predictor") as llm:
        nb = llm._model.tensor_nbytes
        full = bench_sparse.weights_read_per_token(nb, 3, "predictor", [1.0] * 3)
        none = bench_sparse.weights_read_per_token(nb, 3, "predictor", [0.0] * 3)
        ffn = sum(nb(f"blk.{il}.{k}.weight") for il in range(3) for k in ("ffn_gate", "ffn_up", "ffn_down_t"))
        assert full - none == ffn
        half = bench_sparse.weights_read_per_token(nb, 3, "predictor", [0.5] * 3)
        assert half == pytest.approx(none + ffn / 2)


def test_bench_sparse_runs_interleaved(tiny, capsys):
    """`python -m powerinfer_py.bench sparse` end to end on a tiny pair: every mode's decode
    row with its ideal and fraction of it, prompt rows, peak RSS rows."""
    from powerinfer_py.bench import sparse as bench_sparse

    paths = tiny["tiny-q8"]
    rc = bench_sparse.main(["--dense", paths["dense"], "--powerinfer", paths["powerinfer"], "--n-gen", "4",
                            "--prompts", "8,32", "--prompt-reps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "CPU: " in out and "measured read bandwidth" in out
    for mode in ("dense", "gate", "predictor"):
        assert f"| {mode} |" in out
    assert len(re.findall(r"\d+\.\d\dx \|", out)) == 3 * 2 + 2 * 2  # decode ideal and achieved, prompt ratios
    assert "| llama-cpp-python |" in out and "| powerinfer predictor |" in out


def test_synthetic_generator_parameters(tmp_path):
    """The generator's knobs (firing law, predictor rank and type) reach the files, and the
    noisier, larger predictor still runs: a second, differently made model for the benchmarks."""
    import json
    from dataclasses import replace

    from powerinfer_py.formats.gguf_io import open_gguf

    spec = replace(PRESETS["tiny-q8"], name="tiny-b", pred_rank=128, pred_type="Q4_0", power=1.5, active_frac=0.06, seed=3)
    paths = generate(spec, tmp_path, progress=False)
    tensors = {t.name: t for t in open_gguf(paths["powerinfer"]).tensors}
    assert tensors["blk.0.fc1.weight"].tensor_type.name == "Q4_0"
    assert [int(x) for x in tensors["blk.0.fc1.weight"].shape] == [128, 128]  # ggml order: [n_embd, rank]
    assert [int(x) for x in tensors["blk.0.fc2.weight"].shape] == [128, 384]  # [rank, n_ff]
    planted = json.loads(open(paths["stats"]).read())["layers"]
    assert all(abs(layer["planted_active_frac"] - 0.06) < 0.005 for layer in planted)
    with Llama(paths["powerinfer"], n_ctx=128, n_threads=2, verbose=False, sparse_mode="predictor") as llm:
        llm.create_completion("the cat sat on", max_tokens=8, temperature=0)
        assert 0.0 < llm.sparse_stats()["active"] < 0.3
    with pytest.raises(ValueError, match="pred_rank"):
        generate(replace(spec, pred_rank=40), tmp_path / "bad", progress=False)


def test_sparse_steps_on_short_lived_threads_do_not_leak(tmp_path):
    """Issue 12, defect 8: the sparse operators kept a dequantization buffer per thread in a
    thread-local pointer that was never freed, so every thread that ran a sparse step and
    then ended (a Python thread calling decode: it takes part in the compute) leaked it.
    glibc's own count of bytes in use (mallinfo2) over 200 such threads: the old library
    grew by about 2 KB per thread on this model (n_embd 256), now it does not grow."""
    import ctypes
    import threading

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc without mallinfo2 (< 2.33)")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc.mallinfo2.restype = MallInfo2

    def in_use() -> int:
        mi = libc.mallinfo2()
        return mi.uordblks + mi.hblkhd

    paths = generate(PRESETS["small"], tmp_path / "m", progress=False)
    with Model(paths["powerinfer"], sparse_mode="predictor") as model, \
            Context(model, n_ctx=64, n_threads=2, n_threads_batch=2) as ctx:
        def step():
            ctx.kv_truncate(0)
            ctx.decode([5], 0)

        def on_new_threads(n):
            for _ in range(n):
                t = threading.Thread(target=step)
                t.start()
                t.join()

        on_new_threads(20)  # warm-up: caches, the Python thread machinery
        before = in_use()
        on_new_threads(200)
        grown = in_use() - before
    assert grown < 200 * 64, f"{grown} bytes still allocated after 200 short-lived threads ran a sparse step"


def _down_paths(e: "Engine"):
    share = ffi.new("float*")
    out = []
    for il in range(lib.powerinfer_model_n_layer(e.model)):
        path = lib.powerinfer_down_path(e.ctx, il, share)
        assert path in (0, 1), _error()
        out.append((path, share[0]))
    return out


def test_dense_mode_down_path_follows_the_nonzero_share(tiny, tmp_path, monkeypatch):
    """Dense mode on a PowerInfer file (ffn_down_t only) computes a token's down projection
    as an AXPY over the rows of nonzero activations while most are zero, and through the
    matmul over the batch copy once they are not (issue 28, item 10: every neuron firing
    made dense mode 0.79x llama.cpp's). Each layer follows its measured share; the output
    stays within the batch copy's bound of the AXPY's (Q8_0 re-quantized along the other axis)."""
    from dataclasses import replace

    dense_act = generate(replace(PRESETS["tiny-q8"], name="tiny-q8-dense-act", active_frac=0.9), tmp_path,
                         progress=False)["powerinfer"]
    sparse_act = tiny["tiny-q8"]["powerinfer"]
    runs = {}
    for name, path in (("dense", dense_act), ("sparse", sparse_act)):
        for forced in ("axpy", "matmul", None):
            if forced:
                monkeypatch.setenv("POWERINFER_DOWN_PATH", forced)
            else:
                monkeypatch.delenv("POWERINFER_DOWN_PATH", raising=False)
            e = Engine(path, "dense")
            try:
                toks, logits = e.greedy(n=12)
                runs[name, forced] = (toks, logits, _down_paths(e))
            finally:
                e.close()
    # Forced paths are reported as such.
    for name in ("dense", "sparse"):
        assert all(p == 0 for p, _ in runs[name, "axpy"][2])
        assert all(p == 1 for p, _ in runs[name, "matmul"][2])
    # ReLU with 90% of neurons firing: every layer measured above the crossover, on the matmul.
    paths = runs["dense", None][2]
    assert all(p == 1 and s > 0.5 for p, s in paths), paths
    # The usual ReLU sparsity: every layer stays on the AXPY, bit for bit the forced AXPY run.
    paths = runs["sparse", None][2]
    assert all(p == 0 and 0 <= s < 0.4 for p, s in paths), paths
    assert np.array_equal(runs["sparse", None][1], runs["sparse", "axpy"][1])
    # Either path gives the same model: tokens equal, logits within 3% of their scale. The
    # copy re-quantizes the Q8_0 rows to Q8_0 along the other axis (~0.5% RMS per weight) and
    # the matmul rounds h to 8 bits, the AXPY keeps it in f32: measured 1.9% here, as the
    # split tests' bound for 8-bit activation quantization (tests/test_hybrid.py, Q4_0).
    for name in ("dense", "sparse"):
        ref_toks, ref = runs[name, "axpy"][:2]
        for forced in ("matmul", None):
            toks, logits = runs[name, forced][:2]
            assert toks == ref_toks, (name, forced)
            assert np.max(np.abs(logits - ref)) <= 0.03 * np.abs(ref).max(), (name, forced)
    # And the automatic run on the dense file is the matmul's after its first steps: closer
    # to the forced matmul than the AXPY is.
    auto, mm, ax = runs["dense", None][1], runs["dense", "matmul"][1], runs["dense", "axpy"][1]
    assert np.max(np.abs(auto[-4:] - mm[-4:])) < np.max(np.abs(ax[-4:] - mm[-4:]))


_FLIP_SCRIPT = r"""
import sys, json
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_sparse_engine import Engine, _down_paths
e = Engine(sys.argv[2], "dense")
toks, logits = e.greedy(n=60)
np.save(sys.argv[3], logits)
print(json.dumps({"tokens": toks, "paths": _down_paths(e)}))
e.close()
"""


def test_down_path_switch_mid_generation_keeps_the_graph_allocation_valid(tmp_path):
    """A layer whose measured share crosses the threshold during decoding changes the
    graph's leaves (the matmul path builds the active-row index early), while the node
    count and the nodes' sources stay the same. ggml's graph allocator decides whether
    to re-plan from those alone, so the old plan was applied to the new leaf order and
    indexed a weight's buffer id -1: a segfault at the switch (F32 weights, where the
    down path is not packed; a ~55% share makes both layers cross during 60 steps). Run
    in a subprocess so a crash fails this test rather than the suite; the result must be
    the forced AXPY's."""
    import json
    import os
    from dataclasses import replace

    path = generate(replace(PRESETS["tiny"], name="tiny-flip", active_frac=0.55), tmp_path, progress=False)["powerinfer"]
    runs = {}
    for forced in ("axpy", None):
        env = dict(os.environ)
        env.pop("POWERINFER_DOWN_PATH", None)
        if forced:
            env["POWERINFER_DOWN_PATH"] = forced
        npy = tmp_path / f"logits-{forced}.npy"
        p = subprocess.run([sys.executable, "-c", _FLIP_SCRIPT, str(Path(__file__).parent), str(path), str(npy)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, f"forced={forced}: exit {p.returncode}\n{p.stderr[-2000:]}"
        runs[forced] = (json.loads(p.stdout.strip().splitlines()[-1]), np.load(npy))
    auto, ref = runs[None], runs["axpy"]
    # The automatic run did switch: every layer ends on the matmul.
    assert all(p == 1 for p, _ in auto[0]["paths"]), auto[0]["paths"]
    assert auto[0]["tokens"] == ref[0]["tokens"]
    # F32 weights: the paths differ in summation order only.
    assert np.max(np.abs(auto[1] - ref[1])) <= TOL["tiny"] * np.abs(ref[1]).max()
