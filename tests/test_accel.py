"""The sparse module inside libllama (src/powerinfer_accel/, docs/accel.md), on the real
SmolLM2 (llama arch, Q4_1, tied output) run by llama-cpp-python's own engine.

Each matmul the module runs is read back inside libllama (tests/ggml_capture.py: the
context's eval callback) and compared with numpy on the node's own input: the product
over the entries |x| > threshold of each token, with the weights gguf dequantizes. The
kernel quantizes the kept entries to 8 bits per block (32 columns, 256 for K-quants; step
d = amax / 127) as ggml's dot products do, so a row may differ from the exact product by
at most sum_j |w_j| * d_j / 2 over its kept entries (plus float rounding): the bound the
tests use, row by row. Dropping the wrong entries would cost the difference between the
kept and the full products, which the tests show is far above that bound."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Dict

import numpy as np
import pytest

import ggml_capture
from powerinfer_py.bench.common import upstream_last_logits
from powerinfer_py._core import accel
from powerinfer_py.pipeline import libllama
from powerinfer_py.pipeline.sparsify import INPUT_TENSORS, INPUTS, sparsify_libllama, write_sparse_model

K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}
TEXT = ("The river rose in the spring and the farmers moved their sheep to the hills. "
        "In the town the bakers opened before dawn, and the smell of bread filled the streets. ") * 60


@pytest.fixture(scope="module")
def sparse40(smollm2_path, tmp_path_factory):
    """SmolLM2 sparsified through libllama (the module's calibration, the per-tensor greedy
    allocation) at 40% of the bytes, on 512 tokens of text."""
    d = tmp_path_factory.mktemp("accel")
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT)
    out = d / "smollm2.input40.gguf"
    r = sparsify_libllama(smollm2_path, str(out), 0.4, [str(corpus)], 0, 512, "greedy", 2, progress=False)
    return str(out), r


def _thresholds(path):
    import gguf

    r = gguf.GGUFReader(path)
    names = r.get_field(libllama.KEY_NAMES).contents()
    return dict(zip(names, r.get_field(libllama.KEY_VALUES).contents())), {t.name: t.tensor_type.name for t in r.tensors}


def _bound(w, x, tau, block):
    """Per token and row, the most the 8-bit quantization of the kept entries can move the
    product: sum_j |w_j| * d_j / 2, d = amax / 127 of the kept entries of j's block."""
    xk = np.where(np.abs(x) > tau, np.abs(x), 0.0)
    T, n = xk.shape
    d = np.repeat(xk.reshape(T, n // block, block).max(axis=2) / 127.0, block, axis=1)
    return (d / 2 * (xk > 0)) @ np.abs(w).T


def _margins(model_path, nodes, thr, types):
    """Checks every captured node against numpy's product over its kept entries (within
    _bound), and returns per node how far the full product is from the kept one, in units of
    the node's distance from the kept one."""
    deq = ggml_capture.dequantized(model_path)
    margins = []
    for nd in nodes:
        w = deq(nd.weight).astype(np.float64)
        x = nd.x.reshape(-1, nd.x.shape[-1]).astype(np.float64)
        y = nd.y.reshape(-1, nd.y.shape[-1]).astype(np.float64)
        tau = float(thr[nd.weight])
        ref = ggml_capture.kept_product(w, x, tau)
        bound = _bound(w, x, tau, 256 if types[nd.weight] in K_QUANTS else 32)
        err = np.abs(y - ref)
        assert (err <= bound + 1e-5 * np.abs(ref) + 1e-6).all(), (nd.weight, float((err - bound).max()))
        margins.append(np.linalg.norm(ref - x @ w.T) / max(np.linalg.norm(y - ref), 1e-12))
    return margins


def test_calibrated_file_and_its_products_match_numpy(smollm2_path, sparse40):
    path, r = sparse40
    thr, types = _thresholds(path)
    # the allocation spent 40% of the calibrated weights' bytes
    s, nb = r["sparsity"], r["bytes"]
    assert (s * nb).sum() / nb.sum() == pytest.approx(0.4, abs=1e-6)
    assert set(r["names"]) == set(thr) and len(thr) > 100
    sparse = {n for n, t in thr.items() if t >= 0}
    assert sparse and any(n.endswith("ffn_down.weight") for n in sparse)
    with accel.armed(path) as (tag, n_rules):
        assert n_rules == len(sparse)
        # a prompt of 5 (a batch the sparse path takes), then single tokens
        placed = []
        nodes = ggml_capture.capture(path, [[1, 2, 3, 4, 5], [6], [7]], lambda name: name in sparse,
                                     before_free=lambda: placed.extend(accel.weights(tag)))
    assert {w["name"] for w in placed if w["sparse"]} == sparse
    # the matrices reading one input have one threshold, and share one column copy (they run
    # here one node at a time, the capture asking for each: each runs the group's product)
    from powerinfer_py.pipeline.sparsify import input_key

    by_input: Dict[str, set] = {}
    for n in sparse:
        by_input.setdefault(input_key(n), set()).add(thr[n])
    assert all(len(v) == 1 for v in by_input.values()), by_input
    sizes = {w["name"]: w["group_size"] for w in placed if w["sparse"]}
    assert any(size == 3 for size in sizes.values()) and any(size == 2 for size in sizes.values()), sizes
    assert len(nodes) >= 3 * len(sparse) - 3  # every sparse weight, every step (the tied head once per step)
    # what dropping the entries changes is far above what the kernel's rounding does
    assert np.median(_margins(smollm2_path, nodes, thr, types)) > 3


def test_batches_above_the_max_keep_the_rule(smollm2_path, sparse40):
    """A batch above the module's max (32 tokens: a prompt) runs ggml's dense matmul, but on
    the input with the entries the rule drops zeroed (accel.c, masked_compute), so each token
    gets the sparse product's result up to the same 8-bit rounding: a prompt, a prompt cache
    and a reused prefix give a token the same rule. Before, such a batch ran fully dense (a
    median margin near 1 below, where the kept product is 3 and more)."""
    path, _ = sparse40
    thr, types = _thresholds(path)
    sparse = {n for n, t in thr.items() if t >= 0}
    with accel.armed(path):
        nodes = ggml_capture.capture(path, [list(range(300, 340))], lambda name: name in sparse)
    big = [nd for nd in nodes if nd.x.reshape(-1, nd.x.shape[-1]).shape[0] == 40]
    assert len(big) >= len(sparse) - 10  # every sparse weight but the last layer's (its output row alone)
    assert np.median(_margins(smollm2_path, big, thr, types)) > 3


def test_threshold_zero_matches_llama_cpp(smollm2_path, ref_llama, tmp_path):
    """Every matmul through the module with nothing dropped: llama-cpp-python's greedy
    tokens, and logits within the difference of two 8-bit input quantizations."""
    import llama_cpp

    names = [f"blk.{il}.{t}" for il in range(30) for kind in INPUTS for t in INPUT_TENSORS[kind]]
    out = tmp_path / "t0.gguf"
    libllama.write_tensor_thresholds(smollm2_path, str(out), names, [0.0] * len(names), {}, {}, progress=False)
    with accel.armed(str(out)) as (tag, n):
        llm = llama_cpp.Llama(model_path=str(out), n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    try:
        assert sum(w["sparse"] for w in accel.weights(tag)) == 30 * 7
        ours = llm("The capital of France is", max_tokens=12, temperature=0.0)["choices"][0]["text"]
        base = ref_llama("smollm2")("The capital of France is", max_tokens=12, temperature=0.0)["choices"][0]["text"]
        assert ours == base
        assert accel.sparse_stats(tag)["active"] > 0.99  # threshold 0 keeps every nonzero entry
    finally:
        llm.close()


def test_passthrough_is_bit_exact_and_a_plain_file_places_nothing(smollm2_path, sparse40):
    """The module's own cost measured apart from its kernels: the same weights placed, ggml's
    kernels on them (SmolLM2's Q4_1 is not repacked by ggml), the same logits bit for bit."""
    import llama_cpp

    path, _ = sparse40
    prompt = [1, 504, 3458, 282, 4649, 314]

    def logits(mode):
        if mode is None:
            llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=True)
            tag = None
        else:
            with accel.armed(path, mode) as (tag, _):
                llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=True)
        try:
            llm.eval(prompt)
            llm.eval([28])
            return np.array(llm.scores[: len(prompt) + 1]), accel.weights(tag) if tag else []
        finally:
            llm.close()

    base, _ = logits(None)
    through, placed = logits(accel.PASSTHROUGH)
    assert len(placed) > 100 and not any(w["sparse"] for w in placed)
    assert np.array_equal(base, through)
    # a file without thresholds (the original) arms nothing: nothing is placed
    with accel.armed(smollm2_path) as (tag, n):
        assert n == 0
        llm = llama_cpp.Llama(model_path=smollm2_path, n_ctx=64, n_threads=2, verbose=False)
        assert accel.weights(tag) == []
        llm.close()


def test_per_layer_table_of_core_files_maps_to_tensors(smollm2_path, tmp_path):
    """A file of the core's input mode (four thresholds per layer, the output matrix's apart)
    gives the module the same thresholds per tensor: the engines keep the same columns."""
    import llama_cpp

    rng = np.random.default_rng(0)
    taus = rng.uniform(0.001, 0.05, size=(31, 4)).astype(np.float32)
    taus[3, 1] = -1.0  # an input left dense
    out = tmp_path / "core.gguf"
    write_sparse_model(smollm2_path, str(out), taus, 0.3, "greedy", progress=False)
    with accel.armed(str(out)) as (tag, _):
        llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_threads=2, verbose=False)
        got = {w["name"]: w["threshold"] for w in accel.weights(tag) if w["sparse"]}
        llm.close()
    want = {f"blk.{il}.{t}": float(taus[il, i]) for il in range(30) for i, kind in enumerate(INPUTS)
            for t in INPUT_TENSORS[kind] if taus[il, i] >= 0 and t != "attn_qkv.weight"}
    want["token_embd.weight"] = float(taus[30, 0])  # the tied output matrix
    assert got == pytest.approx(want)


_GROUP_CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
from powerinfer_py._core import accel
path = sys.argv[1]
with accel.armed(path) as (tag, _):
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=2, verbose=False, logits_all=True)
llm.eval(llm.tokenize(b"The river rose in the spring and the farmers"))
rows = []
for _ in range(8):
    row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    rows.append(row.tolist())
    llm.eval([int(row.argmax())])
ws = [w for w in accel.weights(tag) if w["sparse"]]
print(json.dumps({"rows": rows, "weights": ws}))
"""


def test_matrices_sharing_an_input_share_one_copy(smollm2_path, tmp_path):
    """q/k/v and gate/up of a layer with one threshold share one column copy and run as one
    product (as in the core): the same kept columns, so the same logits as every matrix alone
    (POWERINFER_ACCEL_GROUPS=0; measured bit-identical on SmolLM2's Q4_1), shared counters."""
    import json
    import os
    import subprocess
    import sys

    taus = np.full((31, 4), 0.02, dtype=np.float32)
    taus[5, 2] = -1.0  # layer 5's gate/up dense: no group there
    out = tmp_path / "core.gguf"
    write_sparse_model(smollm2_path, str(out), taus, 0.3, "greedy", progress=False)
    runs = {}
    for groups in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", _GROUP_CHILD, str(out)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "POWERINFER_ACCEL_GROUPS": groups})
        assert r.returncode == 0, r.stderr[-2000:]
        runs[groups] = json.loads(r.stdout.strip().splitlines()[-1])
    grouped = {w["name"]: w for w in runs["1"]["weights"]}
    alone = {w["name"]: w for w in runs["0"]["weights"]}
    assert set(grouped) == set(alone)
    for name, w in grouped.items():
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        want = 3 if kind in ("attn_q", "attn_k", "attn_v") else 2 if kind in ("ffn_gate", "ffn_up") and ".5." not in name else 1
        assert w["group_size"] == want and alone[name]["group_size"] == 1, (name, w["group_size"])
        # the group's counters are the input's, as each matrix alone counts them
        assert (w["n_active"], w["n_total"]) == (alone[name]["n_active"], alone[name]["n_total"]), name
    a, b = np.array(runs["1"]["rows"]), np.array(runs["0"]["rows"])
    assert np.max(np.abs(a - b)) <= 1e-4 * np.abs(b).max(), np.max(np.abs(a - b))


def test_bad_files_are_refused(tmp_path, smollm2_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        with accel.armed(str(bad)):
            pass
    with pytest.raises(ValueError, match="no such|not a readable"):
        with accel.armed(str(tmp_path / "missing.gguf")):
            pass
    with pytest.raises(ValueError, match="max batch"):
        accel.set_max_batch(33)


def test_enable_makes_plain_llama_cpp_sparse(sparse40):
    """What a llama-cpp-python user types: one call, then their own llama_cpp.Llama."""
    path, _ = sparse40
    code = textwrap.dedent(f"""
        import llama_cpp, powerinfer_py.accel as pa
        pa.enable()
        llm = llama_cpp.Llama(model_path={path!r}, n_ctx=64, n_threads=2, verbose=False)
        llm("Once upon a time", max_tokens=8, temperature=0.0)
        st = pa.sparse_stats(llm)
        assert st["n_sparse_weights"] > 50 and 0.2 < st["active"] < 0.95, st
        print("ok", round(st["active"], 3))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_llama_cpp_tools_load_the_module_by_path(sparse40, cli_path):
    """llama.cpp's tools call ggml_backend_load_all(), which loads GGML_BACKEND_PATH: the
    module's library found that way takes the file POWERINFER_SPARSE_MODEL names and gives
    the tokens the module gives in this process (tests/c/backend_path.c does what the tools
    do at start-up, linking nothing of ours)."""
    import os
    from pathlib import Path

    import llama_cpp

    path, _ = sparse40
    build = Path(cli_path).parent.parent
    env = dict(os.environ, GGML_BACKEND_PATH=str(build / "lib" / "libggml-powerinfer.so"), POWERINFER_SPARSE_MODEL=path)
    r = subprocess.run([str(build / "bin" / "test-backend-path"), path, "8"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "device PowerInfer" in r.stdout and "PowerInfer model buffer size" in r.stderr
    tokens = [int(t) for t in r.stdout.split("tokens", 1)[1].split()]
    with accel.armed(path):  # flash attention on: the tool's default (auto), not llama-cpp-python's
        llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=2, verbose=False, flash_attn=True)
    try:
        llm.eval([1, 504, 3458, 282])
        ours = []
        for _ in range(8):
            ours.append(int(np.argmax(upstream_last_logits(llm))))
            llm.eval([ours[-1]])
    finally:
        llm.close()
    assert tokens == ours
    # without the variable, the tool runs as it always did: no module
    r = subprocess.run([str(build / "bin" / "test-backend-path"), path, "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PowerInfer" not in r.stdout


@pytest.fixture(scope="module")
def gemma40(gemma_path, tmp_path_factory):
    """Gemma-3-270M (gemma3: an architecture the core does not build), sparsified by the
    command's own path for it (sparsify -> the module's calibration) at 40%."""
    from powerinfer_py.pipeline.sparsify import sparsify

    d = tmp_path_factory.mktemp("gemma")
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT)
    out = d / "gemma.input40.gguf"
    r = sparsify(gemma_path, str(out), 0.4, [str(corpus)], n_tokens=512, allocation="measured", progress=False)
    assert r["allocation"].startswith("greedy (measured needs the core's graph")  # said, not silently changed
    return str(out)


def test_gemma_runs_sparse_through_llama_and_main(gemma_path, gemma40, cli_path, ref_llama):
    from powerinfer_py import Llama

    llm = Llama(model_path=gemma40, n_ctx=128, n_threads=2, verbose=False)
    try:
        assert llm.engine == "llama-cpp-python"
        text = llm("The capital of France is", max_tokens=16, temperature=0.0)["choices"][0]["text"]
        st = llm.sparse_stats()
        assert st["mode"] == "input" and 0.2 < st["active"] < 0.95 and st["kernels"], st
        assert text.strip()
    finally:
        llm.close()
    dense = Llama(model_path=gemma40, n_ctx=128, n_threads=2, verbose=False, sparse_mode="dense")
    try:
        assert dense.sparse_stats()["mode"] == "dense"
    finally:
        dense.close()
    r = subprocess.run([str(cli_path), "-m", gemma40, "-p", "The capital of France is", "-n", "8", "--temp", "0", "-t", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "engine      = libllama" in r.stderr and "sparse mode = input (the module:" in r.stderr
    assert r.stdout.startswith("The capital of France is") and len(r.stdout.strip()) > len("The capital of France is")
    # the core's own features are refused with a message, before anything loads
    r = subprocess.run([str(cli_path), "-m", gemma40, "-p", "hi", "-n", "1", "--vram-budget", "4"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "--vram-budget" in r.stderr


def test_bench_accel_prints_its_table(smollm2_path, sparse40, capsys):
    """`python -m powerinfer_py.bench accel` end to end: the module's pass-through and sparse
    rows against llama-cpp-python, with the byte-count ideal (speed is not judged here)."""
    from powerinfer_py.bench import accel as bench_accel

    path, _ = sparse40
    assert bench_accel.main(["--model", smollm2_path, "--sparse", path, "--n-gen", "4", "--n-prompt", "48",
                             "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "module, pass-through" in out
    decode, prompt = out.split("Prompt, 48 tokens")
    rows = [ln for ln in decode.splitlines() if ln.startswith("| ") and "module" in ln]
    assert len(rows) == 2 and "GB/s" in out and "powerinfer kernels:" in out
    ideal = float(rows[1].split("|")[6].strip().rstrip("x"))
    assert ideal > 1.1  # 40% of the bytes dropped: the ideal is well above 1
    prows = [ln for ln in prompt.splitlines() if ln.startswith("| ") and "module" in ln]
    assert len(prows) == 2 and all(float(r.split("|")[4]) > 0 for r in prows)  # a prompt speed per engine
