"""PowerInfer-Py: sparse-activation LLM inference with llama-cpp-python's API.

`Llama` (and the cffi bindings under it) load lazily, so `powerinfer_py.models`
and the offline tools work before libpowerinfer is built. The names scripts import
from llama_cpp (LlamaGrammar, LlamaRAMCache, LogitsProcessorList, llama_types, ...)
are llama-cpp-python's own pure-Python pieces, also loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional

__version__ = "0.1.0"

__all__ = [
    "Llama",
    "LlamaState",
    "LlamaGrammar",
    "LlamaCache",
    "LlamaRAMCache",
    "LlamaDiskCache",
    "LogitsProcessorList",
    "StoppingCriteriaList",
    "PowerInferError",
    "install_as_llama_cpp",
    "llama_types",
    "llama_chat_format",
    "llama_grammar",
    "llama_cache",
    "__version__",
]


class PowerInferError(ValueError, RuntimeError):
    """A failure reported by the C core, with its message from powerinfer_last_error().

    It is both a ValueError and a RuntimeError so code written for llama-cpp-python
    (ValueError when a model fails to load, RuntimeError when a decode fails)
    catches it unchanged. `status` is the core's powerinfer_status code when known.
    """

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama import LlamaState, LogitsProcessorList, StoppingCriteriaList
    from llama_cpp.llama_cache import LlamaCache, LlamaDiskCache, LlamaRAMCache
    from llama_cpp.llama_grammar import LlamaGrammar

    from . import llama_cache, llama_chat_format, llama_grammar, llama_types
    from ._compat import install_as_llama_cpp
    from .llama import Llama

_FROM_UPSTREAM = {
    "LlamaState": "llama",
    "LogitsProcessorList": "llama",
    "StoppingCriteriaList": "llama",
    "LlamaGrammar": "llama_grammar",
    "LlamaCache": "llama_cache",
    "LlamaRAMCache": "llama_cache",
    "LlamaDiskCache": "llama_cache",
}
_SUBMODULES = ("llama_types", "llama_chat_format", "llama_grammar", "llama_cache")


def __getattr__(name: str):
    if name == "Llama":
        from .llama import Llama

        return Llama
    if name in ("install_as_llama_cpp", "uninstall_llama_cpp"):
        from . import _compat

        return getattr(_compat, name)
    if name in _FROM_UPSTREAM:
        from . import _upstream

        return getattr(_upstream.module(_FROM_UPSTREAM[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
