"""Hybrid GPU/CPU placement, checked with the device emulated by a CPU buffer (the same
graph, scheduler and accounting as a real device): results equal the unsplit engine
at every FFN share, the budget is never exceeded, the solver matches brute force, the
gpuidx cache round-trips and is invalidated, PowerInfer's activation files are read in
numeric layer order and never unpickled."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from powerinfer_py import Llama
from powerinfer_py._core.bindings import ffi, lib
from powerinfer_py.assets.synthetic import PRESETS, generate

from conftest import greedy_with_logits, logits_along

PROMPT = "the cat sat on the mat and"
N_GEN = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid")
    return {name: generate(PRESETS[name], out, progress=False)["powerinfer"] for name in ("tiny", "tiny-q8")}


def _load(path, mode="predictor", budget=0.0, emulate=False, **kw):
    # budget 0: nothing on a device (None would mean automatic: a real GPU's free memory)
    # n_batch 32: compute buffers small next to a tiny model's FFN rows, so shares are meaningful
    return Llama(model_path=str(path), n_ctx=256, n_batch=32, n_threads=2, sparse_mode=mode, vram_budget=budget,
                 emulate_device=emulate, verbose=False, **kw)


def _greedy(llm):
    """Greedy tokens after PROMPT and the logits of every step."""
    return greedy_with_logits(llm, PROMPT, N_GEN)


def _logits_along(llm, tokens):
    return logits_along(llm, PROMPT, tokens)


def _fixed_and_ffn(path, mode):
    """Device bytes apart from the FFN rows, and the FFN rows' bytes at 100%."""
    llm = _load(path, mode, budget=1.0, emulate=True, reset_gpu_index=True)
    p = llm.placement()
    llm.close()
    assert p["active"] and p["n_hot"] == p["n_neurons"], p
    return p["bytes_total"] - p["bytes_ffn"], p["bytes_ffn"]


@pytest.mark.parametrize("name", ["tiny", "tiny-q8"])
@pytest.mark.parametrize("mode", ["predictor", "gate"])
def test_split_equals_unsplit(tiny, name, mode):
    path = tiny[name]
    ref = _load(path, mode)
    assert not ref.placement()["active"]
    ref_tokens, ref_logits = _greedy(ref)
    ref.close()

    fixed, ffn = _fixed_and_ffn(path, mode)
    scale = np.abs(ref_logits).max()
    for share in (0.0, 0.3, 0.7, 1.0):
        margin = (256 << 10) + fixed // 16  # over the engine's margins for the compute buffers
        budget = fixed + int(share * ffn) + margin
        llm = _load(path, mode, budget=budget / 2**30, emulate=True, reset_gpu_index=True)
        p = llm.placement()
        tokens, logits = _greedy(llm)
        llm.close()
        assert p["active"] and p["emulated"]
        assert p["bytes_total"] <= p["budget"] == int(budget / 2**30 * 2**30), p  # bytes, exactly
        frac = p["n_hot"] / p["n_neurons"]
        assert frac >= share - 0.15, (share, frac, p)  # neurons go in groups of 32 (an eighth of a tiny layer)
        # The budget is used: unless every neuron is placed, what is left is under the
        # engine's reserve for the compute buffers' growth (1/64 of them + 64 KiB) plus a
        # few groups' rows (whole groups, and a shrink when the re-measured buffers grew).
        group = ffn / (p["n_neurons"] // 32)
        if share == 1.0:
            assert frac == 1.0, p
        elif frac < 1.0:
            assert p["budget"] - p["bytes_total"] <= p["bytes_compute"] // 64 + (64 << 10) + 6 * group, (share, p)
        assert tokens == ref_tokens, (share, p)
        # Device rows are summed by ggml's matmul in another order, and a quantized
        # model's down columns are requantized to Q8_0 (half a Q8_0 step per weight):
        # both stay far below the logit scale.
        tol = 1e-4 if name == "tiny" else 2e-2
        assert np.max(np.abs(logits - ref_logits)) <= tol * scale, (share, np.max(np.abs(logits - ref_logits)))


def test_budget_never_exceeded(tiny):
    path = tiny["tiny-q8"]
    fixed, ffn = _fixed_and_ffn(path, "predictor")
    rng = np.random.default_rng(0)
    budgets = list(rng.integers(1, fixed + ffn + (4 << 20), size=10)) + [1, fixed // 2, fixed, fixed + ffn // 7]
    for b in budgets:
        llm = _load(path, budget=int(b) / 2**30, emulate=True, reset_gpu_index=True)
        p = llm.placement()
        llm.close()
        assert p["bytes_total"] <= p["budget"], p
        assert p["bytes_total"] == p["bytes_dense"] + p["bytes_kv"] + p["bytes_compute"] + p["bytes_ffn"]
        if not p["active"]:
            assert p["bytes_total"] == 0


def _gguf_tensors(path, tmp_path):
    """Tensors of a GGUF or PWRI file (gguf's reader wants the GGUF magic: read a copy)."""
    import gguf

    copy = tmp_path / "as-gguf.gguf"
    data = bytearray(Path(path).read_bytes())
    data[:4] = b"GGUF"
    copy.write_bytes(bytes(data))
    reader = gguf.GGUFReader(copy)
    return reader, {t.name: np.array(t.data) for t in reader.tensors}


def _i32_as_current_code(path, tmp_path, n_layer):
    """A copy of a gpuidx file with its I32 tensors' type code 18 (PowerInfer's ggml, which
    we write for its reader) changed to today's 26, which the gguf package reads."""
    import struct

    blob = bytearray(Path(path).read_bytes())
    for il in range(n_layer):
        for kind in ("gpu_idx", "gpu_bucket"):
            name = f"blk.{il}.{kind}".encode()
            i = blob.find(struct.pack("<Q", len(name)) + name)
            assert i > 0, name
            j = i + 8 + len(name)
            (n_dims,) = struct.unpack_from("<I", blob, j)
            at = j + 4 + 8 * n_dims
            assert struct.unpack_from("<I", blob, at)[0] == 18, name
            struct.pack_into("<I", blob, at, 26)
    out = tmp_path / "gpuidx-current-codes"
    out.write_bytes(bytes(blob))
    return out


def test_hot_set_is_most_active_neurons(tiny, tmp_path):
    path = tiny["tiny-q8"]
    fixed, ffn = _fixed_and_ffn(path, "predictor")
    llm = _load(path, budget=(fixed + ffn // 2) / 2**30, emulate=True, reset_gpu_index=True)
    _, counts = _gguf_tensors(path, tmp_path)
    for il in range(PRESETS["tiny-q8"].n_layer):
        hot = llm.hot_neurons(il)
        c = counts[f"blk.{il}.ffn_act_count"]
        if 0 < len(hot) < len(c):
            cold = np.setdiff1d(np.arange(len(c)), hot)
            assert c[hot].min() >= c[cold].max()
    llm.close()


def _has_gpu() -> bool:
    # Not llama_cpp.llama_supports_gpu_offload(): that is true for any build with the RPC
    # backend (ours), GPU or not.
    from powerinfer_py import gpu_count

    return gpu_count() > 0


@pytest.mark.skipif(_has_gpu(), reason="this ggml has a GPU backend")
def test_no_device_runs_on_cpu(tiny, capfd):
    llm = Llama(model_path=tiny["tiny"], n_ctx=256, vram_budget=4, verbose=True)
    p = llm.placement()
    llm.close()
    assert not p["active"] and p["bytes_total"] == 0
    assert "no GPU backend" in capfd.readouterr().err


# ---- the solver --------------------------------------------------------------------------

def _solve(values, cost, max_groups, budget):
    n_layer, n_groups = values.shape
    chosen = np.zeros(n_layer, dtype=np.int32)
    v = np.ascontiguousarray(values, dtype=np.float64)
    c = np.ascontiguousarray(cost, dtype=np.uint64)
    m = np.ascontiguousarray(max_groups, dtype=np.int32)
    rc = lib.powerinfer_place_groups(n_layer, n_groups, ffi.cast("double *", v.ctypes.data),
                                     ffi.cast("uint64_t *", c.ctypes.data), ffi.cast("int32_t *", m.ctypes.data),
                                     int(budget), ffi.cast("int32_t *", chosen.ctypes.data))
    assert rc == 0, ffi.string(lib.powerinfer_last_error())
    return chosen


def _brute(values, cost, max_groups, budget):
    best = -1.0
    for ks in itertools.product(*[range(m + 1) for m in max_groups]):
        if sum(k * c for k, c in zip(ks, cost)) <= budget:
            best = max(best, sum(values[l, :k].sum() for l, k in enumerate(ks)))
    return best


@pytest.mark.parametrize("equal_costs", [True, False])
def test_solver_matches_brute_force(equal_costs):
    rng = np.random.default_rng(1 if equal_costs else 2)
    for _ in range(60):
        n_layer, n_groups = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        values = -np.sort(-rng.pareto(1.5, size=(n_layer, n_groups)), axis=1)
        cost = np.full(n_layer, int(rng.integers(1, 5))) if equal_costs else rng.integers(1, 7, size=n_layer)
        max_groups = rng.integers(0, n_groups + 1, size=n_layer)  # the per-layer balance cap
        budget = int(rng.integers(0, int(cost.sum()) * n_groups + 2))
        chosen = _solve(values, cost, max_groups, budget)
        assert (chosen <= max_groups).all() and int((chosen * cost).sum()) <= budget
        got = sum(values[l, :k].sum() for l, k in enumerate(chosen))
        assert got == pytest.approx(_brute(values, cost, max_groups, budget), rel=1e-12, abs=1e-12)


def test_solver_rejects_bad_input():
    values = np.array([[1.0, 2.0]])  # increasing: not sorted
    with pytest.raises(AssertionError, match="must not increase"):
        _solve(values, np.array([1]), np.array([2]), 10)


# ---- gpuidx cache ------------------------------------------------------------------------

def test_gpuidx_round_trip_and_invalidation(tiny, tmp_path):
    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(tiny["tiny-q8"], path)
    idx = Path(str(path) + ".generated.gpuidx")
    fixed, ffn = _fixed_and_ffn(path, "predictor")
    budget = (fixed + ffn // 2) / 2**30

    first = _load(path, budget=budget, emulate=True)
    hot = [first.hot_neurons(il) for il in range(3)]
    assert not first.placement()["from_cache"] and idx.exists()
    first.close()

    # The file is PowerInfer's layout: PWRI magic, gpu_idx 0/1 and sorted gpu_bucket per layer.
    assert idx.read_bytes()[:4] == b"PWRI"
    r, tensors = _gguf_tensors(_i32_as_current_code(idx, tmp_path, 3), tmp_path)
    assert r.get_field("general.architecture").contents() == "generic.gpu_index"
    assert r.get_field("split.vram_capacity").contents() > 0
    for il in range(3):
        np.testing.assert_array_equal(np.flatnonzero(tensors[f"blk.{il}.gpu_idx"]), hot[il])
        if len(hot[il]):
            np.testing.assert_array_equal(tensors[f"blk.{il}.gpu_bucket"], hot[il])

    again = _load(path, budget=budget, emulate=True)
    assert again.placement()["from_cache"]
    assert all((again.hot_neurons(il) == hot[il]).all() for il in range(3))
    again.close()

    # another budget, --reset-gpu-index, a changed model file, a corrupt cache: solved again
    other = _load(path, budget=budget * 0.9, emulate=True)
    assert not other.placement()["from_cache"]
    other.close()
    back = _load(path, budget=budget, emulate=True)  # rewritten by the previous one: solve once more
    back.close()
    reset = _load(path, budget=budget, emulate=True, reset_gpu_index=True)
    assert not reset.placement()["from_cache"]
    reset.close()
    os.utime(path, ns=(1, 1))
    touched = _load(path, budget=budget, emulate=True)
    assert not touched.placement()["from_cache"]
    touched.close()
    idx.write_bytes(b"PWRI" + b"\xff" * 64)
    corrupt = _load(path, budget=budget, emulate=True)
    assert not corrupt.placement()["from_cache"]
    assert all((corrupt.hot_neurons(il) == hot[il]).all() for il in range(3))
    corrupt.close()


# ---- PowerInfer activation files -----------------------------------------------------------

def test_activation_dir_numeric_order_and_counts(tiny, tmp_path):
    """activation_{i}.pt files drive the placement, matched to layers by number."""
    from powerinfer_py.formats import pt_io

    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(tiny["tiny-q8"], path)
    n_layer, n_ff = 3, PRESETS["tiny-q8"].n_ff
    rng = np.random.default_rng(3)
    counts = [rng.permutation(n_ff).astype(np.float32) for _ in range(n_layer)]
    act = tmp_path / "activation"
    pt_io.write_activation_dir(act, counts)
    fixed, ffn = _fixed_and_ffn(path, "predictor")
    llm = _load(path, budget=(fixed + ffn // 3) / 2**30, emulate=True, reset_gpu_index=True)
    for il in range(n_layer):
        hot = llm.hot_neurons(il)
        assert len(hot) > 0
        cold = np.setdiff1d(np.arange(n_ff), hot)
        assert counts[il][hot].min() > counts[il][cold].max()
    llm.close()


def test_activation_order_beyond_ten_layers(tmp_path):
    from powerinfer_py.formats import pt_io

    counts = [np.full(8, i, dtype=np.float32) for i in range(12)]
    pt_io.write_activation_dir(tmp_path, counts)
    got = pt_io.read_activation_dir(tmp_path, n_layer=12)
    assert [int(c[0]) for c in got] == list(range(12))  # not 0, 1, 10, 11, 2, ...


def test_pickle_payload_refused(tiny, tmp_path):
    """A crafted activation file that would run code when unpickled is refused unrun."""
    import pickle
    import zipfile

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    act = tmp_path / "activation"
    act.mkdir()
    for i in range(3):
        with zipfile.ZipFile(act / f"activation_{i}.pt", "w") as z:
            z.writestr("archive/data.pkl", pickle.dumps(Payload(), protocol=2))
            z.writestr("archive/version", "3\n")
    with pytest.raises(ValueError):
        _load(tiny["tiny-q8"], budget=0.01, emulate=True, activation_dir=str(act))
    assert not marker.exists()


# ---- a real device (scripts/gpu_check.sh); skipped where ggml has no GPU backend ----------

@pytest.mark.skipif(not _has_gpu(), reason="the installed ggml has no GPU backend")
@pytest.mark.parametrize("name", ["tiny", "tiny-q8"])
def test_gpu_split_matches_cpu(tiny, name):
    path = tiny[name]
    ref = _load(path)
    ref_tokens, ref_logits = _greedy(ref)
    ref.close()
    scale = np.abs(ref_logits).max()
    for budget in (0.002, 0.004, 1.0):
        llm = _load(path, budget=budget, reset_gpu_index=True)
        p = llm.placement()
        tokens, logits = _greedy(llm)
        llm.close()
        assert p["active"] and not p["emulated"] and p["bytes_total"] <= p["budget"], p
        # The device's matmuls quantize activations (Q8_1) where the CPU path does not.
        assert tokens[:8] == ref_tokens[:8]
        assert np.max(np.abs(logits[:8] - ref_logits[:8])) <= 5e-2 * scale


# ---- the benchmark script runs and reports within budget (emulated here) -----------------

def test_bench_hybrid_prints_table(tmp_path, capsys):
    from powerinfer_py.bench import hybrid as bench_hybrid

    paths = generate(PRESETS["small"], tmp_path, progress=False)
    out = tmp_path / "bench.json"
    rc = bench_hybrid.main(["--dense", paths["dense"], "--powerinfer", paths["powerinfer"], "--n-gen", "4",
                            "--budgets", "0.5,0.75,1.0", "--n-prompt", "48", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    # Each row: the decode and the prompt speedup.
    assert "| budget |" in text and text.count("x |") == 6
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["fraction"] for r in rows] == [0.5, 0.75, 1.0]
    for r in rows:
        pl = r["powerinfer"]["placement"]
        assert pl["bytes_total"] <= pl["budget"] == r["budget"]
        assert r["powerinfer"]["prompt_tok_s"] > 0 and r["llama_cpp"]["prompt_tok_s"] > 0
    assert rows[-1]["powerinfer"]["placement"]["n_hot"] > 0  # the whole model's size leaves room for rows


def test_place_command_then_cli_reuses_cache(tiny, tmp_path):
    """`powerinfer place` (which can read .pt counts) writes the cache; `main` with the
    same budget, context and batch reuses it."""
    import subprocess
    import sys

    from powerinfer_py.formats import pt_io

    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(tiny["tiny-q8"], path)
    n_ff = PRESETS["tiny-q8"].n_ff
    counts = [np.arange(n_ff, dtype=np.float32)[::-1].copy() for _ in range(3)]  # neuron 0 hottest
    pt_io.write_activation_dir(tmp_path / "act", counts)
    args = ["--vram-budget", "0.0025", "-c", "256", "-b", "32"]
    out = subprocess.run([sys.executable, "-m", "powerinfer_py.pipeline.cli", "place", str(path), "--activation",
                          str(tmp_path / "act"), "--emulate-device", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "FFN neurons on the device" in out.stdout and Path(str(path) + ".generated.gpuidx").exists()
    cli = Path(__file__).resolve().parent.parent / "build" / "bin" / "main"
    run = subprocess.run([str(cli), "-m", str(path), "--emulate-device", *args, "-p", "the cat", "-n", "4", "-v"],
                         capture_output=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert b"from the gpuidx cache" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "powerinfer_py.pipeline.cli", "place", str(tmp_path / "missing.gguf"),
                          "--vram-budget", "1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "no such file" in bad.stderr


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_split_q4_0_model(tmp_path, mode):
    """Q4_0 (whose dense weights the CPU backend repacks): the device copies must come from
    the file's row layout. Kernel-order differences under 8-bit activation quantization
    move logits by about 1% of their scale, which can flip a near-tie between two tokens
    of a random synthetic model, so the split model is fed the reference's tokens and its
    logits are compared at every step; its own greedy choice may differ only at a near-tie."""
    path = generate(PRESETS["small"], tmp_path, progress=False)["powerinfer"]
    ref = _load(path, mode)
    ref_tokens, ref_logits = _greedy(ref)
    ref.close()
    fixed, ffn = _fixed_and_ffn(path, mode)
    for share in (0.5, 1.0):
        llm = _load(path, mode, budget=(fixed + int(share * ffn) + (64 << 10)) / 2**30, emulate=True, reset_gpu_index=True)
        logits = _logits_along(llm, ref_tokens)
        p = llm.placement()
        llm.close()
        assert p["n_hot"] > 0 and p["bytes_total"] <= p["budget"]
        scale = np.max(np.abs(ref_logits))
        err = np.max(np.abs(logits - ref_logits)) / scale
        assert err <= 0.03, (share, err)
        for step, (row, ref_row) in enumerate(zip(logits, ref_logits)):
            if int(np.argmax(row)) != ref_tokens[step]:  # only where the reference's top two are within 2 x the tolerance
                top2 = np.sort(ref_row)[-2:]
                assert top2[1] - top2[0] <= 2 * 0.03 * scale, (share, step)


def test_later_contexts_count_in_the_budget(tiny):
    """A second context on a placed model puts its own compute buffers on the device: they
    count against the budget, a context that does not fit is refused with a clear error,
    and freeing a context gives its room back."""
    from powerinfer_py._core import Context, Model, PowerInferError

    path = tiny["tiny-q8"]
    fixed, ffn = _fixed_and_ffn(path, "predictor")
    ctx_kw = dict(n_ctx=256, n_batch=32, n_threads=2)
    budget = fixed + ffn // 2 + (256 << 10)
    model = Model(path, sparse_mode=lib.POWERINFER_SPARSE_PREDICTOR, vram_budget_bytes=budget, emulate_device=True,
                  reset_gpu_index=True)
    try:
        first = Context(model, **ctx_kw)
        p1 = first.placement()
        assert p1["active"] and p1["bytes_total"] <= budget
        left = budget - p1["bytes_total"]
        # a context whose compute buffers need more than what is left: refused
        with pytest.raises(PowerInferError, match="compute buffers need .* MiB left"):
            Context(model, n_ctx=256, n_batch=256, n_threads=2)
        # a small one fits, and is counted
        second = Context(model, n_ctx=256, n_batch=1, n_threads=2)
        p2 = second.placement()
        assert p1["bytes_total"] < p2["bytes_total"] <= budget, (p1, p2, left)
        assert p2["bytes_compute"] > p1["bytes_compute"]
        second.close()
        assert first.placement()["bytes_total"] == p1["bytes_total"]
        # the first context's size does not fit next to it; without the first context (its
        # KV cache and compute buffers gone) it does
        with pytest.raises(PowerInferError, match="compute buffers need"):
            Context(model, **ctx_kw)
        first.close()
        third = Context(model, **ctx_kw)
        p3 = third.placement()
        assert p3["bytes_kv"] == 0 and p3["bytes_total"] <= budget, p3
        third.close()
    finally:
        model.close()


def test_ffn_rows_placed_when_the_kv_cache_does_not_fit(tiny):
    """docs/hybrid.md: FFN rows need every dense class on the device, not the KV cache;
    when the cache does not fit, the rows use the room that is left. A budget of the
    dense classes, the
    compute buffers and a quarter of the rows holds rows but not the cache."""
    path = tiny["tiny-q8"]
    fixed, ffn = _fixed_and_ffn(path, "predictor")
    full = _load(path, budget=1.0, emulate=True, reset_gpu_index=True)
    kv = full.placement()["bytes_kv"]
    full.close()
    budget = fixed - kv + ffn // 4 + (64 << 10)
    llm = _load(path, budget=budget / 2**30, emulate=True, reset_gpu_index=True)
    p = llm.placement()
    llm.close()
    assert p["bytes_kv"] == 0 and p["n_hot"] > 0 and p["bytes_total"] <= p["budget"], p
