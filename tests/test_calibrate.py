"""Gate-mode calibration (powerinfer_py.pipeline.calibrate) on a tiny synthetic SiLU model."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest

from powerinfer_py._core.bindings import ffi, lib
from powerinfer_py.pipeline.calibrate import (collect_histograms, evaluate, main, thresholds_for_sparsity,
                                     write_gate_model)
from powerinfer_py.assets.synthetic import PRESETS, generate

TEXT = ("the cat sat on the mat and the dog ran after a ball of red wool; " * 40)


@pytest.fixture(scope="module")
def silu_model(tmp_path_factory):
    spec = dataclasses.replace(PRESETS["tiny"], name="tiny-silu", activation="silu")
    return generate(spec, tmp_path_factory.mktemp("silu"), progress=False)["dense"]


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_thresholds_are_histogram_quantiles():
    counts = np.zeros((1, 12), dtype=np.uint64)
    counts[0, 3] = 50  # half the mass in bin 3, half in bin 9
    counts[0, 9] = 50
    taus = thresholds_for_sparsity(counts, -6.0, 6.0, 0.5)  # bins are one decade wide
    assert 10.0**-3 <= taus[0] <= 10.0**-2
    assert thresholds_for_sparsity(counts, -6.0, 6.0, 0.0)[0] == 0.0
    with pytest.raises(ValueError):
        thresholds_for_sparsity(counts, -6.0, 6.0, 1.0)


@pytest.mark.parametrize("target", [0.4, 0.6])
def test_calibrated_copy_hits_target_sparsity(silu_model, tmp_path, target):
    before = _sha(silu_model)
    counts, lo, hi = collect_histograms(silu_model, [TEXT], n_tokens=512, chunk=128, progress=False)
    assert counts.sum() > 0
    taus = thresholds_for_sparsity(counts, lo, hi, target)
    out = tmp_path / "gate.gguf"
    write_gate_model(silu_model, str(out), taus, progress=False)
    assert _sha(silu_model) == before  # the input is untouched

    mp = lib.powerinfer_model_default_params()
    m = lib.powerinfer_model_load(str(out).encode(), mp)
    assert m != ffi.NULL, ffi.string(lib.powerinfer_last_error())
    assert ffi.string(lib.powerinfer_sparse_mode_name(lib.powerinfer_model_sparse_mode(m))) == b"gate"
    assert np.isclose(lib.powerinfer_model_sparse_threshold(m, 1), taus[1])
    lib.powerinfer_model_free(m)

    # On the calibration text, the skipped fraction is close to the target.
    cp = lib.powerinfer_context_default_params()
    mp.sparse_mode = lib.POWERINFER_SPARSE_GATE
    m = lib.powerinfer_model_load(str(out).encode(), mp)
    c = lib.powerinfer_context_new(m, cp)
    raw = TEXT.encode()
    buf = ffi.new("int32_t[]", len(raw) + 8)
    n = lib.powerinfer_tokenize(m, raw, len(raw), buf, len(raw) + 8, True, False)
    one = ffi.new("int32_t[1]")
    for pos in range(min(n, 128)):
        one[0] = buf[pos]
        assert lib.powerinfer_decode(c, one, 1, pos, False) == 0
    a, b = ffi.new("int64_t*"), ffi.new("int64_t*")
    skipped = []
    for il in range(lib.powerinfer_model_n_layer(m)):
        lib.powerinfer_sparse_stats(c, il, a, b)
        skipped.append(1.0 - a[0] / b[0])
    lib.powerinfer_context_free(c)
    lib.powerinfer_model_free(m)
    assert np.all(np.abs(np.array(skipped) - target) < 0.1), skipped


def test_gate_mode_costs_little_nll_at_low_sparsity(silu_model, tmp_path):
    counts, lo, hi = collect_histograms(silu_model, [TEXT], n_tokens=512, chunk=128, progress=False)
    out = tmp_path / "gate10.gguf"
    write_gate_model(silu_model, str(out), thresholds_for_sparsity(counts, lo, hi, 0.1), progress=False)
    d, _ = evaluate(str(out), TEXT, "dense", n_tokens=64)
    g, _ = evaluate(str(out), TEXT, "gate", n_tokens=64)
    assert np.isfinite(d) and abs(g - d) < 0.05


def test_cli_refuses_to_overwrite_input(silu_model, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    assert main([silu_model, "--corpus", str(corpus), "--out", silu_model]) == 1
    assert "would overwrite the model" in capsys.readouterr().err
