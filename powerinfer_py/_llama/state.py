"""Llama's state family, save_state / load_state: the context state of the core (cached keys and values,
last logits) together with the Python-side token history, in llama-cpp-python's
LlamaState, so its prompt caches (LlamaRAMCache, LlamaDiskCache) store ours unchanged."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from . import upstream

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama import LlamaState


def save_state(llama: Any) -> "LlamaState":
    ctx = llama._require_ctx()
    if llama.verbose:
        print("Llama.save_state: saving llama state", file=sys.stderr)
    # The core saves every cached position: drop those past n_tokens (stale after a
    # reset or a prefix match) so the state holds exactly input_ids[:n_tokens].
    seq = llama._seq
    if ctx.kv_pos() > seq.n_tokens:
        seq.rewind(seq.n_tokens)
    data = ctx.state_save()
    n_bytes = len(data)
    if llama.verbose:
        print(f"Llama.save_state: saving {n_bytes} bytes of llama state", file=sys.stderr)
    # Without logits_all the scores hold nothing (upstream copies the unused rows anyway).
    scores = llama._scores.copy() if llama._logits_all else np.zeros((0, llama._n_vocab), dtype=np.single)
    return upstream.llama_module().LlamaState(
        input_ids=llama.input_ids.copy(),
        scores=scores,
        n_tokens=llama.n_tokens,
        llama_state=data,
        llama_state_size=n_bytes,
        seed=llama._seed,
    )


def load_state(llama: Any, state: "LlamaState") -> None:
    ctx = llama._require_ctx()
    n_tokens = int(state.n_tokens)
    if not 0 <= n_tokens <= min(llama.n_ctx(), len(state.input_ids)):
        raise ValueError(f"the state holds {n_tokens} tokens; this context takes {llama.n_ctx()}")
    ctx.state_load(bytes(state.llama_state)[: state.llama_state_size])
    if ctx.kv_pos() < n_tokens:
        # The cache holds fewer positions than the tokens say (a state put together by hand):
        # hold none rather than reuse positions that are not there.
        llama._seq.restore(state.input_ids, 0, None)
        raise ValueError(f"the state's cache holds {ctx.kv_pos()} positions, fewer than its {n_tokens} tokens")
    # As upstream: the next generate() decodes the last token again before sampling.
    llama._seq.restore(state.input_ids, n_tokens, state.scores)
    llama._seed = state.seed
