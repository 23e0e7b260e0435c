"""The ggml backend module (src/powerinfer_accel/) on a MoE model: MUL_MAT_ID per expert.

The model is a tiny qwen3moe (powerinfer_py.assets.synthetic.generate_qwen3moe: 2 layers,
8 experts of which 2 are used, Q4_0 gate/up and Q8_0 down expert stacks, Q8_0 attention),
run by llama-cpp-python's libllama; copies of it carry per-tensor thresholds for the expert
stacks and the attention matrices, and the module, armed with a copy, runs them.

How close the module must be to ggml. Both quantize a matrix's input to 8 bits per block of
32 (step amax / 127, round half away) and sum integers against the weights' own integers;
ggml keeps the step as f16, the module as f32. So a product differs from numpy's product of
the dequantized weights with the same Q8_0-quantized kept inputs (gguf.quants, ggml's
quantizer) by that rounding of the step, at most 2^-11 of a block's part, plus f32
summation: 2e-4 to 3.4e-4 of the result's norm measured, PRODUCT_RTOL = 2e-3 allowed. The
inputs' own 8-bit rounding moves a product by 0.7% to 0.9% against float inputs (checked
below 2%), and a kept set 10% off the threshold by 3% or more (checked above 5x
PRODUCT_RTOL): a wrong kept set is caught a hundred times over.

End to end, a difference that small is amplified: every later input re-rounds to 8 bits,
and a router near a tie may pick another expert. This model's own answer to a perturbation
of that size, storing the KV cache in F32 rather than F16 (a 2^-12 rounding), is measured in
the test and bounds the module's distance from llama-cpp-python at threshold 0.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import pytest

import ggml_capture

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

N_THREADS = 2
PROMPT = [1, 128, 139, 203, 255, 12, 41, 221]  # greedy margins of at least 1.0 over 16 steps
N_GREEDY = 16
PRODUCT_RTOL = 2e-3


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from powerinfer_py.assets.synthetic import generate_qwen3moe

    return generate_qwen3moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def weights(moe_model) -> Dict[str, np.ndarray]:
    """The matrices the module runs, dequantized: name -> [n_expert,] n_out, n_in."""
    from powerinfer_py.formats.gguf_io import open_gguf, tensor_f32

    return {t.name: tensor_f32(t) for t in open_gguf(moe_model).tensors if _sparse_candidate(t.name)}


def _sparse_candidate(name: str) -> bool:
    return "_exps." in name or any(f".{k}.weight" in name for k in ("attn_q", "attn_k", "attn_v", "attn_output"))


def _with_thresholds(src: str, dst: str, thresholds: Dict[str, float]) -> str:
    from powerinfer_py.pipeline.libllama import write_tensor_thresholds

    write_tensor_thresholds(src, dst, list(thresholds), list(thresholds.values()), {}, {}, progress=False)
    return dst


# ---------------------------------------------------------------- greedy through llama_cpp.Llama


def _greedy(path: str, tag=None, **kw):
    """Greedy tokens and their logits; with the module's tag, also the weights it placed and
    the records of tensors placed unarmed, tag 0 (read before the model, whose buffers hold
    the records, is freed)."""
    from powerinfer_py._core import accel

    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=N_THREADS, logits_all=True, verbose=False, **kw)
    try:
        llm.eval(PROMPT)
        tokens, logits = [], []
        for _ in range(N_GREEDY):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            logits.append(row)
            tokens.append(int(row.argmax()))
            llm.eval([tokens[-1]])
        return tokens, np.array(logits), (accel.weights(tag) + accel.weights(0) if tag is not None else None)
    finally:
        llm.close()


def test_threshold_zero_gives_llama_cpp_greedy_tokens(moe_model, weights, tmp_path):
    from powerinfer_py._core import accel

    ref_tokens, ref_logits, _ = _greedy(moe_model)
    assert len(set(ref_tokens)) >= N_GREEDY // 2, f"degenerate greedy text {ref_tokens}"
    _, kv_logits, _ = _greedy(moe_model, type_k=0, type_v=0)  # F32 KV cache: the model's sensitivity

    copy = _with_thresholds(moe_model, str(tmp_path / "t0.gguf"), {n: 0.0 for n in weights})
    with accel.armed(copy) as (tag, n_rules):
        tokens, logits, placed = _greedy(copy, tag)
    assert n_rules == len(weights) == 14
    # the weights, and no record of the compute buffers' nodes (they piled up at each graph
    # allocation: two here, the prompt's and a token's)
    assert len(placed) == len({w["name"] for w in placed}) == 26, [w["name"] for w in placed]
    placed = {w["name"]: w for w in placed}
    for name in weights:
        w = placed[name]
        assert w["sparse"] and w["n_mats"] == (8 if "_exps" in name else 1), w
        # threshold 0 keeps every nonzero input: all but the weights' exact zeros after a norm
        assert w["n_active"] >= 0.99 * w["n_total"] > 0, w
    assert tokens == ref_tokens

    def rel(a):
        return np.linalg.norm(a - ref_logits, axis=1) / np.linalg.norm(ref_logits, axis=1)

    ours, kv = np.median(rel(logits)), np.median(rel(kv_logits))
    # measured: 0.010 for the module, 0.016 for the F32 KV cache
    assert ours <= max(2 * kv, 0.005), (rel(logits), rel(kv_logits))


# ---------------------------------------------------------------- each product against numpy


def _q8(x: np.ndarray) -> np.ndarray:
    """x through ggml's Q8_0 (8 bits per block of 32, f16 step) and back."""
    q = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), q), q).reshape(x.shape)


def _reference(w: np.ndarray, x: np.ndarray, ids, thr: float, quantize: bool = True) -> np.ndarray:
    """numpy's product over the kept inputs |x| > thr, per token (and per routed expert):
    MUL_MAT x [1, 1, T, n_in] -> [1, 1, T, n_out]; MUL_MAT_ID x [1, T, 1 or k, n_in],
    ids [1, 1, T, k] -> [1, T, k, n_out], expert ids[t, s]'s matrix for slot s of token t."""
    kept = np.where(np.abs(x) > thr, x, 0).astype(np.float32)
    if quantize:
        kept = _q8(kept)
    if ids is None:
        return kept @ w.T
    T, k = ids.shape[-2:]
    y = np.zeros((1, T, k, w.shape[1]), np.float32)
    for t in range(T):
        for s in range(k):
            y[0, t, s] = w[ids[0, 0, t, s]] @ kept[0, t, s if kept.shape[2] > 1 else 0]
    return y


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("share", [0.0, 0.4])
def test_products_are_numpys_of_the_kept_columns(moe_model, weights, tmp_path, share):
    """Every sparse product of a prompt batch (8 tokens: experts get 1 to 8 rows each), of
    one decoded token, and of a batch of 40 (above the module's max of 32: ggml's matmuls on
    the input under the rule, accel.c masked_compute): threshold 0, and the 40% quantile of
    each weight's |x| on the dense run."""
    from powerinfer_py._core import accel

    batches = [PROMPT, [17], [(37 * i + 5) % 256 for i in range(40)]]
    if share == 0.0:
        thresholds = {n: 0.0 for n in weights}
    else:
        # (the shares the counters see: the sparse steps', the first two batches)
        dense = ggml_capture.capture(moe_model, batches[:2], weights.__contains__, n_threads=N_THREADS)
        assert {node.weight for node in dense} == set(weights)
        xs: Dict[str, list] = {}
        for node in dense:
            xs.setdefault(node.weight, []).append(np.abs(node.x).ravel())
        thresholds = {n: float(np.quantile(np.concatenate(v), share)) for n, v in xs.items()}
    copy = _with_thresholds(moe_model, str(tmp_path / "thr.gguf"), thresholds)
    stats: Dict[str, float] = {}
    with accel.armed(copy) as (tag, _):
        nodes = ggml_capture.capture(copy, batches, weights.__contains__, n_threads=N_THREADS,
                                     before_free=lambda: stats.update(accel.sparse_stats(tag)["weights"]))
    assert sorted(node.weight for node in nodes) == sorted(list(weights) * 3)
    n_id = 0
    for node in nodes:
        op, name, x, ids, y = node.op, node.weight, node.x, node.ids, node.y
        w, thr = weights[name], thresholds[name]
        assert op == ("MUL_MAT_ID" if w.ndim == 3 else "MUL_MAT"), (op, name)
        n_id += op == "MUL_MAT_ID"
        ref = _reference(w, x, ids, thr)
        err = _rel(y, ref)
        assert err <= PRODUCT_RTOL, f"{name} ({op}, {x.shape}): {err:.2e} from numpy's product of the kept columns"
        # the 8-bit inputs: a little from the float product of the same columns
        assert _rel(y, _reference(w, x, ids, thr, quantize=False)) < 0.02, name
        if share:
            # another kept set: far more than the tolerance
            assert _rel(_reference(w, x, ids, thr * 1.1), ref) > 5 * PRODUCT_RTOL, name
    assert n_id == 3 * 6  # 3 batches x 2 layers x gate, up, down
    for name in weights:
        kept = stats[name]
        assert (kept >= 0.99) if share == 0.0 else (0.5 <= kept <= 0.7), (name, kept)
