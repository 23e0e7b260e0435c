"""`Context`: an owned `struct powerinfer_context *` (KV cache, decode, logits, state,
counters, placement), in the style of llama-cpp-python's _internals.LlamaContext.

`Context(model, **params)` creates it with the core's default context parameters,
overridden by the given `struct powerinfer_context_params` fields, and raises
PowerInferError when the core refuses. `close()` releases it exactly once and it is a
context manager; the core keeps its model's memory while it lives (and a batcher keeps the
context's), whatever order the handles are closed or collected in.

Arrays returned as views (logits, embeddings, FFN capture) point into the core's
buffers and are valid until the next decode: copy them to keep them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .bindings import ffi, lib
from .errors import OK, core_error
from .handle import Handle
from .model import Model


def release_threads() -> bool:
    """Hand back the calling thread's OpenMP worker pool (powerinfer_release_threads):
    call it on a thread that computed and is done computing for a while, so that the
    thread that computes next does not share the CPUs with a second pool (libgomp's
    barriers then sleep: 2-3x slower graphs). False: ggml has no OpenMP runtime here."""
    return bool(lib.powerinfer_release_threads())


def context_params(**fields: Any):
    """struct powerinfer_context_params: the core's defaults with `fields` set by name."""
    params = lib.powerinfer_context_default_params()
    for name, value in fields.items():
        try:
            setattr(params, name, value)
        except AttributeError:
            raise TypeError(f"struct powerinfer_context_params has no field {name!r}") from None
    return params


def _float_view(ptr, n_rows: int, n_cols: int) -> np.ndarray:
    return np.frombuffer(ffi.buffer(ptr, n_rows * n_cols * 4), dtype=np.float32).reshape(n_rows, n_cols)


class Context(Handle):
    """A context of a Model."""

    _kind = "context"

    def __init__(self, model: Model, **params: Any):
        self.model = model  # the context points into the model: keep it alive
        self.params = context_params(**params)
        ptr = lib.powerinfer_context_new(model.ptr, self.params)
        if ptr == ffi.NULL:
            raise core_error(f"Failed to create a context for {model.path}")
        self._ptr = ptr
        self.n_vocab = model.n_vocab()
        self.n_embd = model.n_embd()

    def _free(self, ptr) -> None:
        lib.powerinfer_context_free(ptr)

    # ---- sizes ---------------------------------------------------------------------------

    def n_ctx(self) -> int:
        return int(lib.powerinfer_n_ctx(self.ptr))

    def n_batch(self) -> int:
        return int(lib.powerinfer_n_batch(self.ptr))

    def sparse_max_batch(self) -> int:
        """The largest batch that takes the sparse FFN path in this context."""
        return int(lib.powerinfer_sparse_max_batch(self.ptr))

    def n_outputs(self) -> int:
        """Rows of logits of the last decode."""
        return int(lib.powerinfer_n_outputs(self.ptr))

    # ---- decode and outputs ------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], pos: int, logits_all: bool = False) -> None:
        """Compute `tokens` at positions pos, pos+1, ... (cache cells from pos on are
        overwritten); logits for every token with logits_all, else for the last one."""
        n = len(tokens)
        buf = ffi.new("powerinfer_token[]", [int(t) for t in tokens])
        rc = lib.powerinfer_decode(self.ptr, buf, n, pos, logits_all)
        if rc != OK:
            raise core_error(f"powerinfer_decode of {n} tokens at position {pos} failed", rc)

    def logits(self, row: int = -1, n_rows: int = 1) -> np.ndarray:
        """n_rows rows of logits of the last decode from `row` on (-1: the last row), as a
        view: float32 [n_vocab] for one row, else [n_rows, n_vocab]."""
        ptr = lib.powerinfer_get_logits_ith(self.ptr, row)
        if ptr == ffi.NULL:
            raise core_error(f"no logits for output row {row}")
        view = _float_view(ptr, n_rows, self.n_vocab)
        return view[0] if n_rows == 1 else view

    def embeddings(self, row: int = 0, n_rows: int = 1) -> np.ndarray:
        """float32 [n_rows, n_embd]: final-norm hidden states of output rows `row`...
        (needs embeddings=True), as a view."""
        ptr = lib.powerinfer_get_embeddings_ith(self.ptr, row)
        if ptr == ffi.NULL:
            raise core_error("no embeddings from the core")
        return _float_view(ptr, n_rows, self.n_embd)

    def decode_batch(self, tokens: Sequence[int], seq_ids: Sequence[int], logits: Sequence[bool],
                     pos: Optional[Sequence[int]] = None) -> int:
        """Compute a batch mixing tokens of several sequences (powerinfer_decode_batch): each
        sequence's tokens continue its cached positions (or take `pos`); the logits rows are
        those of the tokens flagged in `logits`, in batch order. Returns their number."""
        n = len(tokens)
        if not (len(seq_ids) == len(logits) == n) or (pos is not None and len(pos) != n):
            raise ValueError("decode_batch: tokens, seq_ids, logits (and pos) must have the same length")
        keep = [ffi.new("powerinfer_token[]", [int(t) for t in tokens]),
                ffi.new("int32_t[]", [int(s) for s in seq_ids]),
                ffi.new("int8_t[]", [1 if f else 0 for f in logits])]
        batch = ffi.new("struct powerinfer_batch *")
        batch.n_tokens, batch.token, batch.seq_id, batch.logits = n, keep[0], keep[1], keep[2]
        if pos is not None:
            keep.append(ffi.new("int32_t[]", [int(p) for p in pos]))
            batch.pos = keep[3]
        rc = lib.powerinfer_decode_batch(self.ptr, batch[0])
        if rc != OK:
            raise core_error(f"powerinfer_decode_batch of {n} tokens failed", rc)
        return self.n_outputs()

    # ---- KV cache and state --------------------------------------------------------------------

    def kv_seq_pos_max(self, seq: int) -> int:
        """Largest cached position of sequence `seq`, -1 if none."""
        return int(lib.powerinfer_kv_seq_pos_max(self.ptr, seq))

    def kv_seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Sequence `seq` (-1: all) forgets its positions in [p0, p1) (p1 < 0: to the end)."""
        rc = lib.powerinfer_kv_seq_rm(self.ptr, seq, p0, p1)
        if rc != OK:
            raise core_error(f"powerinfer_kv_seq_rm({seq}, {p0}, {p1}) failed", rc)

    def kv_seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Sequence `dst` also sees `src`'s positions in [p0, p1) (shared cells, no copy)."""
        rc = lib.powerinfer_kv_seq_cp(self.ptr, src, dst, p0, p1)
        if rc != OK:
            raise core_error(f"powerinfer_kv_seq_cp({src}, {dst}, {p0}, {p1}) failed", rc)

    def kv_seq_keep(self, seq: int) -> None:
        rc = lib.powerinfer_kv_seq_keep(self.ptr, seq)
        if rc != OK:
            raise core_error(f"powerinfer_kv_seq_keep({seq}) failed", rc)

    def kv_used_cells(self) -> int:
        """Cells of the KV cache in use (cells shared by sequences count once)."""
        return int(lib.powerinfer_kv_used_cells(self.ptr))

    def kv_pos(self) -> int:
        """Positions held in the KV cache."""
        return int(lib.powerinfer_kv_pos(self.ptr))

    def kv_truncate(self, n_keep: int) -> None:
        """Keep the first n_keep positions of the KV cache."""
        rc = lib.powerinfer_kv_truncate(self.ptr, n_keep)
        if rc != OK:
            raise core_error(f"powerinfer_kv_truncate({n_keep}) failed", rc)

    def state_save(self) -> bytes:
        """The context state (cached positions, their keys/values, the last logits)."""
        ptr = self.ptr
        size = int(lib.powerinfer_state_size(ptr))
        buf = ffi.new("uint8_t[]", size)
        n_bytes = int(lib.powerinfer_state_save(ptr, buf, size))
        if n_bytes == 0:
            raise core_error("Failed to copy llama state data")
        return ffi.buffer(buf, n_bytes)[:]

    def state_load(self, data: bytes) -> None:
        """Restore a state_save() of a context of the same model file, with no larger n_ctx."""
        rc = lib.powerinfer_state_load(self.ptr, ffi.from_buffer("uint8_t[]", data), len(data))
        if rc != OK:
            raise core_error("Failed to set llama state data", rc)

    def state_seq_save(self, seq: int) -> bytes:
        """Sequence `seq`'s cached positions (keys and values, no logits), in state_save's format."""
        ptr = self.ptr
        size = int(lib.powerinfer_state_seq_size(ptr, seq))
        buf = ffi.new("uint8_t[]", size)
        n_bytes = int(lib.powerinfer_state_seq_save(ptr, seq, buf, size)) if size else 0
        if n_bytes == 0:
            raise core_error(f"could not save the state of sequence {seq}")
        return ffi.buffer(buf, n_bytes)[:]

    def state_seq_load(self, seq: int, data: bytes) -> None:
        """Replace sequence `seq`'s cache with a state_seq_save() or state_save() of this model."""
        rc = lib.powerinfer_state_seq_load(self.ptr, seq, ffi.from_buffer("uint8_t[]", data), len(data))
        if rc != OK:
            raise core_error(f"could not load the state of sequence {seq}", rc)

    # ---- counters --------------------------------------------------------------------------------

    def timings(self) -> Dict[str, float]:
        """struct powerinfer_timings as a dict (prompt: decodes of more than one token)."""
        t = lib.powerinfer_get_timings(self.ptr)
        return {name: getattr(t, name) for name, _ in ffi.typeof(t).fields}

    def reset_timings(self) -> None:
        """Reset the timings and the sparse statistics."""
        lib.powerinfer_reset_timings(self.ptr)

    def sparse_stats(self, layer: int) -> Tuple[int, int]:
        """(active FFN neurons, neurons considered) of `layer`, summed over the sparse steps."""
        active, total = ffi.new("int64_t *"), ffi.new("int64_t *")
        rc = lib.powerinfer_sparse_stats(self.ptr, layer, active, total)
        if rc != OK:
            raise core_error(f"sparse statistics of layer {layer}", rc)
        return int(active[0]), int(total[0])

    def input_stats(self, layer: int, input: int) -> Tuple[int, int]:
        """Input mode: (kept entries, entries considered) of input `input` of `layer`, per token,
        summed over the sparse steps; (n_layer, 0) is the output matrix's input."""
        kept, total = ffi.new("int64_t *"), ffi.new("int64_t *")
        rc = lib.powerinfer_input_stats(self.ptr, layer, input, kept, total)
        if rc != OK:
            raise core_error(f"input statistics of layer {layer}, input {input}", rc)
        return int(kept[0]), int(total[0])

    def set_input_threshold(self, layer: int, input: int, tau: float) -> None:
        """Input mode: the threshold of input `input` of `layer` for later steps (the input
        must have its column copy: a threshold >= 0 in the file)."""
        rc = lib.powerinfer_set_input_threshold(self.ptr, layer, input, float(tau))
        if rc != OK:
            raise core_error(f"input threshold of layer {layer}, input {input}", rc)

    def input_histograms(self) -> Tuple[np.ndarray, float, float]:
        """Histograms of |x| of every matrix's input since the context was made (needs
        collect_activations=True): (counts uint64 [n_layer + 1, 4, n_bins], log10_min, log10_max),
        inputs in the order of model.INPUTS; row n_layer, input 0 is the output matrix's input
        (the final norm's output; the row's other entries stay 0)."""
        ptr = self.ptr
        lo, hi = ffi.new("float *"), ffi.new("float *")
        n_bins = lib.powerinfer_input_histogram(ptr, 0, 0, ffi.NULL, 0, lo, hi)
        n_layer = self.model.n_layer()
        counts = np.zeros((n_layer + 1, 4, max(n_bins, 0)), dtype=np.uint64)
        buf = ffi.new("uint64_t[]", max(n_bins, 1))
        for il in range(n_layer + 1):
            for i in range(4 if il < n_layer else 1):
                if lib.powerinfer_input_histogram(ptr, il, i, buf, n_bins, lo, hi) != n_bins:
                    raise core_error(f"input histogram of layer {il}, input {i}")
                counts[il, i] = np.frombuffer(ffi.buffer(buf, 8 * n_bins), dtype=np.uint64)
        return counts, float(lo[0]), float(hi[0])

    def activation_histograms(self) -> Tuple[np.ndarray, float, float]:
        """Per-layer histograms of |act(gate)| since the context was made (needs
        collect_activations=True): (counts uint64 [n_layer, n_bins], log10_min, log10_max)."""
        ptr = self.ptr
        lo, hi = ffi.new("float *"), ffi.new("float *")
        n_bins = lib.powerinfer_activation_histogram(ptr, 0, ffi.NULL, 0, lo, hi)
        n_layer = self.model.n_layer()
        counts = np.zeros((n_layer, max(n_bins, 0)), dtype=np.uint64)
        buf = ffi.new("uint64_t[]", max(n_bins, 1))
        for il in range(n_layer):
            if lib.powerinfer_activation_histogram(ptr, il, buf, n_bins, lo, hi) != n_bins:
                raise core_error(f"activation histogram of layer {il}")
            counts[il] = np.frombuffer(ffi.buffer(buf, 8 * n_bins), dtype=np.uint64)
        return counts, float(lo[0]), float(hi[0])

    # ---- profiling ---------------------------------------------------------------------------------

    def set_ffn_capture(self, enable: bool) -> None:
        """While enabled, decodes run the dense FFN and keep every layer's FFN input and activation."""
        rc = lib.powerinfer_set_ffn_capture(self.ptr, enable)
        if rc != OK:
            raise core_error("the engine cannot capture FFN activations", rc)

    def ffn_capture(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """(x_res [T, n_embd], act [T, n_ff]) of `layer` for the T tokens of the last chunk, as
        copies (views into the core's buffers would dangle once the context is closed)."""
        xp, ap = ffi.new("float **"), ffi.new("float **")
        t = lib.powerinfer_get_ffn_capture(self.ptr, layer, xp, ap)
        if t < 0:
            raise core_error(f"FFN capture of layer {layer}", t)
        return _float_view(xp[0], t, self.n_embd).copy(), _float_view(ap[0], t, self.model.n_ff()).copy()

    # ---- hybrid placement ------------------------------------------------------------------------------

    def placement(self) -> Dict[str, Any]:
        """What the placement put on the devices (struct powerinfer_placement; bytes, all
        devices together) and, under "devices", each one's share (struct
        powerinfer_placement_device: its budget is never exceeded)."""
        ptr = self.ptr
        p = ffi.new("struct powerinfer_placement *")
        lib.powerinfer_get_placement(ptr, p)
        out: Dict[str, Any] = {"device": ffi.string(p.device).decode()}
        for k in ("active", "emulated", "from_cache", "layer_split"):
            out[k] = bool(getattr(p, k))
        for k in ("budget", "bytes_total", "bytes_dense", "bytes_kv", "bytes_compute", "bytes_ffn",
                  "n_layers_attn", "n_hot", "n_neurons", "n_devices"):
            out[k] = int(getattr(p, k))
        devices = []
        d = ffi.new("struct powerinfer_placement_device *")
        for i in range(out["n_devices"]):
            if lib.powerinfer_get_placement_device(ptr, i, d) != OK:
                raise core_error(f"placement of device {i}")
            dev: Dict[str, Any] = {"name": ffi.string(d.name).decode(), "rpc": bool(d.rpc), "emulated": bool(d.emulated)}
            for k in ("budget", "bytes_total", "bytes_dense", "bytes_kv", "bytes_compute", "bytes_ffn",
                      "n_layers_attn", "n_hot", "memory_free", "memory_total"):
                dev[k] = int(getattr(d, k))
            devices.append(dev)
        out["devices"] = devices
        return out

    def hot_neurons(self, layer: int) -> np.ndarray:
        """Ids of the FFN neurons of `layer` placed on the device (ascending)."""
        ptr = self.ptr
        n = lib.powerinfer_layer_hot_neurons(ptr, layer, ffi.NULL, 0)
        if n < 0:
            raise core_error("hot_neurons")
        ids = np.zeros(max(n, 1), dtype=np.int32)
        lib.powerinfer_layer_hot_neurons(ptr, layer, ffi.cast("int32_t *", ids.ctypes.data), n)
        return ids[:n]
