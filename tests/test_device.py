"""Hybrid placement on a real local GPU backend: whatever ggml's registry lists as a GPU
(Vulkan, CUDA, ROCm). Skipped when it lists none, as in an ordinary CPU test run; CI runs
this file in a child pytest with ggml's Vulkan backend loaded on Mesa's software Vulkan
(lavapipe): tests/test_vulkan_backend.py::test_the_device_tests_pass_on_vulkan. On a
machine with a GPU the same tests run unchanged.

The reference is our own CPU-only run of the same file in the same process (vram_budget=0,
no device), itself checked against llama-cpp-python elsewhere. The device computes the
dense classes with its own kernels; the cold neurons stay on the CPU's sparse operators
(custom ops that no device supports: the scheduler keeps them on the CPU).

Speed on lavapipe means nothing: nothing here times anything."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from powerinfer_py import Llama, ParallelLlama
from powerinfer_py._core.devices import gpu_count
from powerinfer_py.assets.synthetic import PRESETS, generate

from conftest import greedy_with_logits, logits_along

pytestmark = pytest.mark.skipif(gpu_count() == 0, reason="ggml lists no GPU (load a backend: docs/hybrid.md#vulkan)")

PROMPT = "The capital of France is"
SYN_PROMPT = "the cat sat on the mat and"
N_GEN = 12


def _load(path, **kw):
    kw.setdefault("vram_budget", 0.0)
    return Llama(model_path=str(path), n_ctx=256, n_batch=32, n_threads=2, verbose=False, **kw)


def _greedy(llm, prompt, n=N_GEN):
    return greedy_with_logits(llm, prompt, n)


def _check_device(p):
    assert p["active"] and not p["emulated"], p
    for d in p["devices"]:
        assert not d["rpc"] and not d["emulated"], d
        assert 0 < d["bytes_total"] <= d["budget"] <= d["memory_total"], d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    return {name: generate(PRESETS[name], out, progress=False)["powerinfer"] for name in ("tiny", "tiny-q8")}


def test_a_dense_model_split_by_layers(smollm2_path):
    """SmolLM2 (Q4_1) with every layer on the device (-ngl -1): the device's quantized
    matmuls keep activations in f32 where the CPU quantizes them to Q8, about 2% of the
    logit scale (measured 2.2% on lavapipe); the tokens follow the CPU's but for a near-tie."""
    with _load(smollm2_path) as ref:
        assert not ref.placement()["active"]
        ref_tokens, ref_logits = _greedy(ref, PROMPT)
    with _load(smollm2_path, vram_budget=None, n_gpu_layers=-1) as llm:
        p = llm.placement()
        logits = logits_along(llm, PROMPT, ref_tokens)
        tokens, _ = _greedy(llm, PROMPT)
    _check_device(p)
    assert p["layer_split"] and p["n_layers_attn"] == 30, p
    scale = np.abs(ref_logits).max()
    assert np.max(np.abs(logits - ref_logits)) <= 5e-2 * scale
    for step, (row, ref_row) in enumerate(zip(logits, ref_logits)):
        if int(np.argmax(row)) != ref_tokens[step]:
            top2 = np.sort(ref_row)[-2:]
            assert top2[1] - top2[0] <= 2 * 5e-2 * scale, step
    assert tokens[:4] == ref_tokens[:4]


def test_a_partial_layer_split_within_a_small_budget(smollm2_path):
    """A budget that holds only part of the layers: the compute buffers the scheduler lays
    out with the CPU's layers (op offload copies their weights to the device for a batch)
    are larger than the CPU-only estimate; the placement solves again reserving them and
    stays within the budget instead of giving up."""
    with _load(smollm2_path, vram_budget=0.05, n_gpu_layers=-1) as llm:
        p = llm.placement()
        text = llm.create_completion(PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"]
    _check_device(p)
    assert 0 < p["n_layers_attn"] < 30, p
    assert "Paris" in text


@pytest.mark.parametrize("mode", ["dense", "gate", "predictor"])
@pytest.mark.parametrize("name", ["tiny", "tiny-q8"])
def test_the_hybrid_split_gives_the_cpu_tokens(tiny, name, mode):
    """PowerInfer's split on the device: dense classes, the KV cache and the hottest neurons
    there, the cold ones on the CPU. F32: greedy tokens identical, logits within float
    rounding; Q8_0: within the bound of the device's down rows requantized to Q8_0."""
    path = tiny[name]
    with _load(path, sparse_mode=mode) as ref:
        ref_tokens, ref_logits = _greedy(ref, SYN_PROMPT)
    llm = None
    for kib in range(64, 4096, 32):
        llm = _load(path, sparse_mode=mode, vram_budget=kib / 2**20, reset_gpu_index=True)
        p = llm.placement()
        if p["active"] and (mode == "dense" or 0 < p["n_hot"] < p["n_neurons"]):
            break
        llm.close()
    else:
        pytest.fail(f"no budget splits {name} in {mode} mode")
    with llm:
        tokens, logits = _greedy(llm, SYN_PROMPT)
    _check_device(p)
    assert not p["layer_split"], p
    assert tokens == ref_tokens
    tol = 1e-4 if name == "tiny" else 3e-2
    assert np.max(np.abs(logits - ref_logits)) <= tol * np.abs(ref_logits).max()


def test_the_budget_is_never_exceeded(tiny):
    """From a few KiB to more than the model: what the device holds (its buffers' sizes:
    dense copies, KV cache, compute buffers, FFN rows) never passes the budget."""
    path = tiny["tiny-q8"]
    for kib in (1, 64, 256, 512, 1024, 4096, 1 << 20):
        with _load(path, sparse_mode="predictor", vram_budget=kib / 2**20, reset_gpu_index=True) as llm:
            p = llm.placement()
            assert llm.create_completion("the cat", max_tokens=2, temperature=0)["choices"][0]["text"] is not None
        assert p["bytes_total"] <= max(p["budget"], 0), (kib, p)
        for d in p["devices"]:
            assert d["bytes_total"] == d["bytes_dense"] + d["bytes_kv"] + d["bytes_compute"] + d["bytes_ffn"], d
            assert d["bytes_total"] <= d["budget"], (kib, d)


def test_a_budget_above_the_devices_memory_is_clamped(tiny):
    """An 8 GiB budget on a 6 GiB card means "as much as it has": the budget is clamped to
    what the device reports free, less the margin (docs/hybrid.md)."""
    with _load(tiny["tiny"], sparse_mode="predictor", vram_budget=1 << 20, reset_gpu_index=True) as llm:
        p = llm.placement()
    _check_device(p)
    (d, *_) = p["devices"]
    assert d["budget"] < d["memory_total"] and d["budget"] < 1 << 50, d
    assert p["n_hot"] == p["n_neurons"], p


def test_parallel_slots_on_the_device(smollm2_path):
    """A ParallelLlama on a model on the device: its context's KV cache follows the plan
    there; concurrent streams complete and each gives the text its stream gives alone
    (the device may sum a batch of streams in another order, so the check is on the text
    of short greedy answers, as a user sees them)."""
    prompts = ["The capital of France is", "The three primary colors are"]
    with _load(smollm2_path, vram_budget=None, n_gpu_layers=-1, flash_attn=True) as llm, \
            ParallelLlama(llm, n_parallel=2) as pool:
        def ask(q):
            with pool.slot() as slot:
                slot.reset()
                return slot.create_completion(q, max_tokens=6, temperature=0)["choices"][0]["text"]

        solo = [ask(q) for q in prompts]
        together = list(ThreadPoolExecutor(2).map(ask, prompts))
        p = llm.placement()
    _check_device(p)
    assert together == solo
    assert "Paris" in solo[0]


def test_the_hybrid_benchmark_runs_on_the_device(tmp_path, capsys):
    """`bench hybrid --emulate no` on the small synthetic pair: our placement and
    llama-cpp-python's n_gpu_layers on the same device, each within the budget. Its speeds
    mean nothing on lavapipe; this only keeps the benchmark working on a device."""
    import json

    from powerinfer_py.bench import hybrid as bench_hybrid

    paths = generate(PRESETS["small"], tmp_path, progress=False)
    out = tmp_path / "bench.json"
    rc = bench_hybrid.main(["--dense", paths["dense"], "--powerinfer", paths["powerinfer"], "--n-gen", "4",
                            "--budgets", "0.5,1.0", "--emulate", "no", "--json", str(out)])
    assert rc == 0
    assert "| budget |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        pl = r["powerinfer"]["placement"]
        assert pl["active"] and not pl["emulated"] and pl["bytes_total"] <= pl["budget"] == r["budget"], pl
