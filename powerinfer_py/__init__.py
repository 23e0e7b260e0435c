"""PowerInfer-Py: sparse-activation LLM inference with llama-cpp-python's API.

`Llama` (and the cffi bindings under it) load lazily, so `powerinfer_py.models`
and the offline tools work before libpowerinfer is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

__version__ = "0.1.0"

__all__ = ["Llama", "PowerInferError", "__version__"]


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
    from .llama import Llama


def __getattr__(name: str):
    if name == "Llama":
        from .llama import Llama

        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
