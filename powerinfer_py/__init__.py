"""PowerInfer-Py: sparse-activation LLM inference with llama-cpp-python's API.

`Llama`, `PowerInferError` (and the cffi bindings under them, powerinfer_py._core)
load lazily, so `powerinfer_py.assets.models` and the offline tools that do not run
the engine work before libpowerinfer is built. The names scripts import from
llama_cpp (LlamaGrammar, LlamaRAMCache, LogitsProcessorList, llama_types, ...) are
llama-cpp-python's own pure-Python pieces, also loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "Llama",
    "ParallelLlama",
    "LlamaState",
    "LlamaGrammar",
    "LlamaCache",
    "LlamaRAMCache",
    "LlamaDiskCache",
    "LogitsProcessorList",
    "StoppingCriteriaList",
    "LlamaDraftModel",
    "LlamaPromptLookupDecoding",
    "PowerInferError",
    "gpu_count",
    "kernel_level",
    "kernel_levels",
    "install_as_llama_cpp",
    "llama_types",
    "llama_chat_format",
    "llama_grammar",
    "llama_cache",
    "__version__",
]


if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama import LlamaState, LogitsProcessorList, StoppingCriteriaList
    from llama_cpp.llama_cache import LlamaCache, LlamaDiskCache, LlamaRAMCache
    from llama_cpp.llama_grammar import LlamaGrammar
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    from . import llama_cache, llama_chat_format, llama_grammar, llama_types
    from ._core.bindings import kernel_level, kernel_levels
    from ._core.devices import gpu_count
    from ._core.errors import PowerInferError
    from .llama import Llama, install_as_llama_cpp
    from .parallel import ParallelLlama

_FROM_UPSTREAM = {
    "LlamaState": "llama",
    "LogitsProcessorList": "llama",
    "StoppingCriteriaList": "llama",
    "LlamaGrammar": "llama_grammar",
    "LlamaCache": "llama_cache",
    "LlamaRAMCache": "llama_cache",
    "LlamaDiskCache": "llama_cache",
    "LlamaDraftModel": "llama_speculative",
    "LlamaPromptLookupDecoding": "llama_speculative",
}
_SUBMODULES = ("llama_types", "llama_chat_format", "llama_grammar", "llama_cache")


def __getattr__(name: str):
    if name in ("Llama", "install_as_llama_cpp"):
        from . import llama

        return getattr(llama, name)
    if name == "ParallelLlama":
        from .parallel import ParallelLlama

        return ParallelLlama
    if name == "PowerInferError":
        from ._core.errors import PowerInferError

        return PowerInferError
    if name in ("kernel_level", "kernel_levels"):
        from ._core import bindings

        return getattr(bindings, name)
    if name == "gpu_count":
        from ._core.devices import gpu_count

        return gpu_count
    if name == "uninstall_llama_cpp":
        from ._llama.aliases import uninstall_llama_cpp

        return uninstall_llama_cpp
    if name in _FROM_UPSTREAM:
        from ._llama import upstream

        return getattr(upstream.module(_FROM_UPSTREAM[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
