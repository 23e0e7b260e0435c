"""Reads matmuls inside libllama while it decodes: the eval callback of llama.cpp's context
(llama_context_params.cb_eval) sees every node after it is computed, whatever backend ran
it (the module included), so a test can compare a node's result with numpy on the node's
own inputs. A ggml_tensor's layout is from the pinned ggml's ggml.h (GGML_MAX_SRC 10,
GGML_MAX_OP_PARAMS 64, GGML_MAX_NAME 64); op names come from libggml-base's ggml_op_desc."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np


class GgmlTensor(ctypes.Structure):
    pass


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * 10),
    ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]

F32 = 0  # GGML_TYPE_F32
I32 = 26  # GGML_TYPE_I32


def _ggml_base():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent.parent / "lib" / "libggml-base.so.0"))
    lib.ggml_op_desc.restype = ctypes.c_char_p
    lib.ggml_op_desc.argtypes = [ctypes.POINTER(GgmlTensor)]
    return lib


def _array(t: GgmlTensor, dtype) -> np.ndarray:
    """A copy of a contiguous-rows tensor's data as [ne3, ne2, ne1, ne0]."""
    ne = [int(t.ne[i]) for i in range(4)]
    nb = [int(t.nb[i]) for i in range(4)]
    item = np.dtype(dtype).itemsize
    assert nb[0] == item, "rows must be contiguous"
    span = max((ne[i] - 1) * nb[i] for i in range(4)) + item
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(t.data))
    view = np.lib.stride_tricks.as_strided(raw.view(np.uint8), shape=(ne[3], ne[2], ne[1], ne[0] * item),
                                           strides=(nb[3], nb[2], nb[1], 1))
    return np.array(view, copy=True).view(dtype).reshape(ne[3], ne[2], ne[1], ne[0])


@dataclass
class Node:
    op: str
    weight: str
    x: np.ndarray            # src[1]: [ne3, ne2, ne1, ne0] f32
    y: np.ndarray            # the node: f32
    ids: Optional[np.ndarray]  # MUL_MAT_ID's src[2]


def capture(model_path: str, steps: Sequence[Sequence[int]], want: Callable[[str], bool], n_threads: int = 2,
            n_ctx: int = 256, before_free: Optional[Callable[[], None]] = None) -> List[Node]:
    """Decodes `steps` (each a batch of tokens, positions following on) with llama-cpp-python's
    libllama, and returns every MUL_MAT / MUL_MAT_ID node whose weight name `want` accepts,
    with its input and result. The module, when registered and armed, places the weights as
    it does in any load. before_free runs while the model is still loaded."""
    import llama_cpp

    base = _ggml_base()
    found: List[Node] = []

    def op_of(t) -> str:
        return base.ggml_op_desc(t).decode()

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb(ptr, ask, _user):
        t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor))
        op = op_of(t)
        if op not in ("MUL_MAT", "MUL_MAT_ID") or not t.contents.src[0]:
            return not ask
        w = t.contents.src[0].contents.name.decode()
        if not want(w):
            return not ask
        if ask:
            return True
        node = t.contents
        ids = _array(node.src[2].contents, np.int32) if op == "MUL_MAT_ID" else None
        found.append(Node(op, w, _array(node.src[1].contents, np.float32), _array(node, np.float32), ids))
        return True

    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0  # libllama's default is all layers on a device, whose tensors are not host memory
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    assert model, model_path
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = max(len(s) for s in steps)
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.cb_eval = cb
    ctx = llama_cpp.llama_init_from_model(model, cp)
    try:
        pos = 0
        for s in steps:
            batch = llama_cpp.llama_batch_init(len(s), 0, 1)
            try:
                batch.n_tokens = len(s)
                for i, tok in enumerate(s):
                    batch.token[i] = tok
                    batch.pos[i] = pos + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = i == len(s) - 1
                assert llama_cpp.llama_decode(ctx, batch) == 0
            finally:
                llama_cpp.llama_batch_free(batch)
            pos += len(s)
        if before_free is not None:
            before_free()
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return found


def dequantized(model_path: str) -> Callable[[str], np.ndarray]:
    """name -> the weight as f32 [.., n_out, n_in] (gguf's own dequantization)."""
    import gguf

    reader = gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        return w.reshape(tuple(int(d) for d in reversed(t.shape))).astype(np.float32)

    return get


def kept_product(w: np.ndarray, x: np.ndarray, threshold: float) -> np.ndarray:
    """w [n_out, n_in] times x [T, n_in] over the entries |x| > threshold of each token."""
    return np.where(np.abs(x) > threshold, x, 0.0) @ w.T
