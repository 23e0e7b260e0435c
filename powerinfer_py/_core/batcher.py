"""`Batcher`: an owned `struct powerinfer_batcher *`, the continuous-batching thread of a
Context with several sequences (batcher.c): decodes asked for by several threads become
one batch per step, and sequences that run ahead are sampled in the core.

Every call that waits (decode, next, stop, lock) releases the GIL while it waits (cffi
releases it around every call), so Python threads keep running while a step computes.

Lifetime: close() (from any thread, or garbage collection, or interpreter exit) first
closes the core's batcher, which ends the step under way, joins its thread and wakes every
caller waiting in it with an error; then waits until no thread is inside a call; then
frees it. A call made while it closes raises RuntimeError, except stop(), which has nothing
left to stop. The core holds the context and each running sequence's sampler, so neither
can be freed under a step, in whatever order the handles go.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from typing import Dict, Iterator, List, Sequence

import numpy as np

from .bindings import ffi, lib
from .context import Context
from .errors import OK, core_error
from .handle import Handle
from .sampler import Sampler


# Batchers not closed yet: closed at interpreter exit, before the runtime goes (a thread
# still computing while libraries unload would crash the exit).
_LIVE: "weakref.WeakSet[Batcher]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for batcher in list(_LIVE):
        batcher.close()


class Batcher(Handle):
    """The batcher of `ctx` (made with n_seq_max > 1). While it exists, decode the context
    only through it, and touch it otherwise (KV edits, counters) inside `locked()`."""

    _kind = "batcher"

    def __init__(self, ctx: Context, *, lookahead: int = 16, max_gather_ms: float = 20.0,
                 restart_within: float = 0.5, prompt_slice_ms: float = 250.0):
        self.ctx = ctx
        self.n_vocab = ctx.n_vocab
        self._gate = threading.Condition()
        self._users = 0  # threads inside a call
        self._closing = False
        params = lib.powerinfer_batcher_default_params()
        params.lookahead = int(lookahead)
        params.max_gather_ms = float(max_gather_ms)
        params.restart_within = float(restart_within)
        params.prompt_slice_ms = float(prompt_slice_ms)
        ptr = lib.powerinfer_batcher_new(ctx.ptr, params)
        if ptr == ffi.NULL:
            raise core_error("could not start the batcher")
        self._ptr = ptr
        self._token_bufs: Dict[int, "ffi.CData"] = {}
        _LIVE.add(self)

    @property
    def closed(self) -> bool:
        return self._closing or self._ptr is None

    @contextlib.contextmanager
    def _use(self) -> Iterator["ffi.CData"]:
        """The core's pointer for one call; close() frees it only once every call has left."""
        with self._gate:
            if self._closing or self._ptr is None:
                raise RuntimeError("the batcher was closed")
            self._users += 1
            ptr = self._ptr
        try:
            yield ptr
        finally:
            with self._gate:
                self._users -= 1
                if self._users == 0:
                    self._gate.notify_all()

    def close(self) -> None:
        """Stop the batcher and free it (idempotent; see the module docstring)."""
        with self._gate:
            if self._closing:
                while self._ptr is not None:  # another thread is closing it
                    self._gate.wait()
                return
            self._closing = True
            ptr = self._ptr
        if ptr is None:
            return
        lib.powerinfer_batcher_close(ptr)  # every waiting call returns; later ones fail
        with self._gate:
            while self._users:
                self._gate.wait()
            self._ptr = None
            self._gate.notify_all()
        lib.powerinfer_batcher_free(ptr)
        _LIVE.discard(self)

    def decode(self, seq: int, tokens: Sequence[int], pos: int, logits_all: bool, out: np.ndarray) -> int:
        """Compute `tokens` of sequence `seq` at positions pos, pos+1, ... in the next step and
        wait for it; the logits rows (every token's with logits_all, else the last one's) are
        written to `out` (float32, C-contiguous, [rows, n_vocab]). Returns the rows written."""
        n = len(tokens)
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.size % self.n_vocab:
            raise ValueError("decode: out must be a C-contiguous float32 array of whole logits rows")
        buf = ffi.new("powerinfer_token[]", [int(t) for t in tokens])
        with self._use() as ptr:
            rows = lib.powerinfer_batcher_decode(ptr, seq, buf, n, pos, logits_all,
                                                 ffi.from_buffer("float[]", out), out.size // self.n_vocab)
        if rows < 0:
            raise core_error(f"decode of {n} tokens of sequence {seq} at position {pos} failed", rows)
        return int(rows)

    def generate(self, seq: int, tokens: Sequence[int], pos: int, sampler: Sampler, n_predict: int,
                 pos_limit: int, stop_tokens: Sequence[int] = ()) -> None:
        """Start sequence `seq` running ahead (powerinfer_batcher_generate): `tokens` at
        positions pos..., then a token sampled with `sampler` from each step's row is handed
        over (next()) and decoded in the next step, until n_predict tokens (<= 0: no limit),
        an end-of-generation token or one of `stop_tokens`, position pos_limit, stop() or an
        error. The core holds `sampler` until then (closing it meanwhile is safe)."""
        n = len(tokens)
        buf = ffi.new("powerinfer_token[]", [int(t) for t in tokens])
        stop = ffi.new("powerinfer_token[]", [int(t) for t in stop_tokens]) if stop_tokens else ffi.NULL
        with self._use() as ptr:
            rc = lib.powerinfer_batcher_generate(ptr, seq, buf, n, pos, sampler.ptr, int(n_predict), int(pos_limit),
                                                 stop, len(stop_tokens))
        if rc != OK:
            raise core_error(f"sequence {seq} could not start generating", rc)

    def next(self, seq: int, n_max: int = 64) -> List[int]:
        """The next tokens sequence `seq` sampled (waits for at least one); [] once its run
        has ended and every token was taken; raises PowerInferError if an error ended it."""
        buf = self._token_bufs.get(seq)
        if buf is None or len(buf) < n_max:
            buf = self._token_bufs[seq] = ffi.new("powerinfer_token[]", n_max)
        with self._use() as ptr:
            n = lib.powerinfer_batcher_next(ptr, seq, buf, n_max)
        if n < 0:
            raise core_error(f"sequence {seq} stopped generating", n)
        return ffi.unpack(buf, n) if n else []

    def stop(self, seq: int, n_keep: int = -1) -> None:
        """End sequence `seq`'s run (if any) once no step computes for it, then keep its first
        n_keep cached positions (< 0: all). Closed (or closing): nothing runs, nothing to do."""
        try:
            with self._use() as ptr:
                rc = lib.powerinfer_batcher_stop(ptr, seq, int(n_keep))
        except RuntimeError:
            return
        if rc != OK and self.closed:
            return  # closed while it waited for the step
        if rc != OK:
            raise core_error(f"sequence {seq} could not be stopped", rc)

    def set_cancelled(self, seq: int, on: bool) -> None:
        """Mark sequence `seq` cancelled (or not), from any thread and without waiting for a
        step: its run ends at once, a pending decode before its next chunk, and later ones fail,
        with POWERINFER_ERR_ABORTED, until it is marked not cancelled again."""
        with self._use() as ptr:
            rc = lib.powerinfer_batcher_set_cancelled(ptr, seq, bool(on))
        if rc != OK:
            raise core_error(f"set_cancelled({seq})", rc)

    def set_lockstep(self, seq: int, on: bool) -> None:
        """A lockstep sequence decodes step after step through decode(): a step waits for its
        next request (the last step's duration, max_gather_ms at most) unless sequences
        running ahead are ready."""
        with self._use() as ptr:
            rc = lib.powerinfer_batcher_set_lockstep(ptr, seq, bool(on))
        if rc != OK:
            raise core_error(f"set_lockstep({seq})", rc)

    def kv_keep(self, seq: int, n_keep: int) -> None:
        """Sequence `seq` keeps its first n_keep cached positions: queued, applied before the
        next step's decodes (or locked()), in the order queued; never waits for a step."""
        with self._use() as ptr:
            rc = lib.powerinfer_batcher_kv_keep(ptr, seq, int(n_keep))
        if rc != OK:
            raise core_error(f"kv_keep({seq}, {n_keep})", rc)

    def kv_share(self, dst: int, src: int, n: int) -> None:
        """Sequence `dst` becomes sequence `src`'s first n positions (shared cells): queued like
        kv_keep."""
        with self._use() as ptr:
            rc = lib.powerinfer_batcher_kv_share(ptr, dst, src, int(n))
        if rc != OK:
            raise core_error(f"kv_share({dst}, {src}, {n})", rc)

    @contextlib.contextmanager
    def locked(self) -> Iterator[Context]:
        """The context between two steps (queued edits applied), for KV queries."""
        with self._use() as ptr:
            if lib.powerinfer_batcher_lock(ptr) != OK:
                raise core_error("the batcher's context")
            try:
                yield self.ctx
            finally:
                lib.powerinfer_batcher_unlock(ptr)

    def stats(self) -> Dict[str, float]:
        """struct powerinfer_batcher_stats as a dict, as of the last step (never waits for one)."""
        with self._use() as ptr:
            st = lib.powerinfer_batcher_get_stats(ptr)
        return {name: getattr(st, name) for name, _ in ffi.typeof(st).fields}
