"""The C boundary: libpowerinfer through cffi, and the objects that own its handles.

- `bindings`: `ffi`/`lib` from powerinfer.h's cdef block, library discovery;
- `errors`: `PowerInferError`, the status names, `core_error()`;
- `model.Model`, `context.Context`, `sampler.Sampler`, `batcher.Batcher`: owned
  `struct powerinfer_*` handles (freed exactly once; context managers), with the calls the
  package needs.

Nothing else in powerinfer_py calls `lib`, and this package imports nothing of
powerinfer_py outside it (import-linter contracts in pyproject.toml). Importing it
loads libpowerinfer.
"""

from .batcher import Batcher
from .context import Context, release_threads
from .devices import gpu_count
from .errors import PowerInferError, core_error
from .model import SPARSE_MODES, Model
from .sampler import CancelCheck, CancelEvent, LogitBias, Sampler

__all__ = ["Batcher", "CancelCheck", "CancelEvent", "Context", "LogitBias", "Model", "PowerInferError", "SPARSE_MODES", "Sampler", "core_error", "gpu_count",
           "release_threads"]
