"""Input sparsity for plain llama-cpp-python users, and for every architecture libllama runs.

    import powerinfer_py.accel
    powerinfer_py.accel.enable()                      # once, before the first model
    llm = llama_cpp.Llama(model_path="model.sparse.gguf")   # any architecture
    print(powerinfer_py.accel.sparse_stats(llm))

enable() registers PowerInfer-Py's ggml backend module (an ACCEL device, docs/accel.md)
with the ggml that llama-cpp-python's libllama uses, and wraps llama-cpp-python's model
loader so that each model file arms the module with its own thresholds while it loads (a
file without thresholds places nothing in the module: it runs exactly as before).
`powerinfer_py.Llama` does the same by itself for the architectures its core does not build.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

from ._core import accel as _accel
from ._llama import upstream

_TAGS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_LAST: Dict[str, int] = {}


def enable() -> None:
    """Registers the module and makes every later llama_cpp model load arm it with the
    thresholds of its own file (idempotent)."""
    _accel.register()
    upstream.wrap_model_loader("accel", _load_armed)


def _load_armed(load: Any, path_model: bytes, params: Any):
    path = path_model.decode("utf-8", errors="surrogateescape") if isinstance(path_model, bytes) else str(path_model)
    with _accel.armed(path, _accel.SPARSE) as (tag, _n_rules):
        model = load(path_model, params)
    if model:
        _LAST[path] = tag
    return model


def enabled() -> bool:
    return upstream.model_loader_wrapped("accel")


def tag_of(llm: Any) -> Optional[int]:
    """The module's tag of a llama_cpp.Llama loaded after enable() (None: loaded before)."""
    path = getattr(llm, "model_path", None)
    return _LAST.get(path) if path is not None else None


def sparse_stats(llm: Any) -> Dict[str, Any]:
    """The share of input entries the module's sparse products kept for this model, over
    all its sparse weights ("active") and per weight."""
    tag = tag_of(llm)
    if tag is None:
        return {"weights": {}, "active": None, "n_sparse_weights": 0}
    return _accel.sparse_stats(tag)


def set_max_batch(n: int) -> None:
    """The largest batch the module's sparse product runs (0 to 32; default 32); larger
    batches (prompts) run ggml's matmul."""
    _accel.set_max_batch(n)
