"""The KV cache and the reused decode graph across the 256-cell attention spans:
token-by-token logits equal llama-cpp-python's before, at and after each boundary, and
after a truncation that moves decoding back into an earlier span."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_py._core.bindings import ffi, lib

N = 300  # crosses the first 256-cell span


def _ours(path, n_ctx=512):
    m = lib.powerinfer_model_load(path.encode(), lib.powerinfer_model_default_params())
    cp = lib.powerinfer_context_default_params()
    cp.n_ctx, cp.n_threads = n_ctx, 2
    c = lib.powerinfer_context_new(m, cp)
    return m, c


def _logits(m, c):
    n = lib.powerinfer_model_n_vocab(m)
    return np.frombuffer(ffi.buffer(lib.powerinfer_get_logits_ith(c, -1), 4 * n), dtype=np.float32).copy()


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(100, 40000, N)]


def test_token_by_token_across_span_boundaries(smollm2_path, tokens):
    import llama_cpp

    ref = llama_cpp.Llama(model_path=smollm2_path, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    m, c = _ours(smollm2_path)
    try:
        one = ffi.new("int32_t[1]")
        for pos, t in enumerate(tokens):
            ref.eval([t])
            one[0] = t
            assert lib.powerinfer_decode(c, one, 1, pos, False) == 0
            if pos in (0, 254, 255, 256, 257, N - 1):
                np.testing.assert_array_equal(_logits(m, c), np.asarray(ref.scores[pos]), err_msg=f"position {pos}")

        # Back into the first span: truncate to 200 and decode the same tokens again.
        assert lib.powerinfer_kv_truncate(c, 200) == 0
        for pos in range(200, 260):
            one[0] = tokens[pos]
            assert lib.powerinfer_decode(c, one, 1, pos, False) == 0
            if pos in (255, 256, 259):
                np.testing.assert_array_equal(_logits(m, c), np.asarray(ref.scores[pos]), err_msg=f"re-decode {pos}")
    finally:
        lib.powerinfer_context_free(c)
        lib.powerinfer_model_free(m)
