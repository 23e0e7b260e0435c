"""The sparse FFN operators (src/powerinfer_kernels/sparse_ops.c) against a numpy reference,
for every weight type the sparse path promises, through the build/bin/test-sparse-ops-<level>
drivers (the operators are internal to the core), one per kernel level (tests/kernel_levels.py:
x86 scalar, avx2, avxvnni, avx512; aarch64 scalar, dotprod). Every level this CPU executes is
tested, and a missing driver for such a level fails (CI must not pass on tests that did not
run where they can); levels the CPU cannot execute are skipped. On x86-64 the aarch64 levels
run too, cross-built by scripts/build_aarch64.sh and run under qemu-aarch64 (required where
POWERINFER_REQUIRE_AARCH64=1, as in CI). Across the levels of one architecture, the AXPY and
the packed matmul give the same bits (their per-element fma order is fixed); the row dot
products only agree within the bounds below (their float summation order follows the level's
vector width).

Tolerances are derived, not tuned: the reference uses the weights exactly as the
operator sees them (quantized, then dequantized by ggml), so the row-sparse matvec's
only approximation is the conversion of the input to the weights' vec_dot type:
  Q8_0 (for Q4_0/Q4_1/Q5_0/Q8_0): blocks of 32, scale d = amax/127 stored as f16:
      |error| <= d/2 + 127*|d - f16(d)| <= d * (0.5 + 127 * 2**-11)
  Q8_K (for K-quants): blocks of 256, d = amax/127 in f32: |error| <= d/2
  F16: relative 2**-11; BF16: relative 2**-8; F32: exact.
Summed with the weights: |out - ref| <= sum_j |w_j| * err_j, plus float32 accumulation
(n * eps * sum |w_j x_j|). The AXPY has no input conversion: only accumulation error.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import kernel_levels

KIND = "test-sparse-ops"
DRIVERS = kernel_levels.driver_targets(KIND)  # each kernel level's driver, and how to run it

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_K", "q6_K"]
K_QUANTS = {"q4_K", "q6_K"}
EPS32 = np.finfo(np.float32).eps


def _input_error_bound(x: np.ndarray, wtype: str) -> np.ndarray:
    """Per-element bound on |convert(x) - x| for the vec_dot type of `wtype`."""
    if wtype == "f32":
        return np.zeros_like(x)
    if wtype == "f16":
        return np.abs(x) * 2.0**-11
    if wtype == "bf16":
        return np.abs(x) * 2.0**-8
    block, slack = (256, 0.5) if wtype in K_QUANTS else (32, 0.5 + 127 * 2.0**-11)
    amax = np.abs(x.reshape(x.shape[0], -1, block)).max(axis=-1, keepdims=True)
    d = amax / 127.0
    return np.broadcast_to(d * slack, x.reshape(x.shape[0], -1, block).shape).reshape(x.shape)


def _run(tmp_path, wtype, threads, w, x, h, active, driver):
    """driver: a kernel_levels.Target."""
    driver.require()
    n_ff, n_embd = w.shape
    n_tok = x.shape[0]
    src = tmp_path / f"in-{wtype}-{threads}.bin"
    dst = tmp_path / f"out-{wtype}-{threads}.bin"
    with open(src, "wb") as f:
        f.write(struct.pack("<3q", n_embd, n_ff, n_tok))
        f.write(w.astype("<f4").tobytes())
        f.write(x.astype("<f4").tobytes())
        f.write(h.astype("<f4").tobytes())
        f.write(struct.pack("<i", len(active)))
        f.write(np.asarray(active, dtype="<i4").tobytes())
    driver.run(wtype, threads, src, dst, timeout=120)  # the timeout scales under emulation
    out = np.fromfile(dst, dtype="<f4")
    exact = wtype in ("q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q6_K")
    sizes = [n_ff * n_embd, n_tok * n_ff, n_tok * n_embd, n_tok * n_embd if n_tok <= 8 else 0, n_tok * n_ff,
             n_tok * n_ff if exact else 0]
    parts = np.split(out, np.cumsum(sizes)[:-1])
    assert sum(sizes) == out.size
    wd, up, down = parts[0].reshape(n_ff, n_embd), parts[1].reshape(n_tok, n_ff), parts[2].reshape(n_tok, n_embd)
    _run.fused = parts[3].reshape(n_tok, n_embd) if sizes[3] else None
    _run.packed = parts[4].reshape(n_tok, n_ff)
    _run.exact = parts[5].reshape(n_tok, n_ff) if exact else None
    return wd, up, down


def _problem(seed, n_embd=512, n_ff=384, n_tok=3, frac_active=0.15):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_ff, n_embd)).astype(np.float32) * 0.05
    x = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    active = np.sort(rng.choice(n_ff, size=int(n_ff * frac_active), replace=False)).astype(np.int32)
    h = np.zeros((n_tok, n_ff), dtype=np.float32)
    h[:, active] = np.maximum(rng.standard_normal((n_tok, len(active))), 0).astype(np.float32)  # ReLU-like zeros too
    return w, x, h, active


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("n_tok", [1, 3])  # one token: the fused Q4_0/Q8_0 AXPY kernels
@pytest.mark.parametrize("wtype", TYPES)
def test_sparse_ops_match_numpy(tmp_path, wtype, n_tok, driver):
    w, x, h, active = _problem(seed=TYPES.index(wtype), n_tok=n_tok)
    wd, up, down = _run(tmp_path, wtype, 2, w, x, h, active, driver)
    wd64, x64, h64 = wd.astype(np.float64), x.astype(np.float64), h.astype(np.float64)

    inactive = np.setdiff1d(np.arange(w.shape[0]), active)
    assert np.all(up[:, inactive] == 0.0), "inactive rows must be exactly zero"

    ref_up = x64 @ wd64[active].T  # [n_tok, n_active]
    err_x = _input_error_bound(x64, wtype)  # [n_tok, n_embd]
    bound = err_x @ np.abs(wd64[active]).T + w.shape[1] * EPS32 * (np.abs(x64) @ np.abs(wd64[active]).T) + 1e-6
    diff = np.abs(up[:, active] - ref_up)
    assert np.all(diff <= bound), f"{wtype}: max excess {np.max(diff - bound):.3g}"
    # The worst-case bound grows like n, real errors like sqrt(n): also check that the
    # typical error is the size 8-bit input rounding gives (~1/(127*sqrt(3)) relative).
    rel_rms = np.sqrt(np.mean(diff**2) / np.mean(ref_up**2))
    assert rel_rms < {"f32": 1e-6, "f16": 1e-3, "bf16": 1e-2}.get(wtype, 2e-2), rel_rms

    ref_down = h64[:, active] @ wd64[active]  # [n_tok, n_embd]
    bound_down = len(active) * EPS32 * (np.abs(h64[:, active]) @ np.abs(wd64[active])) + 1e-7
    assert np.all(np.abs(down - ref_down) <= bound_down)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("n_tok", [1, 3])
@pytest.mark.parametrize("wtype", ["f32", "q8_0", "q4_0", "q4_K"])
def test_fused_ffn_matches_numpy(tmp_path, wtype, n_tok, driver):
    """pi_sparse_ffn with W as gate, up and ffn_down_t and ReLU: h_i = relu(g_i) * g_i with
    g_i = W_i . x for the active i, then sum_i h_i W_i. Bound: the matvec's bound on g (as
    above) carried through h (|dh| <= |dg| (2|g| + |dg|)), then the AXPY's accumulation."""
    _check_fused(tmp_path, wtype, n_tok, driver, n_embd=512)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("wtype", ["f16", "q4_K"])
def test_fused_ffn_long_rows(tmp_path, wtype, driver):
    """Rows longer than the AXPY's dequantization piece (PI_AXPY_PIECE = 1024 elements):
    2304 = 1024 + 1024 + 256, so types without a fused kernel cross piece boundaries."""
    _check_fused(tmp_path, wtype, 2, driver, n_embd=2304)


def _check_fused(tmp_path, wtype, n_tok, driver, n_embd):
    w, x, h, active = _problem(seed=11 + TYPES.index(wtype), n_tok=n_tok, n_embd=n_embd)
    wd, _, _ = _run(tmp_path, wtype, 2, w, x, h, active, driver)
    fused = _run.fused
    wd64, x64 = wd.astype(np.float64), x.astype(np.float64)
    g = x64 @ wd64[active].T
    err_g = _input_error_bound(x64, wtype) @ np.abs(wd64[active]).T + w.shape[1] * EPS32 * (np.abs(x64) @ np.abs(wd64[active]).T)
    hh = np.maximum(g, 0) * g
    err_h = err_g * (2 * np.abs(g) + err_g)
    ref = hh @ wd64[active]
    bound = err_h @ np.abs(wd64[active]) + len(active) * EPS32 * ((np.abs(hh) + err_h) @ np.abs(wd64[active])) + 1e-6
    assert np.all(np.abs(fused - ref) <= bound), f"{wtype}: max excess {np.max(np.abs(fused - ref) - bound):.3g}"


def _q8_0_error_bound(a: np.ndarray) -> np.ndarray:
    """Per-element bound on |Q8_0(a) - a| along the last axis (the input-conversion formula)."""
    return _input_error_bound(a.reshape(-1, a.shape[-1]), "q8_0").reshape(a.shape)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("n_tok", [1, 3, 9])
def test_packed_matmul_matches_numpy(tmp_path, n_tok, driver):
    """The Q8_0x16 matmul (packed_matmul.c): float W packed (quantized to Q8_0 per 32
    elements of a row) times x (quantized the same way). Bound: both roundings,
    |dW| |x| + |W| |dx| + |dW| |dx| summed over the row, plus float32 accumulation."""
    w, x, h, active = _problem(seed=21, n_tok=n_tok)
    _run(tmp_path, "f32", 2, w, x, h, active, driver)
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    ref = x64 @ w64.T
    ew, ex = _q8_0_error_bound(w64), _q8_0_error_bound(x64)
    bound = ex @ np.abs(w64).T + np.abs(x64) @ ew.T + ex @ ew.T + w.shape[1] * EPS32 * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    diff = np.abs(_run.packed - ref)
    assert np.all(diff <= bound), f"max excess {np.max(diff - bound):.3g}"
    assert np.sqrt(np.mean(diff**2) / np.mean(ref**2)) < 2e-2


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("n_tok", [1, 5])
@pytest.mark.parametrize("wtype", ["q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q6_K"])
def test_exact_packing_matches_the_weights(tmp_path, wtype, n_tok, driver):
    """Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K weights packed exactly (the file's scales and integers,
    K-quants' sub-block scales as fp32 products): the packed matmul is the quantized W (as
    ggml dequantizes it) times x converted to Q8_0 (for every weight type), the matvec's bound."""
    w, x, h, active = _problem(seed=31 + n_tok, n_tok=n_tok)
    wd, _, _ = _run(tmp_path, wtype, 2, w, x, h, active, driver)
    wd64, x64 = wd.astype(np.float64), x.astype(np.float64)
    ref = x64 @ wd64.T
    bound = _input_error_bound(x64, "q8_0") @ np.abs(wd64).T + w.shape[1] * EPS32 * (np.abs(x64) @ np.abs(wd64).T) + 1e-6
    diff = np.abs(_run.exact - ref)
    assert np.all(diff <= bound), f"max excess {np.max(diff - bound):.3g}"
    assert np.sqrt(np.mean(diff**2) / np.mean(ref**2)) < 2e-2


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("wtype", ["q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q6_K"])
def test_packed_columns_do_not_depend_on_the_batch(tmp_path, wtype, driver):
    """Each token of a batch gets, bit for bit, what it gets alone: the packed kernels run
    tiles of 1 to 4 tokens, each compiled apart (ParallelLlama's streams equal their solo
    runs only if a column's result never depends on its batch or its place in a tile)."""
    w, x, h, active = _problem(seed=41, n_tok=9)
    _run(tmp_path, wtype, 2, w, x, h, active, driver)
    batched = (_run.exact.copy(), _run.packed.copy())
    for t in range(x.shape[0]):
        for n in (1, 2, 3):  # token t alone, and first of a tile of 2 and 3
            if t + n > x.shape[0]:
                break
            _run(tmp_path, wtype, 2, w, x[t : t + n], h[t : t + n], active, driver)
            assert np.array_equal(_run.exact[0], batched[0][t]), (wtype, t, n)
            assert np.array_equal(_run.packed[0], batched[1][t]), (wtype, t, n)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
@pytest.mark.parametrize("wtype", ["q4_0", "q8_0", "f16"])
def test_thread_counts_agree_bitwise(tmp_path, wtype, driver):
    w, x, h, active = _problem(seed=7)
    results = []
    for t in (1, 2, 3):
        results.append(_run(tmp_path, wtype, t, w, x, h, active, driver) + (_run.fused, _run.packed))
    for r in results[1:]:
        for a, b in zip(r[1:], results[0][1:]):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
def test_empty_and_full_active_sets(tmp_path, driver):
    w, x, h, _ = _problem(seed=3, n_tok=1)
    _, up, down = _run(tmp_path, "q8_0", 3, w, x, h, np.array([], dtype=np.int32), driver)
    assert np.all(up == 0) and np.all(down == 0)
    everything = np.arange(w.shape[0], dtype=np.int32)
    h_all = np.abs(h) + 0.5
    wd, up, down = _run(tmp_path, "f32", 3, w, x, h_all, everything, driver)
    np.testing.assert_allclose(up[0], wd @ x[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(down[0], h_all[0] @ wd, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_tok", [1, 3])
@pytest.mark.parametrize("wtype", ["q4_0", "q8_0", "q4_K", "f16"])
def test_levels_agree_bitwise(tmp_path, wtype, n_tok):
    """What the kernels promise across levels: the AXPY (down) is one fma per element and
    row, rows in order, at every level (SIMD or scalar); the packed matmuls (packed, exact)
    sum each row's integers exactly and scale them by the same fmas per block. So every
    level this CPU runs gives the same bits for them (the row dot products, up, need not)."""
    w, x, h, active = _problem(seed=51 + n_tok, n_tok=n_tok)
    ran = 0
    for arch in dict.fromkeys(t.arch for t in DRIVERS):  # within one architecture: ggml's own
        results = {}  # quantization and dequantization may round differently on another
        for driver in DRIVERS:
            if driver.arch == arch and not driver.unrunnable and (driver.required or driver.path.exists()):
                _, _, down = _run(tmp_path, wtype, 2, w, x, h, active, driver)  # a required one fails if missing
                results[driver.id] = (down, _run.packed, _run.exact)
        first, ref = next(iter(results.items()), (None, None))
        for name, got in results.items():
            for what, a, b in zip(("down", "packed", "exact"), got, ref):
                if b is not None:
                    assert np.array_equal(a, b), f"{wtype}: {what} of {name} differs from {first}"
        ran += len(results)
    if ran < 2:
        pytest.skip("fewer than two levels run here")
