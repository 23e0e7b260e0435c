"""`Model`: an owned `struct powerinfer_model *`, in the style of llama-cpp-python's
_internals.LlamaModel.

`Model(path, **params)` loads a GGUF with the core's default parameters, overridden by
the given `struct powerinfer_model_params` fields, and raises PowerInferError when the
core refuses the file. `close()` releases it exactly once; it is a context manager, and
garbage collection closes it too. The core counts references: the contexts and samplers
made from it hold the model's memory until they are closed too, so handles may be closed
(or collected) in any order.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import numpy as np

from .bindings import ffi, last_error, lib, string
from .errors import core_error
from .handle import Handle

# What the core's count-returning calls return on an error (never a size request).
_ERROR = -(2**31)

# enum powerinfer_sparse_mode by name
SPARSE_MODES: Dict[str, int] = {
    "auto": lib.POWERINFER_SPARSE_AUTO,
    "dense": lib.POWERINFER_SPARSE_DENSE,
    "gate": lib.POWERINFER_SPARSE_GATE,
    "predictor": lib.POWERINFER_SPARSE_PREDICTOR,
    "input": lib.POWERINFER_SPARSE_INPUT,
}

# enum powerinfer_input: the inputs of input mode, per layer, in the core's order
INPUTS = ("qkv", "o", "ffn", "down")

# enum powerinfer_split_mode by name
SPLIT_MODES: Dict[str, int] = {
    "auto": lib.POWERINFER_SPLIT_AUTO,
    "hybrid": lib.POWERINFER_SPLIT_HYBRID,
    "layer": lib.POWERINFER_SPLIT_LAYER,
    "none": lib.POWERINFER_SPLIT_NONE,
}

# Array fields given as Python lists, and the count field that goes with each.
_ARRAYS = {"tensor_split": ("float[]", "n_tensor_split"), "device_budgets": ("int64_t[]", "n_device_budgets")}


def model_params(keep: Optional[List[Any]] = None, **fields: Any):
    """struct powerinfer_model_params: the core's defaults with `fields` set by name
    (`sparse_mode` and `split_mode` also take a name; `rpc_servers` a str; `tensor_split`
    and `device_budgets` lists). The buffers behind pointer fields go into `keep`, which
    must outlive the call that reads them (the core copies them at load)."""
    params = lib.powerinfer_model_default_params()
    keep = keep if keep is not None else []
    for name, value in fields.items():
        if name == "sparse_mode" and isinstance(value, str):
            value = SPARSE_MODES[value]
        if name == "split_mode" and isinstance(value, str):
            value = SPLIT_MODES[value]
        if name == "rpc_servers":
            if not value:
                continue
            value = ffi.new("char[]", str(value).encode())
            keep.append(value)
        if name in _ARRAYS:
            if value is None or len(value) == 0:
                continue
            ctype, count = _ARRAYS[name]
            items = list(value)
            value = ffi.new(ctype, items)
            keep.append(value)
            setattr(params, count, len(items))
        try:
            setattr(params, name, value)
        except AttributeError:
            raise TypeError(f"struct powerinfer_model_params has no field {name!r}") from None
    return params


def _read_string(fn, *args) -> str:
    """Calls a core function of the form f(..., char *buf, size_t buf_size) -> full length."""
    size = 256
    while True:
        buf = ffi.new("char[]", size)
        n = fn(*args, buf, size)
        if n < 0:
            return ""
        if n < size:
            return ffi.string(buf).decode("utf-8", errors="replace")
        size = n + 1


class Model(Handle):
    """A loaded model: hyper-parameters, metadata, vocabulary and placement input."""

    _kind = "model"

    def __init__(self, path: "os.PathLike[str] | str", **params: Any):
        self.path = os.fspath(path)
        self._keep: List[Any] = []  # what the params' pointers point at (self.params stays readable)
        self.params = model_params(self._keep, **params)
        ptr = lib.powerinfer_model_load(os.fsencode(self.path), self.params)
        if ptr == ffi.NULL:
            raise core_error(f"Failed to load model from file: {self.path}")
        self._ptr = ptr

    def _free(self, ptr) -> None:
        lib.powerinfer_model_free(ptr)

    def share(self) -> "Model":
        """A second handle on the same loaded model (the core counts the reference): it
        stays usable after this one is closed, and the model's memory lives until both are."""
        other = Model.__new__(Model)
        other.path, other.params, other._keep = self.path, self.params, self._keep
        other._ptr = lib.powerinfer_model_retain(self.ptr)
        return other

    # ---- hyper-parameters --------------------------------------------------------------

    def arch(self) -> str:
        return string(lib.powerinfer_model_arch(self.ptr))

    def n_vocab(self) -> int:
        return int(lib.powerinfer_model_n_vocab(self.ptr))

    def n_ctx_train(self) -> int:
        return int(lib.powerinfer_model_n_ctx_train(self.ptr))

    def n_embd(self) -> int:
        return int(lib.powerinfer_model_n_embd(self.ptr))

    def n_layer(self) -> int:
        return int(lib.powerinfer_model_n_layer(self.ptr))

    def n_head(self) -> int:
        return int(lib.powerinfer_model_n_head(self.ptr))

    def n_ff(self) -> int:
        return int(lib.powerinfer_model_n_ff(self.ptr))

    def size(self) -> int:
        """Bytes of weights."""
        return int(lib.powerinfer_model_size(self.ptr))

    def n_params(self) -> int:
        return int(lib.powerinfer_model_n_params(self.ptr))

    def tensor_nbytes(self, name: str) -> int:
        """Bytes of the named weight tensor in the file, -1 if there is none."""
        return int(lib.powerinfer_model_tensor_nbytes(self.ptr, name.encode()))

    def sparse_mode(self) -> str:
        """The sparse mode the model runs in ("dense", "gate", "predictor", "input"; auto resolved)."""
        return string(lib.powerinfer_sparse_mode_name(lib.powerinfer_model_sparse_mode(self.ptr)))

    def n_packed(self) -> int:
        """Dense matmul weights the packed kernels compute (pack_dense=True; 0 without AVX-512
        VNNI or without weights of a type that packs)."""
        return int(lib.powerinfer_model_n_packed(self.ptr))

    def failed(self) -> bool:
        """True once an RPC worker holding part of the model stopped answering: it computes
        nothing more (load it again once the worker is back)."""
        return bool(lib.powerinfer_model_failed(self.ptr))

    def sparse_threshold(self, layer: int) -> float:
        return float(lib.powerinfer_model_sparse_threshold(self.ptr, layer))

    def input_threshold(self, layer: int, input: int) -> float:
        """Input mode: the threshold of input `input` (an index into INPUTS) of `layer`; layer
        n_layer, input 0 is the output matrix (NaN for any other pair out of range)."""
        return float(lib.powerinfer_model_input_threshold(self.ptr, layer, input))

    def input_sparse(self, layer: int, input: int) -> bool:
        """Input mode: whether that input's matrices read only their kept columns (else dense)."""
        return bool(lib.powerinfer_model_input_sparse(self.ptr, layer, input))

    def ffn_activation(self) -> str:
        return string(lib.powerinfer_model_ffn_activation(self.ptr))

    def metadata(self) -> Dict[str, str]:
        """Every GGUF key, its value rendered as a string (arrays as "[n items]")."""
        ptr = self.ptr
        out: Dict[str, str] = {}
        for i in range(lib.powerinfer_model_meta_count(ptr)):
            key = _read_string(lib.powerinfer_model_meta_key_by_index, ptr, i)
            out[key] = _read_string(lib.powerinfer_model_meta_val_str_by_index, ptr, i)
        return out

    # ---- vocabulary ------------------------------------------------------------------------

    def token_bos(self) -> int:
        return int(lib.powerinfer_token_bos(self.ptr))

    def token_eos(self) -> int:
        return int(lib.powerinfer_token_eos(self.ptr))

    def token_is_eog(self, token: int) -> bool:
        return bool(lib.powerinfer_token_is_eog(self.ptr, token))

    def check_draft_vocab(self, draft: "Model", what: str) -> None:
        """PowerInferError (a ValueError) unless `draft` proposes tokens in this model's
        vocabulary (powerinfer_vocab_compatible); `what` starts the message."""
        rc = lib.powerinfer_vocab_compatible(self.ptr, draft.ptr)
        if rc != 0:
            raise core_error(what, rc)

    def add_bos(self) -> bool:
        """Whether the vocabulary asks for BOS in front of a text."""
        return bool(lib.powerinfer_vocab_add_bos(self.ptr))

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> List[int]:
        """Token ids of utf-8 `text` (RuntimeError if the core cannot tokenize it). Invalid
        UTF-8 is safe: the core hands libllama's code-point tokenizers a 4-byte form of a
        number past U+10FFFF as U+FFFD x 4 (it made libllama throw through its C API)."""
        ptr = self.ptr
        n_max = len(text) + 8
        for _ in range(2):
            buf = ffi.new("powerinfer_token[]", n_max)
            n = lib.powerinfer_tokenize(ptr, text, len(text), buf, n_max, add_special, parse_special)
            if n >= 0:
                return list(ffi.unpack(buf, n))
            if n == _ERROR:
                break
            n_max = -n
        raise RuntimeError(f'Failed to tokenize: text="{text!r}" n_tokens={n}: {last_error()}')

    def token_to_piece(self, token: int, special: bool) -> bytes:
        """The text of one token: RuntimeError for an id outside the vocabulary (the core's
        error), OverflowError for one that is not an int32."""
        ptr = self.ptr
        size = 64
        while True:
            buf = ffi.new("char[]", size)
            n = lib.powerinfer_token_to_piece(ptr, int(token), buf, size, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:]
            # The error return (INT32_MIN) is no size request: taken for one, it made a
            # 2 GiB buffer and then an OverflowError that hid the core's message.
            if n == _ERROR or -n <= size:
                raise RuntimeError(f"Failed to convert token {token} to text: {last_error()}")
            size = -n

    # ---- hybrid placement input --------------------------------------------------------------

    def set_act_counts(self, counts: np.ndarray, what: Optional[str] = None) -> None:
        """Per-neuron activation counts [n_layer, n_ff] for the placement (before the first context)."""
        flat = np.ascontiguousarray(counts, dtype=np.float32)
        n_layer, n_ff = flat.shape
        rc = lib.powerinfer_model_set_act_counts(self.ptr, ffi.cast("float *", flat.ctypes.data), n_layer, n_ff)
        if rc != 0:
            raise core_error(what or "activation counts rejected")
