"""`Handle`: the lifetime shared by Model, Context and Sampler, each owning one pointer
of the core (the way llama-cpp-python's _internals own llama_model/llama_context)."""

from __future__ import annotations

from typing import Any


class Handle:
    """An owned `struct powerinfer_* *`, freed exactly once: by close() (idempotent), by
    leaving a `with` block, or by garbage collection. Subclasses set `_ptr` once the core
    handed it over and free it in `_free`."""

    _kind = "handle"  # named in the error when a closed one is used

    _ptr: Any = None

    @property
    def ptr(self):
        """The core's pointer (RuntimeError once closed)."""
        if self._ptr is None:
            raise RuntimeError(f"the {self._kind} was closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _free(self, ptr) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Free it now (idempotent)."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._free(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
