"""The ggml backend module (src/powerinfer_accel/, docs/accel.md): input sparsity inside
libllama, for every architecture it runs. Registering puts the module's ACCEL device in the
registry libllama reads; arming it with a sparsified GGUF makes the next model libllama
loads place the weights the file gives thresholds in the module's buffers."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from .bindings import ffi, lib
from .errors import core_error

SPARSE = int(lib.POWERINFER_ACCEL_SPARSE)
PASSTHROUGH = int(lib.POWERINFER_ACCEL_PASSTHROUGH)
CALIBRATE = int(lib.POWERINFER_ACCEL_CALIBRATE)
MODES = {"sparse": SPARSE, "passthrough": PASSTHROUGH, "calibrate": CALIBRATE}

# One model load armed at a time: the rules are the module's, for the next model.
_ARM_LOCK = threading.RLock()


def register() -> None:
    """Puts the module's device in ggml's registry (idempotent)."""
    if lib.powerinfer_accel_register() < 0:
        raise core_error("registering the sparse module with ggml")


def registered() -> bool:
    return bool(lib.powerinfer_accel_registered())


@contextlib.contextmanager
def armed(path: Optional[str], mode: int = SPARSE) -> Iterator[Tuple[int, int]]:
    """Within the block, a model libllama loads takes the module's rules from `path`:
    yields (tag, number of tensor names the file gives a threshold)."""
    register()
    with _ARM_LOCK:
        tag = lib.powerinfer_accel_arm(path.encode() if path is not None else ffi.NULL, mode)
        if tag < 0:
            raise core_error(f"reading the sparse thresholds of {path}")
        try:
            yield int(tag), int(lib.powerinfer_accel_rule_count())
        finally:
            lib.powerinfer_accel_disarm()


def set_max_batch(n: int) -> None:
    if lib.powerinfer_accel_set_max_batch(int(n)) < 0:
        raise core_error("setting the sparse max batch")


def weights(tag: int) -> List[Dict[str, Any]]:
    """The weights placed under `tag`: name, sparse, threshold, shape, bytes, kept counts."""
    n = lib.powerinfer_accel_weights(tag, ffi.NULL, 0)
    if n <= 0:
        return []
    arr = ffi.new("struct powerinfer_accel_weight[]", n)
    n = min(n, lib.powerinfer_accel_weights(tag, arr, n))
    return [
        {
            "name": ffi.string(w.name).decode(),
            "sparse": bool(w.sparse),
            "calibrated": bool(w.calibrated),
            "threshold": float(w.threshold),
            "n_mats": int(w.n_mats),
            "type": int(w.type),
            "n_in": int(w.n_in),
            "n_out": int(w.n_out),
            "bytes": int(w.bytes),
            "n_active": int(w.n_active),
            "n_total": int(w.n_total),
            "group_size": int(w.group_size),
        }
        for w in (arr[i] for i in range(n))
    ]


def histogram(tag: int, name: str) -> Tuple[np.ndarray, float, float]:
    """CALIBRATE: counts of |x| at the input of weight `name`, and the bins' log10 range."""
    n_bins = lib.powerinfer_accel_histogram(tag, name.encode(), ffi.NULL, 0, ffi.NULL, ffi.NULL)
    counts = np.zeros(n_bins, dtype=np.uint64)
    lo, hi = ffi.new("float *"), ffi.new("float *")
    got = lib.powerinfer_accel_histogram(tag, name.encode(), ffi.cast("uint64_t *", counts.ctypes.data), n_bins, lo, hi)
    if got < 0:
        raise core_error(f"the histogram of {name}")
    return counts, float(lo[0]), float(hi[0])


def reset_stats(tag: int) -> None:
    lib.powerinfer_accel_reset_stats(tag)


def sparse_stats(tag: int) -> Dict[str, Any]:
    """The share of input entries the sparse products kept, over all and per weight."""
    ws = [w for w in weights(tag) if w["sparse"]]
    active = sum(w["n_active"] for w in ws)
    total = sum(w["n_total"] for w in ws)
    return {
        "weights": {w["name"]: (w["n_active"] / w["n_total"] if w["n_total"] else None) for w in ws},
        "active": active / total if total else None,
        "n_sparse_weights": len(ws),
    }


def core_builds(arch: str) -> bool:
    """Whether the core builds a graph for this architecture (else libllama runs it)."""
    return bool(lib.powerinfer_arch_supported(arch.encode()))
