"""The fallback engine: for what the core does not implement (an architecture, LoRA, KV
overrides, ...), Llama wraps llama-cpp-python's own Llama and forwards to it.

Every function takes the powerinfer_py.Llama it serves as `llama`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from typing import Any, Dict, Sequence, Tuple

from .._core import PowerInferError
from .._core import accel
from .._core.errors import ERR_UNSUPPORTED
from . import overrides as _overrides
from . import upstream
from .constants import ENGINE_LLAMA_CPP


def delegates(method):
    """On the fallback engine, the method of the same name of the wrapped llama_cpp.Llama runs."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return getattr(fallback, name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return wrapper


def load(llama: Any, core_message: str, params: Dict[str, Any], tensor_overrides: Sequence[Tuple[str, str]] = ()) -> None:
    """Loads llama.model_path on llama-cpp-python's engine (the same constructor params;
    tensor_overrides: (pattern, buffer type) pairs, llama.cpp's --override-tensor)."""
    try:
        upstream_llama = upstream.llama_module().Llama
    except ImportError:
        raise PowerInferError(
            f"Failed to load model from file: {llama.model_path}: {core_message} "
            "(install llama-cpp-python==0.3.36 to run it on the dense fallback engine)",
            ERR_UNSUPPORTED,
        ) from None
    if llama.verbose:
        print(f"powerinfer_py: {core_message}; falling back to engine {ENGINE_LLAMA_CPP}", file=sys.stderr)
    # kept with the Llama: libllama keeps the array's address in the model's params
    llama._tensor_overrides_array = _overrides.Overrides(tensor_overrides) if tensor_overrides else None
    try:
        # the module (docs/accel.md) runs the file's input-sparse thresholds inside libllama
        sparse = getattr(llama, "sparse_mode", None) != "dense"
        with accel.armed(llama.model_path) if sparse else contextlib.nullcontext((None, 0)) as (tag, n):
            # repack=False is llama.cpp's --no-repack: no extra CPU buffer types (ggml's repacked
            # layouts; the module is an ACCEL device, which libllama lists apart and keeps)
            fields = {"use_extra_bufts": False} if llama._init_params.get("repack") is False else {}
            with _overrides.installed(llama._tensor_overrides_array, **fields):
                fallback = upstream_llama(model_path=llama.model_path, **params)
        llama._accel_tag = tag if n > 0 else None
    except Exception as e:
        raise PowerInferError(
            f"Failed to load model from file: {llama.model_path}: {core_message}; "
            f"the {ENGINE_LLAMA_CPP} fallback failed too: {e}",
            ERR_UNSUPPORTED,
        ) from e
    _guard_tokenizer(fallback)
    llama._fallback = fallback
    llama.engine = ENGINE_LLAMA_CPP
    if llama.verbose:
        print(f"powerinfer_py: engine {ENGINE_LLAMA_CPP} (dense)", file=sys.stderr)


# A 4-byte UTF-8 form of a number past U+10FFFF: libllama's code-point tokenizers throw
# through its C API on it and the process ends (the core replaces it in powerinfer_tokenize,
# src/powerinfer_c/vocab.c; this is the same rule for llama-cpp-python's engine).
_BEYOND_UNICODE = re.compile(rb"\xf4[\x90-\xbf][\x80-\xbf]{2}|[\xf5-\xf7][\x80-\xbf]{3}")
_FOUR_REPLACEMENTS = "\ufffd".encode("utf-8") * 4


def _guard_tokenizer(fallback: Any) -> None:
    """Every tokenization of the wrapped engine (its Llama.tokenize, completions and chat
    all go through its model's tokenize) gets such a form as U+FFFD x 4, as the core does,
    unless the vocabulary reads bytes without decoding them (SPM, UGM)."""
    mod = upstream.module()
    model = fallback._model
    if mod.llama_vocab_type(model.vocab) in (mod.LLAMA_VOCAB_TYPE_SPM, mod.LLAMA_VOCAB_TYPE_UGM):
        return
    raw = model.tokenize

    def tokenize(text: bytes, add_bos: bool, special: bool):
        if _BEYOND_UNICODE.search(text):
            text = _BEYOND_UNICODE.sub(_FOUR_REPLACEMENTS, text)
        return raw(text, add_bos, special)

    model.tokenize = tokenize


def timings(fallback: Any) -> Dict[str, float]:
    """llama.cpp's perf counters of the wrapped context, by struct powerinfer_timings names."""
    t = upstream.module().llama_perf_context(fallback.ctx)
    return {
        "t_load_ms": t.t_load_ms,
        "t_prompt_ms": t.t_p_eval_ms,
        "n_prompt": t.n_p_eval,
        "t_eval_ms": t.t_eval_ms,
        "n_eval": t.n_eval,
    }


def reset_timings(fallback: Any) -> None:
    upstream.module().llama_perf_context_reset(fallback.ctx)


def token_is_eog(fallback: Any, token: int) -> bool:
    return bool(upstream.module().llama_vocab_is_eog(fallback._model.vocab, token))
