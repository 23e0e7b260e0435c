"""Aliases that make `import llama_cpp` resolve to PowerInfer-Py (the machinery of
powerinfer_py.install_as_llama_cpp, which passes its Llama class to install()).

`llama_cpp` and `llama_cpp.llama` become alias modules: copies of the real ones whose
`Llama` is powerinfer_py.Llama. The pure-Python submodules (llama_types,
llama_chat_format, llama_grammar, llama_cache, llama_tokenizer, ...) stay the real
ones: they work unchanged with our Llama. The real modules are imported and kept
(powerinfer_py._llama.upstream) before the aliases go in, so the fallback engine and
the reused pieces still reach llama-cpp-python itself.
"""

from __future__ import annotations

import sys
import types
from typing import Dict, Optional

from . import upstream

# Imported before aliasing so they keep binding the real package internally.
_PRELOAD = (
    "llama_cpp",
    "llama_cpp.llama",
    "llama_cpp.llama_types",
    "llama_cpp.llama_grammar",
    "llama_cpp.llama_cache",
    "llama_cpp.llama_tokenizer",
    "llama_cpp.llama_chat_format",
    "llama_cpp.llama_speculative",
)

_saved: Dict[str, types.ModuleType] = {}


class _AliasModule(types.ModuleType):
    """A copy of a real module with some names replaced; any other name (including
    submodules imported after the alias went in) is looked up on the real module."""

    def __getattr__(self, name: str):
        real = self.__dict__["__powerinfer_real__"]
        try:
            return getattr(real, name)
        except AttributeError:
            pass
        sub = sys.modules.get(f"{real.__name__}.{name}")
        if sub is not None:
            return sub
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


def _alias(real: types.ModuleType, overrides: Dict[str, object]) -> types.ModuleType:
    alias = _AliasModule(real.__name__, real.__doc__)
    for key, value in vars(real).items():
        if key not in ("__dict__", "__weakref__"):
            alias.__dict__[key] = value
    alias.__dict__.update(overrides)
    alias.__dict__["__powerinfer_real__"] = real
    alias.__dict__[upstream.SHIM_MARK] = True
    return alias


def is_installed() -> bool:
    """Whether `import llama_cpp` currently resolves to PowerInfer-Py."""
    return bool(getattr(sys.modules.get("llama_cpp"), upstream.SHIM_MARK, False))


def install(llama_cls: type) -> types.ModuleType:
    """Make `import llama_cpp` (and `from llama_cpp import Llama`, `llama_cpp.llama.Llama`,
    `llama_cpp.llama_chat_format`, ...) resolve to PowerInfer-Py in this process, with
    `llama_cls` as their `Llama`. Idempotent; returns the `llama_cpp` alias module.
    """
    if is_installed():
        return sys.modules["llama_cpp"]
    for name in _PRELOAD:
        upstream.module(name[len("llama_cpp.") :] if "." in name else "")
    real_pkg = upstream.module()
    real_llama = upstream.module("llama")

    llama_alias = _alias(real_llama, {"Llama": llama_cls})
    pkg_alias = _alias(real_pkg, {"Llama": llama_cls, "llama": llama_alias})
    # New submodules (e.g. llama_cpp.server) are found in the real package directory.
    pkg_alias.__path__ = list(real_pkg.__path__)

    _saved["llama_cpp"] = real_pkg
    _saved["llama_cpp.llama"] = real_llama
    sys.modules["llama_cpp"] = pkg_alias
    sys.modules["llama_cpp.llama"] = llama_alias
    return pkg_alias


def uninstall_llama_cpp() -> None:
    """Undo install_as_llama_cpp(): `import llama_cpp` is llama-cpp-python again."""
    if not is_installed():
        return
    for name, module in _saved.items():
        sys.modules[name] = module
    _saved.clear()


def real_llama_cpp() -> Optional[types.ModuleType]:
    """The real llama_cpp package (imported if needed)."""
    return upstream.module()
