"""The kernel levels (issue 54): the library picks the best level this CPU runs (read here
independently from /proc/cpuinfo), POWERINFER_KERNELS and powerinfer_set_kernel_level pick
another, every level gives a sparse model the same bits, and a level without a SIMD column
product runs input mode dense (never slower than dense) unless POWERINFER_INPUT_SCALAR=1.
The per-level kernels themselves are compared with numpy in test_input_sparse.py and
test_sparse_ops.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kernel_levels
from powerinfer_py import Llama, kernel_level
from powerinfer_py._core import bindings

RUNNABLE = kernel_levels.runnable_levels()
PROMPT = "The capital of France is"


def test_the_library_picks_the_best_level_this_cpu_runs():
    if os.environ.get("POWERINFER_KERNELS"):
        pytest.skip("POWERINFER_KERNELS is set")
    assert kernel_level() == RUNNABLE[0]
    assert bindings.kernel_levels() == RUNNABLE


def _level_in_subprocess(env_value: str):
    env = dict(os.environ, POWERINFER_KERNELS=env_value)
    code = "import powerinfer_py; print(powerinfer_py.kernel_level())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


@pytest.mark.parametrize("level", RUNNABLE)
def test_environment_picks_a_runnable_level(level):
    got, err = _level_in_subprocess(level)
    assert got == level
    assert "POWERINFER_KERNELS" not in err


@pytest.mark.parametrize("bad", ["avx9000", "dotprod" if kernel_levels.built_levels().get("avx2") else "avx2"])
def test_environment_naming_an_unavailable_level_says_so(bad):
    got, err = _level_in_subprocess(bad)
    assert got == RUNNABLE[0]
    assert f"POWERINFER_KERNELS={bad}" in err and RUNNABLE[0] in err


def test_setting_a_level_the_cpu_cannot_run_is_refused():
    unrunnable = [lv for lv in kernel_levels.all_levels() if lv not in RUNNABLE] + ["nonsense"]
    before = kernel_level()
    for lv in unrunnable:
        with pytest.raises(ValueError, match="not available here"):
            bindings.set_kernel_level(lv)
    assert kernel_level() == before


@pytest.fixture(scope="module")
def sparse_smollm2(smollm2_path, tmp_path_factory):
    """An input-mode copy of SmolLM2 (greedy allocation on a small calibration: quick)."""
    from powerinfer_py.pipeline.sparsify import sparsify

    corpus = tmp_path_factory.mktemp("corpus") / "c.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40
                      + "Language models predict the next token from the previous ones. " * 40)
    out = tmp_path_factory.mktemp("sparse") / "smol-input.gguf"
    sparsify(smollm2_path, str(out), 0.4, [str(corpus)], n_tokens=256, allocation="greedy", progress=False)
    return str(out)


def _run(path, level, sparse_mode="auto", verbose=False):
    bindings.set_kernel_level(level)
    try:
        llm = Llama(model_path=path, n_ctx=256, n_threads=2, sparse_mode=sparse_mode, logits_all=True,
                    flash_attn=False, verbose=verbose)  # ggml's attention: the same at every level
        try:
            out = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
            logits = np.array(llm.scores[: llm.n_tokens], dtype=np.float32).copy()
            return out["choices"][0]["text"], logits, llm.sparse_stats()
        finally:
            llm.close()
    finally:
        bindings.set_kernel_level(RUNNABLE[0])


def test_every_level_runs_the_sparse_model_alike(sparse_smollm2, monkeypatch):
    # The input-sparse product gives the same bits at every level (test_input_product_bits_are_
    # the_same_at_every_level); the head's exact top logits of a decode step go through the
    # row dot products, whose float order is the level's own (test_sparse_ops.py): those
    # logits may differ by a few float32 roundings of sums of 576 terms of size ~1 (1e-3 bounds
    # them with a wide margin), and the greedy text may not differ at all.
    monkeypatch.setenv("POWERINFER_INPUT_SCALAR", "1")  # the scalar level keeps the sparse product too
    ref_text, ref_logits, ref_stats = _run(sparse_smollm2, RUNNABLE[0])
    assert ref_stats["mode"] == "input" and ref_stats["kernels"] == RUNNABLE[0]
    assert 0.0 < ref_stats["active"] < 1.0
    for level in RUNNABLE[1:]:
        text, logits, stats = _run(sparse_smollm2, level)
        assert stats["kernels"] == level
        assert text == ref_text
        assert np.abs(logits - ref_logits).max() < 1e-3, level
        assert stats["active"] == ref_stats["active"]


def test_input_product_bits_are_the_same_at_every_level(tmp_path):
    import test_input_sparse as tis

    # this machine's levels (emulated ones quantize the weights with another build of ggml)
    targets = [t.require() for t in kernel_levels.driver_targets("test-input-sparse") if not t.runner and not t.unrunnable]
    assert set(RUNNABLE) <= {t.level for t in targets}
    rng = np.random.default_rng(54)
    for types in (["q4_0"], ["q4_K"], ["q5_K"], ["q6_K"], ["q8_0"], ["q5_0", "q4_1", "q6_K"], ["q4_K", "q5_1"]):
        segs = [(t, tis._weights(rng, 256, 512)) for t in types]
        for T in (1, 6):
            x = tis._inputs(rng, T, 512)
            ys = [tis._run(tmp_path, segs, x, 0.5, driver=t)["y"].copy() for t in targets]
            for t, y in zip(targets[1:], ys[1:]):
                assert np.array_equal(y, ys[0]), f"{types} T={T}: {t} differs from {targets[0]}"


def test_scalar_level_runs_input_mode_dense(sparse_smollm2, monkeypatch, capfd):
    monkeypatch.setenv("POWERINFER_INPUT_SCALAR", "0")
    text, logits, stats = _run(sparse_smollm2, "scalar", verbose=True)
    err = capfd.readouterr().err
    assert "has no SIMD column product" in err and "every matrix runs dense" in err
    assert stats["active"] is None  # no input-sparse step ran
    d_text, d_logits, _ = _run(sparse_smollm2, RUNNABLE[0], sparse_mode="dense")
    assert text == d_text and np.array_equal(logits, d_logits)


def test_main_prints_the_level(cli_path, smollm2_path):
    r = subprocess.run([str(cli_path), "-m", smollm2_path, "-p", PROMPT, "-n", "4", "-t", "2", "--temp", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"kernels     = {kernel_level()} (this CPU runs: {','.join(RUNNABLE)})" in r.stderr
