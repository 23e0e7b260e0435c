"""Llama's embedding family (embedding=True): the final-norm hidden states of the core,
pooled the way llama.cpp pools them.

Pooling NONE (a decoder model's default) gives one vector per token, as llama.cpp's
t_embd: the hidden state after the output norm, before the LM head. MEAN averages
them over the input, CLS takes the first token's, LAST the last token's.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import numpy as np

POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST, POOLING_RANK = 0, 1, 2, 3, 4


def _normalize(x: np.ndarray) -> np.ndarray:
    """Unit L2 norm along the last axis, in float64 as upstream (zero vectors are left alone)."""
    x = x.astype(np.float64)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm == 0.0, 1.0, norm)


def _hidden_states(llama: Any, tokens: List[int]) -> np.ndarray:
    """float32 [n_tokens, n_embd]: the final-norm hidden state after each token (from position 0)."""
    seq = llama._seq
    seq.reset()
    seq.check_window(0, len(tokens))
    llama._ctx.decode(tokens, 0, True)
    return llama._ctx.embeddings(0, len(tokens)).copy()


def embed(
    llama: Any,
    input: Union[str, List[str]],
    normalize: bool = False,
    truncate: bool = True,
    return_count: bool = False,
):
    """Llama.embed: one input at a time (upstream packs several into one batch; the
    vectors are the same, since each input attends only to itself)."""
    llama._require_ctx()
    if not llama.context_params.embeddings:
        raise RuntimeError("Llama model must be created with embedding=True to call this method")
    pooling = llama.pooling_type()
    if pooling not in (POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST):
        raise ValueError(f"pooling type {pooling} is not supported by the powerinfer engine")
    n_batch = llama.n_batch
    inputs = [input] if isinstance(input, str) else input

    if llama.verbose:
        llama.reset_timings()
    data: list = []
    total_tokens = 0
    try:
        for text in inputs:
            tokens = llama.tokenize(text.encode("utf-8"))
            if truncate:
                tokens = tokens[:n_batch]
            n_tokens = len(tokens)
            if n_tokens > n_batch:
                raise ValueError(f"Requested tokens ({n_tokens}) exceed batch size of {n_batch}")
            if n_tokens == 0:
                raise ValueError("cannot embed an empty input (it has no tokens)")
            total_tokens += n_tokens
            hidden = _hidden_states(llama, tokens)
            if pooling == POOLING_NONE:
                data.append((_normalize(hidden) if normalize else hidden).tolist())
                continue
            if pooling == POOLING_MEAN:
                vector = hidden.mean(axis=0, dtype=np.float64).astype(np.float32)
            elif pooling == POOLING_CLS:
                vector = hidden[0]
            else:
                vector = hidden[-1]
            data.append((_normalize(vector) if normalize else vector).tolist())
    finally:
        llama.reset()
    if llama.verbose:
        llama.print_timings()

    output = data[0] if isinstance(input, str) else data
    if return_count:
        return output, total_tokens
    return output


def create_embedding(llama: Any, input: Union[str, List[str]], model: Optional[str] = None):
    """Llama.create_embedding: embed() in the OpenAI response shape."""
    model_name: str = model if model is not None else llama.model_path
    input = input if isinstance(input, list) else [input]
    embeds, total_tokens = embed(llama, input, return_count=True)
    data = [{"object": "embedding", "embedding": emb, "index": idx} for idx, emb in enumerate(embeds)]
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": total_tokens, "total_tokens": total_tokens},
    }
