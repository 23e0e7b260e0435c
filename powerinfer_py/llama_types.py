"""llama-cpp-python's `llama_cpp.llama_types`, shared as is (pure Python, engine-independent):
`powerinfer_py.llama_types` *is* that module."""

import sys as _sys

from ._llama import upstream as _upstream

_sys.modules[__name__] = _upstream.module("llama_types")
