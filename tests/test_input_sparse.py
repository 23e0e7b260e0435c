"""The input-sparse product (src/powerinfer_kernels/input_sparse.c) against numpy, through the
build/bin/test-input-sparse-<level> drivers (the operator is internal to the core), one per
kernel level (tests/kernel_levels.py): every level this CPU executes, a missing driver of one
failing; on x86-64 also the aarch64 levels, cross-built by scripts/build_aarch64.sh and run
under qemu-aarch64 (required where POWERINFER_REQUIRE_AARCH64=1, as in CI). The tests that
are not parametrized by driver run the level the library picks on this CPU.

The column copy must hold the file's weights exactly: its rows equal ggml's own
dequantization bit for bit. The product keeps x[j] when |x[j]| > tau and quantizes the kept
entries to 8 bits per block of 32 columns, or of 256 when every matrix is a K-quant (step
d = amax / 127 over the kept entries of the block, q8 = round(x / d)). With w = a * q + b
the weight (the copy's a, b and q), it sums per unit u of 16 or 32 columns
    y = sum_u a_u * d * sum_{j in u, kept} q_j * q8_j  +  b_u * d * sum_{j in u, kept} q8_j
(blocks of 32: float scales per unit; the offsets meet the same 8-bit inputs as the
weights, as in ggml's dot products), or, with blocks of 256 (integer sums per unit,
folded per super-block, as ggml's K-quant dot products do)
    y = sum_j w_j * q8_j * d                 over the kept j.
Two references:
  - that formula in float64 from the copy's a, b, q and numpy's own quantization of x:
    only float32 rounding separates them, bounded by (units + 2) * eps * sum |terms|;
  - the float64 product of the dequantized W with x over the kept entries: the input's
    quantization adds at most d_u / 2 per kept entry, times |a_u * q_j| summed.
Batch invariance (each token alone gives the batch's bits), thread-count invariance, the
scalar kernels (bit-equal to the SIMD ones) and the levels against each other (the same
bits wherever their copies hold the same weights) are checked exactly.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import kernel_levels

KIND = "test-input-sparse"
DRIVERS = kernel_levels.driver_targets(KIND)  # each kernel level's driver, and how to run it
EPS32 = float(np.finfo(np.float32).eps)

# ggml's type ids (ggml.h)
TYPE_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_K": 12, "q5_K": 13, "q6_K": 14}
UNIT = {"q6_K": 16}  # columns per (a, b); 32 for the others


def _run(tmp_path, segs, x, tau, threads=2, driver=None):
    """segs: [(type, W float32 [rows, n_in])]; driver: a kernel_levels.Target (default: the
    level the library picks here). Returns the driver's outputs."""
    driver = driver or kernel_levels.best_target(KIND)
    driver.require()
    n_in = x.shape[1]
    T = x.shape[0]
    src = tmp_path / "in.bin"
    dst = tmp_path / "out.bin"
    with open(src, "wb") as f:
        f.write(struct.pack("<3q", n_in, T, len(segs)))
        for t, w in segs:
            f.write(struct.pack("<2q", TYPE_IDS[t], w.shape[0]))
        f.write(struct.pack("<f", tau))
        for _, w in segs:
            f.write(w.astype("<f4").tobytes())
        f.write(x.astype("<f4").tobytes())
    driver.run(threads, src, dst, timeout=120)  # the timeout scales under emulation
    raw = dst.read_bytes()
    (n_out,) = struct.unpack_from("<q", raw, 0)
    off = 8
    out = {}
    for name, shape in [("deq", (n_out, n_in)), ("w", (n_out, n_in)), ("a", (n_out, n_in)), ("b", (n_out, n_in)),
                        ("y", (T, n_out)), ("y_alone", (T, n_out)), ("y_scalar", (T, n_out))]:
        n = shape[0] * shape[1]
        out[name] = np.frombuffer(raw, "<f4", n, off).reshape(shape)
        off += 4 * n
    out["kept"], out["total"] = struct.unpack_from("<2q", raw, off)
    return out


def _roundf(v):
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


K_QUANTS = {"q4_K", "q5_K", "q6_K"}


def _quantize_kept(x, tau, block):
    """The operator's kept mask and 8-bit inputs, in float32 like the C code."""
    keep = ~(np.abs(x) <= tau)
    T, n = x.shape
    xk = np.where(keep, x, 0).astype(np.float32)
    amax = np.abs(xk).reshape(T, n // block, block).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q8 = _roundf((xk.reshape(T, n // block, block) * inv[:, :, None]).astype(np.float32)).reshape(T, n)
    q8 = np.where(keep, q8, 0)
    return keep, np.repeat(d, block, axis=1), q8


def _check(out, x, tau, units, types):
    deq, w, a, b = out["deq"], out["w"], out["a"], out["b"]
    assert np.array_equal(w, deq), "the column copy does not hold ggml's weights exactly"
    kblocks = all(t in K_QUANTS for t in types)
    keep, d, q8 = _quantize_kept(x, tau, 256 if kblocks else 32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    q = np.where(a != 0, np.round((w.astype(np.float64) - b64) / np.where(a != 0, a64, 1)), 0)
    n_in = x.shape[1]
    dcol = d.astype(np.float64)  # [T, n_in]: each column's quantization step
    xk = np.where(keep, x, 0).astype(np.float64)
    for t in range(x.shape[0]):
        # the operator's arithmetic, in float64
        terms_q = a64 * q * (q8[t] * dcol[t])[None, :]
        terms_b = b64 * (q8[t] * dcol[t])[None, :]
        ref = terms_q.sum(axis=1) + terms_b.sum(axis=1)
        mag = np.abs(terms_q).sum(axis=1) + np.abs(terms_b).sum(axis=1)
        err = np.abs(out["y"][t] - ref)
        bound = (n_in / units + 2) * 2 * EPS32 * mag + 1e-30
        assert (err <= bound).all(), f"token {t}: max err {err.max()} vs bound at worst {(err - bound).max()}"
        # against the plain product over the kept entries: the input's quantization
        plain = (w.astype(np.float64) * xk[t][None, :]).sum(axis=1)
        qerr = (np.abs(a64 * q + b64) * (dcol[t] / 2 * keep[t])[None, :]).sum(axis=1)
        assert (np.abs(out["y"][t] - plain) <= qerr + bound).all()
    assert np.array_equal(out["y"], out["y_alone"]), "a token's result depends on the rest of its batch"
    assert np.array_equal(out["y"], out["y_scalar"]), "the SIMD and scalar kernels differ"
    assert out["kept"] == int(keep.sum()) and out["total"] == x.size


def _weights(rng, rows, n_in):
    w = rng.standard_normal((rows, n_in)).astype(np.float32)
    w *= rng.uniform(0.2, 3.0, size=(rows, 1)).astype(np.float32)  # rows of different scales
    return w


def _inputs(rng, T, n_in):
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    x[:, rng.choice(n_in, n_in // 50, replace=False)] *= 20  # a few outsized channels, as in real models
    return x


@pytest.mark.parametrize("wtype", list(TYPE_IDS))
@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
def test_each_type_exact_copy_and_product(tmp_path, wtype, driver):
    rng = np.random.default_rng(TYPE_IDS[wtype])
    n_in = 512
    x = _inputs(rng, 3, n_in)
    tau = float(np.quantile(np.abs(x), 0.4))
    segs = [(wtype, _weights(rng, 208, n_in))]  # 208 rows: three whole tiles and a partial one
    out = _run(tmp_path, segs, x, tau, driver=driver)
    _check(out, x, tau, UNIT.get(wtype, 32), [wtype])


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
def test_mixed_group_like_q_k_v(tmp_path, driver):
    # q, k, v of Q4_K_M: Q4_K, Q4_K and Q6_K (16-column units: the whole group goes by 16).
    rng = np.random.default_rng(7)
    n_in = 768
    x = _inputs(rng, 4, n_in)
    tau = float(np.quantile(np.abs(x), 0.5))
    segs = [("q4_K", _weights(rng, 256, n_in)), ("q4_K", _weights(rng, 64, n_in)), ("q6_K", _weights(rng, 80, n_in))]
    out = _run(tmp_path, segs, x, tau, driver=driver)
    _check(out, x, tau, 16, [t for t, _ in segs])


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
def test_mixed_group_of_k_and_32_blocks(tmp_path, driver):
    # a K-quant beside a 32-block type: the input is quantized per 32, float scales per unit
    rng = np.random.default_rng(8)
    n_in = 512
    x = _inputs(rng, 5, n_in)  # five tokens: groups of four, then one
    tau = float(np.quantile(np.abs(x), 0.45))
    segs = [("q6_K", _weights(rng, 128, n_in)), ("q8_0", _weights(rng, 192, n_in)), ("q5_0", _weights(rng, 64, n_in))]
    out = _run(tmp_path, segs, x, tau, driver=driver)
    _check(out, x, tau, 16, [t for t, _ in segs])


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
def test_tall_group_cut_into_row_pieces(tmp_path, driver):
    # 64 tiles of 128 rows over 2 super-blocks: few column pieces, so each is cut by rows too
    rng = np.random.default_rng(12)
    n_in = 512
    x = _inputs(rng, 2, n_in)
    tau = float(np.quantile(np.abs(x), 0.4))
    segs = [("q4_K", _weights(rng, 4096, n_in)), ("q4_K", _weights(rng, 4096, n_in))]
    out = _run(tmp_path, segs, x, tau, driver=driver)
    _check(out, x, tau, 32, ["q4_K", "q4_K"])


@pytest.mark.parametrize("types", [["q4_K", "q5_K", "q6_K"], ["q4_1", "q5_1", "q8_0"], ["q5_0", "q4_0", "q4_K"]],
                         ids=["k-blocks", "32-blocks", "k-beside-32"])
def test_every_level_gives_the_same_bits(tmp_path, types):
    # Every kernel level this machine runs (on x86-64 the aarch64 ones too, under qemu, when
    # built) computes the same operations in the same order: the same bits, one token or
    # four. The drivers quantize the weights with their own ggml, and the aarch64 ggml's
    # K-quant quantizer rounds some rows differently from the x86 one (same floats, other
    # integers and scales): levels are compared wherever their column copies (w, a, b) are
    # the same, which must hold within an architecture.
    rng = np.random.default_rng(14)
    n_in = 512
    x = _inputs(rng, 4, n_in)
    tau = float(np.quantile(np.abs(x), 0.45))
    segs = [(t, _weights(rng, 144, n_in)) for t in types]
    outs = {}
    for d in DRIVERS:
        if d.unrunnable or (not d.required and not d.path.exists()):
            continue
        outs[d.id] = (d.arch, _run(tmp_path, segs, x, tau, driver=d))
    if len(outs) < 2:
        pytest.skip(f"only one kernel level runs here ({', '.join(outs)})")
    levels = list(outs)
    n_compared = 0
    for i, one in enumerate(levels):
        for other in levels[:i]:
            (arch1, o1), (arch2, o2) = outs[one], outs[other]
            same_copy = all(np.array_equal(o1[k], o2[k]) for k in ("w", "a", "b"))
            assert same_copy or arch1 != arch2, f"the {one} and {other} drivers hold different column copies"
            if same_copy:
                for k in ("y", "y_alone"):
                    assert np.array_equal(o1[k], o2[k]), f"{k}: the {one} kernels' bits differ from the {other} kernels'"
                n_compared += 1
    assert n_compared > 0


def test_thread_count_does_not_change_the_bits(tmp_path):
    rng = np.random.default_rng(11)
    n_in = 512
    x = _inputs(rng, 2, n_in)
    tau = float(np.quantile(np.abs(x), 0.3))
    segs = [("q4_K", _weights(rng, 448, n_in)), ("q8_0", _weights(rng, 128, n_in))]
    ys = [_run(tmp_path, segs, x, tau, threads=n)["y"] for n in (1, 2, 3, 5)]
    for y in ys[1:]:
        assert np.array_equal(ys[0], y)


def test_extremes_of_the_threshold(tmp_path):
    rng = np.random.default_rng(5)
    n_in = 256
    x = _inputs(rng, 2, n_in)
    segs = [("q4_0", _weights(rng, 64, n_in))]
    # tau = 0: every nonzero entry is kept (the dense product, up to the input's quantization)
    x0 = x.copy()
    x0[0, :40] = 0
    out = _run(tmp_path, segs, x0, 0.0)
    _check(out, x0, 0.0, 32, ["q4_0"])
    assert out["kept"] == int((x0 != 0).sum())
    # above every entry: nothing kept, the product is 0
    out = _run(tmp_path, segs, x, float(np.abs(x).max()) * 2)
    assert out["kept"] == 0 and not out["y"].any()


def test_nan_reaches_its_token_only(tmp_path):
    rng = np.random.default_rng(9)
    n_in = 256
    x = _inputs(rng, 3, n_in)
    x[1, 17] = np.nan
    out = _run(tmp_path, [("q8_0", _weights(rng, 64, n_in))], x, 0.5)
    assert np.isnan(out["y"][1]).all()
    assert np.isfinite(out["y"][0]).all() and np.isfinite(out["y"][2]).all()


@pytest.mark.parametrize("rows", [160, 256], ids=["padded", "whole-tiles"])
@pytest.mark.parametrize("driver", DRIVERS, ids=lambda t: t.id)
def test_very_long_columns_cut_into_row_pieces_only(tmp_path, driver, rows):
    # an LM head's shape (more than 512 tiles, here 513 + 2 over two segments): the pieces
    # are row pieces only, as many as the threads or more, all sharing one partial plane;
    # they must still cover every row once, and their count must not change a bit. With
    # whole tiles (no padding) that plane is the result itself, summed by no one.
    rng = np.random.default_rng(13)
    n_in = 64
    x = _inputs(rng, 3, n_in)
    tau = float(np.quantile(np.abs(x), 0.4))
    segs = [("q4_0", _weights(rng, 513 * 128, n_in)), ("q8_0", _weights(rng, rows, n_in))]
    out = _run(tmp_path, segs, x, tau, driver=driver)
    _check(out, x, tau, 32, ["q4_0", "q8_0"])
    for threads in (1, 5):
        assert np.array_equal(_run(tmp_path, segs, x, tau, threads=threads, driver=driver)["y"], out["y"])


def _extreme_rows(n_in, rng):
    """Rows whose quants sit at the ends of their range (all the top, a top with the bottom
    every 16 or 32 columns, alternating signs): the 16-bit sums of the AVX2 kernel at their limits."""
    pats = [np.full(n_in, -1.0), np.full(n_in, 1.0)]
    for a, b, step in ((-31 / 32, 1.0, 16), (31 / 32, -1.0, 16), (1.0, 0.0, 32)):
        r = np.full(n_in, a)
        r[::step] = b
        pats.append(r)
    r = np.zeros(n_in)
    r[::32] = 1.0
    pats.append(1.0 - r)
    pats.append(np.where(np.arange(n_in) % 2 == 0, 1.0, -1.0))
    w = np.stack([pats[i % len(pats)] for i in range(144)]).astype(np.float32)
    return w * rng.uniform(0.5, 2.0, size=(144, 1)).astype(np.float32)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda d: d.id)
@pytest.mark.parametrize("types", [["q4_K"], ["q6_K"], ["q4_K", "q6_K"], ["q4_0"], ["q4_1"], ["q4_K", "q5_K", "q6_K"]],
                         ids=lambda t: "+".join(t))
def test_sums_at_their_limits(tmp_path, driver, types):
    """Every 8-bit input at +-127 against quants at the ends of their range: the kernels that
    add in 16 bits (AVX2) must stay exact where the sums reach their largest values (a
    saturating add fails this)."""
    rng = np.random.default_rng(3)
    n_in = 512
    x = np.stack([np.ones(n_in), -np.ones(n_in), np.where(np.arange(n_in) % 2 == 0, 1.0, -1.0),
                  np.where((np.arange(n_in) // 4) % 2 == 0, 1.0, -1.0)]).astype(np.float32)
    segs = [(t, _extreme_rows(n_in, rng)) for t in types]
    for tau in (0.0, 0.5):
        xx = x.copy()
        if tau:
            xx[:, rng.choice(n_in, n_in // 3, replace=False)] *= 0.1  # some entries dropped
        out = _run(tmp_path, segs, xx, tau, driver=driver)
        _check(out, xx, tau, 16 if "q6_K" in types else 32, types)
