"""The real llama-cpp-python modules: the pure-Python pieces we reuse (OpenAI types, chat
formats, grammars, prompt caches) and the engine we fall back to.

Everything here is imported on first use, so `import powerinfer_py` stays cheap. The
modules are remembered the first time they are reached, which install_as_llama_cpp()
(powerinfer_py._llama.aliases) makes sure happens before it puts its aliases in
sys.modules: our own code therefore always gets the real llama_cpp, whatever
`import llama_cpp` resolves to for the user.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
from typing import Any, Callable, Dict

# Set on the alias modules install_as_llama_cpp() creates.
SHIM_MARK = "__powerinfer_shim__"

# Names scripts import from llama_cpp.llama, served from llama-cpp-python (pure Python)
# by powerinfer_py.llama's module __getattr__.
LLAMA_MODULE_NAMES = (
    "LlamaState",
    "LogitsProcessor",
    "LogitsProcessorList",
    "StoppingCriteria",
    "StoppingCriteriaList",
    "MinTokensLogitsProcessor",
    "LlamaGrammar",
    "BaseLlamaCache",
    "LlamaCache",
    "LlamaRAMCache",
    "LlamaDiskCache",
)

_REAL: Dict[str, types.ModuleType] = {}

_MISSING_HINT = (
    "llama-cpp-python==0.3.36 is required (it provides ggml, the chat formats and the "
    "grammar tools): pip install llama-cpp-python==0.3.36"
)


def module(name: str = "") -> types.ModuleType:
    """The real `llama_cpp` package (name "") or its submodule `llama_cpp.<name>`."""
    full = "llama_cpp" + (f".{name}" if name else "")
    mod = _REAL.get(full)
    if mod is not None:
        return mod
    current = sys.modules.get(full)
    if current is not None and getattr(current, SHIM_MARK, False):
        # Only aliases of modules saved here are installed, so this cannot happen
        # unless sys.modules was edited by hand.
        raise ImportError(f"{full} is aliased to powerinfer_py and its real module was not kept")
    try:
        mod = importlib.import_module(full)
    except ImportError as e:
        raise ImportError(f"cannot import {full}: {e}. {_MISSING_HINT}") from e
    _REAL[full] = mod
    return mod


def llama_module() -> types.ModuleType:
    """llama_cpp.llama: Llama (the fallback engine), LlamaState, LogitsProcessorList, ..."""
    return module("llama")


def llama_types() -> types.ModuleType:
    return module("llama_types")


def llama_chat_format() -> types.ModuleType:
    return module("llama_chat_format")


def llama_grammar() -> types.ModuleType:
    return module("llama_grammar")


def llama_cache() -> types.ModuleType:
    return module("llama_cache")


def llama_tokenizer() -> types.ModuleType:
    return module("llama_tokenizer")


def llama_speculative() -> types.ModuleType:
    """llama_cpp.llama_speculative: LlamaDraftModel, LlamaPromptLookupDecoding."""
    return module("llama_speculative")


_WRAP_LOCK = threading.Lock()


def wrap_model_loader(marker: str, around: Callable[[Callable[..., Any], Any, Any], Any]) -> None:
    """Replaces llama_cpp's llama_model_load_from_file (which llama_cpp._internals calls by
    module attribute) with one that calls around(load, path_model, params), once per marker."""
    mod = module("llama_cpp")
    with _WRAP_LOCK:
        if model_loader_wrapped(marker):
            return
        load = mod.llama_model_load_from_file

        @functools.wraps(load)
        def wrapped(path_model: Any, params: Any):
            return around(load, path_model, params)

        wrapped.__powerinfer_marker__ = marker  # type: ignore[attr-defined]
        mod.llama_model_load_from_file = wrapped


def model_loader_wrapped(marker: str) -> bool:
    """Whether wrap_model_loader(marker, ...) is in force (under other wrappers too)."""
    wrapper = module("llama_cpp").llama_model_load_from_file
    while wrapper is not None:
        if getattr(wrapper, "__powerinfer_marker__", None) == marker:
            return True
        wrapper = getattr(wrapper, "__wrapped__", None)
    return False
