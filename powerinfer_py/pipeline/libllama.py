"""`sparsify` and `eval` for every architecture libllama runs (gemma3, qwen3, MoE, ...):
the model runs on llama-cpp-python's engine with the module (docs/accel.md) inside it.

- Calibration: the module in calibrate mode takes every matmul weight that has a column form
  (experts included) and counts |x| at each one's input over the calibration text.
- Allocation: each weight tensor is one item of the greedy allocation (sparsify.allocate):
  its bytes, and the share of its products' energy each sparsity drops. The measured
  allocation needs the core's graph (it sets thresholds on a live context per layer and
  kind), so here it is the greedy one, and the file says so.
- The file: the input unchanged plus `powerinfer.tensor_thresholds.names` / `.values`
  (docs/formats.md), which the module reads when the file is loaded.
- The card (evaluate.LibllamaScorer): the same figures as the core's, each mode scored by
  llama-cpp-python's engine (input: with the module armed), the kept share per layer from
  the module's counters.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from .._core import accel
from ..formats.gguf_io import copy_kv, finish, new_writer, open_gguf
from .common import PipelineError, run_chunks, same_file

KEY_NAMES = "powerinfer.tensor_thresholds.names"
KEY_VALUES = "powerinfer.tensor_thresholds.values"


def native(model_path: str) -> bool:
    """Whether the core builds this file's architecture (else libllama runs it)."""
    field = open_gguf(model_path).get_field("general.architecture")
    if field is None:
        raise PipelineError(f"{model_path}: no general.architecture (not a model file)")
    return accel.core_builds(str(field.contents()))


def n_layer(model_path: str) -> int:
    r = open_gguf(model_path)
    arch = str(r.get_field("general.architecture").contents())
    field = r.get_field(f"{arch}.block_count")
    if field is None:
        raise PipelineError(f"{model_path}: no {arch}.block_count (not a model this engine runs)")
    return int(field.contents())


def _llama(model_path: str, n_ctx: int, batch: int, threads: int, logits_all: bool = False):
    import llama_cpp

    return llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=threads,
                           n_threads_batch=threads, logits_all=logits_all, verbose=False)


def tensor_histograms(model_path: str, texts: Sequence[str], n_tokens: int, threads: int = 2, chunk: int = 256,
                      progress: bool = True) -> Tuple[List[str], np.ndarray, float, float, np.ndarray, int]:
    """Histograms of |x| at every matmul weight's input over up to n_tokens calibration tokens:
    (names, counts [n, bins], log10 min, log10 max, bytes [n], tokens used)."""
    with accel.armed(None, accel.CALIBRATE) as (tag, _):
        llm = _llama(model_path, chunk, chunk, threads)
    try:
        def run(c: List[int]) -> None:
            llm.reset()
            llm.eval(c)

        used = run_chunks(lambda t: llm.tokenize(t.encode(), add_bos=True, special=False), run, texts, n_tokens, chunk,
                          True, progress)
        weights = [w for w in accel.weights(tag) if w["calibrated"]]
        if not weights:
            raise PipelineError(f"{model_path}: no matmul weight of a type the sparse kernels take "
                                "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)")
        names = [w["name"] for w in weights]
        hists = [accel.histogram(tag, n) for n in names]
    finally:
        llm.close()
    counts = np.stack([h[0] for h in hists])
    # the bytes a token reads: of an expert stack (MUL_MAT_ID), the share of its experts in use
    share = expert_share(model_path)
    nbytes = np.array([w["bytes"] * (share if w["n_mats"] > 1 else 1.0) for w in weights], dtype=np.float64)
    return names, counts, hists[0][1], hists[0][2], nbytes, used


def expert_share(model_path: str) -> float:
    """Experts a token uses over experts a layer has (1 for a model without experts)."""
    r = open_gguf(model_path)
    arch = str(r.get_field("general.architecture").contents())
    n_exp, n_used = r.get_field(f"{arch}.expert_count"), r.get_field(f"{arch}.expert_used_count")
    if n_exp is None or n_used is None or int(n_exp.contents()) <= 0:
        return 1.0
    return float(n_used.contents()) / float(n_exp.contents())


def write_tensor_thresholds(src: str, dst: str, names: Sequence[str], taus: Sequence[float], floats: Dict[str, float],
                            strings: Dict[str, str], progress: bool = True) -> None:
    """Copies src to dst (every key and tensor) adding a threshold per weight tensor, and the
    keys `floats` and `strings` (in place of any the file has)."""
    if same_file(src, dst):
        raise PipelineError("the output must not be the input file")
    reader = open_gguf(src)
    w = new_writer(dst, reader.get_field("general.architecture").contents())
    copy_kv(reader, w, skip={KEY_NAMES, KEY_VALUES, *floats, *strings})
    w.add_array(KEY_NAMES, list(names))
    w.add_array(KEY_VALUES, [float(t) for t in taus])
    for k, v in floats.items():
        w.add_float32(k, float(v))
    for k, v in strings.items():
        w.add_string(k, v)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    finish(w, dst, progress=progress, inputs=[src])
