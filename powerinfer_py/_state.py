"""Llama.save_state / load_state: the context state of the core (cached keys and values,
last logits) together with the Python-side token history, in llama-cpp-python's
LlamaState, so its prompt caches (LlamaRAMCache, LlamaDiskCache) store ours unchanged."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

from . import _upstream
from ._bindings import ffi, lib

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama import LlamaState

    from .llama import Llama


def save_state(llama: "Llama") -> "LlamaState":
    from .llama import _core_error

    ctx = llama._require_ctx()
    if llama.verbose:
        print("Llama.save_state: saving llama state", file=sys.stderr)
    # The core saves every cached position: drop those past n_tokens (stale after a
    # reset or a prefix match) so the state holds exactly input_ids[:n_tokens].
    if int(lib.powerinfer_kv_pos(ctx)) > llama.n_tokens:
        rc = lib.powerinfer_kv_truncate(ctx, llama.n_tokens)
        if rc != lib.POWERINFER_OK:
            raise _core_error(f"powerinfer_kv_truncate({llama.n_tokens}) failed", rc)
        llama._requires_eval = True
    size = int(lib.powerinfer_state_size(ctx))
    buf = ffi.new("uint8_t[]", size)
    n_bytes = int(lib.powerinfer_state_save(ctx, buf, size))
    if n_bytes == 0:
        raise _core_error("Failed to copy llama state data")
    if llama.verbose:
        print(f"Llama.save_state: saving {n_bytes} bytes of llama state", file=sys.stderr)
    # Without logits_all the scores hold nothing (upstream copies the unused rows anyway).
    scores = llama._scores.copy() if llama._logits_all else np.zeros((0, llama._n_vocab), dtype=np.single)
    return _upstream.llama_module().LlamaState(
        input_ids=llama.input_ids.copy(),
        scores=scores,
        n_tokens=llama.n_tokens,
        llama_state=ffi.buffer(buf, n_bytes)[:],
        llama_state_size=n_bytes,
        seed=llama._seed,
    )


def load_state(llama: "Llama", state: "LlamaState") -> None:
    from .llama import _core_error

    ctx = llama._require_ctx()
    data = bytes(state.llama_state)[: state.llama_state_size]
    rc = lib.powerinfer_state_load(ctx, ffi.from_buffer("uint8_t[]", data), len(data))
    if rc != lib.POWERINFER_OK:
        raise _core_error("Failed to set llama state data", rc)
    n_tokens = int(state.n_tokens)
    llama.input_ids = np.zeros((llama._n_ctx,), dtype=np.intc)
    llama.input_ids[:n_tokens] = np.asarray(state.input_ids[:n_tokens], dtype=np.intc)
    n_scores = min(len(state.scores), n_tokens)
    if llama._logits_all and n_scores:
        llama.scores[:n_scores, :] = state.scores[:n_scores]
    llama.n_tokens = n_tokens
    # As upstream: the next generate() decodes the last token again before sampling.
    llama._requires_eval = True
    llama._seed = state.seed
