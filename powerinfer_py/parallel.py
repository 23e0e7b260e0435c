"""`ParallelLlama`: one model serving several generations at once, with continuous batching.

    llm = Llama(model_path="model.gguf", n_ctx=2048, repack=False, pack_dense=True)
    pool = ParallelLlama(llm, n_parallel=4)
    def ask(question):
        with pool.slot() as slot:          # a Llama of its own, sharing llm's model
            return slot.create_completion(question, max_tokens=64)
    answers = list(ThreadPoolExecutor(4).map(ask, questions))

Design (docs/parallel.md):
- The pool owns one context of the model with `n_parallel` sequences in one KV cache of
  n_parallel * n_ctx cells; each slot is a `Llama` whose KV cache is one of those
  sequences, so everything a Llama does (completion, chat, streaming, logprobs, grammar,
  stop strings) works on a slot unchanged, and a slot keeps the full n_ctx of `llm`.
- A slot's decode calls do not compute anything themselves: they queue their tokens and
  wait. One engine thread takes every queued request, waits a moment for the other busy
  slots to queue theirs (the previous step's duration at most), and computes them as one
  batch (`powerinfer_decode_batch`): a step of 4 generating slots reads the weights once.
  With pack_dense=True (what the server uses) the matmuls run on the packed kernels, which
  also reuse each loaded weight for 4 batch columns and compute every column alone, so a
  step of 4 costs about 2 steps of 1 and each stream equals its solo run bit for bit.
  With a sparse model, batches above the context's sparse_max_batch would run the dense
  FFN, so prompts are then computed apart from the one-token steps; each sequence gets
  the result it would get alone (up to summation order, see docs/parallel.md).
- Prompt cache: a slot keeps its last sequence in the cache; a new generation on a slot
  first takes over the longest prefix of its prompt held by any idle slot (cells are
  shared, not copied), then decodes only the rest.
- Every step runs on the engine thread. Before it starts, the pool hands back the OpenMP
  worker pool of the thread that made it (powerinfer_release_threads): with two such pools
  on the CPUs libgomp's barriers sleep and steps run 2-3x slower (docs/parallel.md).
- `Llama` itself stays single-sequence, as upstream.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ._core import Context, PowerInferError, release_threads
from .llama import Llama

__all__ = ["ParallelLlama"]

# Longest the engine waits for the other busy slots to queue their tokens before it
# computes a step without them (they join the next one).
_MAX_GATHER_S = 0.02


class _Request:
    __slots__ = ("seq", "tokens", "pos", "logits_all", "done", "logits", "error")

    def __init__(self, seq: int, tokens: List[int], pos: int, logits_all: bool):
        self.seq, self.tokens, self.pos, self.logits_all = seq, tokens, pos, logits_all
        self.done = threading.Event()
        self.logits: Optional[np.ndarray] = None
        self.error: Optional[BaseException] = None


class _SequenceContext:
    """What a Llama needs of its Context, for one sequence of the pool's context."""

    def __init__(self, pool: "ParallelLlama", seq: int, n_ctx: int):
        self._pool, self.seq, self._n_ctx = pool, seq, n_ctx
        self._logits = np.zeros((0, pool.n_vocab), dtype=np.float32)
        self.params = pool._ctx.params

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_batch(self) -> int:
        return self._pool._ctx.n_batch()

    def n_outputs(self) -> int:
        return len(self._logits)

    def decode(self, tokens: Sequence[int], pos: int, logits_all: bool = False) -> None:
        self._logits = self._pool._submit(self.seq, [int(t) for t in tokens], pos, logits_all)

    def logits(self, row: int = -1, n_rows: int = 1) -> np.ndarray:
        n = len(self._logits)
        start = row + n if row < 0 else row
        if start < 0 or start + n_rows > n:
            raise PowerInferError(f"no logits for output row {row} ({n} rows)")
        return self._logits[start] if n_rows == 1 else self._logits[start : start + n_rows]

    def kv_pos(self) -> int:
        return self._pool._with_ctx(lambda ctx: ctx.kv_seq_pos_max(self.seq) + 1)

    def kv_truncate(self, n_keep: int) -> None:
        self._pool._with_ctx(lambda ctx: ctx.kv_seq_rm(self.seq, n_keep, -1))

    def timings(self) -> Dict[str, float]:
        return self._pool._with_ctx(lambda ctx: ctx.timings())

    def reset_timings(self) -> None:
        self._pool._with_ctx(lambda ctx: ctx.reset_timings())

    def sparse_stats(self, layer: int):
        return self._pool._with_ctx(lambda ctx: ctx.sparse_stats(layer))

    def placement(self) -> Dict[str, Any]:
        return self._pool._with_ctx(lambda ctx: ctx.placement())

    def hot_neurons(self, layer: int) -> np.ndarray:
        return self._pool._with_ctx(lambda ctx: ctx.hot_neurons(layer))

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{what} is not available on a slot of a ParallelLlama; use a Llama of its own")

    def state_save(self) -> bytes:
        self._unsupported("save_state")

    def state_load(self, data: bytes) -> None:
        self._unsupported("load_state")

    def embeddings(self, row: int = 0, n_rows: int = 1) -> np.ndarray:
        self._unsupported("embeddings")

    def close(self) -> None:
        pass

    @property
    def ptr(self):
        self._unsupported("the raw context pointer (Llama.ctx)")


_GENERATE_SIGNATURE = inspect.signature(Llama.generate)


class _Slot(Llama):
    """A Llama over one sequence of a ParallelLlama (made by the pool, never directly)."""

    def __init__(self, pool: "ParallelLlama", base: Llama, seq: int, n_ctx: int):  # noqa: D107 (no Llama.__init__)
        self.__dict__.update(base.__dict__)  # the model, tokenizer, chat handlers, settings
        self._pool = pool
        self.seq_id = seq
        self._ctx = _SequenceContext(pool, seq, n_ctx)  # type: ignore[assignment]
        self._n_ctx = n_ctx
        self.input_ids = np.zeros((n_ctx,), dtype=np.intc)
        self.scores = np.zeros((n_ctx if self._logits_all else 1, self._n_vocab), dtype=np.single)
        self.n_tokens = 0
        self._requires_eval = True
        self._sampler = None
        self.cache = None
        self._pieces = base._pieces

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any):
        bound = _GENERATE_SIGNATURE.bind(self, tokens, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["reset"]:
            self._pool._adopt_prefix(self, [int(t) for t in tokens])
        return super().generate(tokens, *args, **kwargs)

    def close(self) -> None:  # the pool owns the model and the context
        self._sampler = None

    def __del__(self) -> None:
        pass


class ParallelLlama:
    """`n_parallel` slots over one model: see the module docstring."""

    def __init__(self, llama: Llama, n_parallel: int = 4, *, n_ctx: Optional[int] = None):
        if not isinstance(llama, Llama) or getattr(llama, "_fallback", None) is not None:
            raise ValueError("ParallelLlama needs a powerinfer_py.Llama running on the powerinfer engine")
        if llama._model is None or llama._ctx is None:
            raise ValueError("ParallelLlama needs a Llama with a model and a context (not vocab_only, not closed)")
        if not isinstance(n_parallel, int) or not 1 <= n_parallel <= 64:
            raise ValueError(f"n_parallel must be an int in [1, 64], not {n_parallel!r}")
        n_ctx_slot = llama.n_ctx() if not n_ctx else int(n_ctx)
        if n_ctx_slot <= 0:
            raise ValueError(f"n_ctx must be > 0, not {n_ctx!r}")
        base_params = llama.context_params
        self._llama = llama
        self.n_parallel = n_parallel
        self.n_vocab = llama.n_vocab()
        self._ctx = Context(
            llama._model, n_ctx=n_ctx_slot * n_parallel, n_batch=llama.n_batch, n_seq_max=n_parallel,
            n_threads=llama.n_threads, n_threads_batch=llama.n_threads_batch, seed=base_params.seed,
            # Flash attention visits a sequence's cells in position order and skips the rest;
            # with ggml's reference kernels (no tiling, no split of the cache over threads) a
            # token's result then depends neither on its batch nor on where its cells sit.
            flash_attn=base_params.flash_attn if base_params.flash_attn >= 0 else 1, embeddings=False,
            batch_invariant=True,
        )  # fmt: skip
        self.n_ctx_slot = min(n_ctx_slot, self._ctx.n_ctx())
        self._sparse_max_batch = self._ctx.sparse_max_batch()
        self._dense = llama.sparse_mode_in_use() == "dense"
        self._ctx_lock = threading.Lock()  # the context: decode and KV edits
        self._slots = [_Slot(self, llama, i, self.n_ctx_slot) for i in range(n_parallel)]
        self._row_buffers = [np.empty((1, self.n_vocab), dtype=np.float32) for _ in range(n_parallel)]
        self._free: Deque[int] = collections.deque(range(n_parallel))  # idle longest first
        self._slot_cond = threading.Condition()
        self._n_waiting = 0
        self._cond = threading.Condition()
        self._pending: List[_Request] = []
        self._closed = False
        self._step_s = 0.0  # moving average of a step's compute time
        self.stats: Dict[str, float] = {
            "steps": 0,  # decode_batch calls
            "tokens_prompt": 0,  # tokens of requests of more than one token
            "tokens_generated": 0,  # one-token requests (generation steps)
            "batch_tokens_max": 0,
            "busy_seconds": 0.0,  # time spent computing
            "prompt_tokens_reused": 0,  # prompt tokens found in the cache (own or adopted prefix)
            "requests": 0,  # slots handed out
        }
        # A Llama that computed on this thread keeps an OpenMP pool here; the engine's own
        # would make two (see the module docstring).
        release_threads()
        self._engine = threading.Thread(target=self._run, name="powerinfer-batch", daemon=True)
        self._engine.start()

    # ---- slots -------------------------------------------------------------------------

    def acquire(self, timeout: Optional[float] = None) -> Llama:
        """A free slot (waits for one); give it back with release(). The slot that has been
        idle longest is handed out, so recent prompts stay cached for adoption."""
        with self._slot_cond:
            self._n_waiting += 1
            try:
                if not self._slot_cond.wait_for(lambda: self._free or self._closed, timeout):
                    raise TimeoutError(f"no free slot within {timeout} s")
            finally:
                self._n_waiting -= 1
            if self._closed:
                raise RuntimeError("the ParallelLlama is closed")
            self.stats["requests"] += 1
            return self._slots[self._free.popleft()]

    def release(self, slot: Llama) -> None:
        with self._slot_cond:
            if not isinstance(slot, _Slot) or slot._pool is not self or slot.seq_id in self._free:
                raise ValueError("release() takes a slot acquired from this pool, once")
            slot._sampler = None
            self._free.append(slot.seq_id)
            self._slot_cond.notify()

    @contextlib.contextmanager
    def slot(self, timeout: Optional[float] = None) -> Iterator[Llama]:
        s = self.acquire(timeout)
        try:
            yield s
        finally:
            self.release(s)

    @property
    def slots_busy(self) -> int:
        return self.n_parallel - len(self._free)

    @property
    def requests_waiting(self) -> int:
        return self._n_waiting

    def _adopt_prefix(self, slot: _Slot, tokens: List[int]) -> None:
        """Before a generation on `slot`: if an idle slot holds a longer prefix of `tokens`
        than `slot` itself, `slot`'s sequence becomes that prefix (shared cells)."""
        if not tokens:
            return
        prompt = np.asarray(tokens, dtype=np.intc)
        own = _common_prefix(slot.input_ids[: slot.n_tokens], prompt)
        with self._slot_cond:  # idle slots stay idle (and unchanged) meanwhile
            best, best_len = None, own
            for i in self._free:
                other = self._slots[i]
                n = _common_prefix(other.input_ids[: other.n_tokens], prompt)
                if n > best_len:
                    best, best_len = other, n
            if best is not None:
                src = best
                self._with_ctx(lambda ctx: (ctx.kv_seq_rm(slot.seq_id, 0, -1),
                                            ctx.kv_seq_cp(src.seq_id, slot.seq_id, 0, best_len)))
                slot.input_ids[:best_len] = src.input_ids[:best_len]
                slot.n_tokens = best_len
                slot._requires_eval = True
        # The last prompt token is decoded again for its logits.
        self.stats["prompt_tokens_reused"] += max(min(best_len, len(tokens) - 1), 0)

    # ---- the engine -----------------------------------------------------------------------

    def _with_ctx(self, fn):
        with self._ctx_lock:
            return fn(self._ctx)

    def _submit(self, seq: int, tokens: List[int], pos: int, logits_all: bool) -> np.ndarray:
        request = _Request(seq, tokens, pos, logits_all)
        with self._cond:
            if self._closed:
                raise RuntimeError("the ParallelLlama is closed")
            self._pending.append(request)
            # The engine waits for the first request (it starts the gathering) and for the
            # last of the busy slots' (the step can start); the others need not wake it.
            if len(self._pending) == 1 or len(self._pending) >= self.slots_busy:
                self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                # Let the other busy slots queue their next tokens, for one step's time at most.
                deadline = time.perf_counter() + min(self._step_s, _MAX_GATHER_S)
                while len(self._pending) < self.slots_busy and not self._closed:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                groups = self._groups(self._pending)
                self._pending = []
            for group in groups:
                try:
                    self._step(group)
                except BaseException as exc:  # a bug outside the decode: fail the step, keep the engine
                    for r in group:
                        if r.logits is None and r.error is None:
                            r.error = exc
                        r.done.set()

    def _groups(self, pending: List[_Request]) -> List[List[_Request]]:
        """The batches of one engine pass, in arrival order, one-token steps first. With a
        sparse model a batch holds at most sparse_max_batch tokens (above it the dense FFN
        would run), and a longer request, or one holding its sequence's first token (which
        the core computes with every neuron), is computed alone, so every request takes the
        FFN path it takes alone; a dense model computes the whole queue at once."""
        if self._dense:
            return [pending]
        limit = self._sparse_max_batch
        groups: List[List[_Request]] = []
        current: List[_Request] = []
        n = 0
        for r in sorted(pending, key=lambda r: len(r.tokens) > 1):  # stable: steps, then prompts
            if len(r.tokens) > limit or r.pos == 0:
                groups.append([r])
                continue
            if n + len(r.tokens) > limit:
                groups.append(current)
                current, n = [], 0
            current.append(r)
            n += len(r.tokens)
        return groups + [current] if current else groups

    def _step(self, group: List[_Request]) -> None:
        t0 = time.perf_counter()
        with self._ctx_lock:
            ctx = self._ctx
            ready = []
            for r in group:
                # Cells from pos on are overwritten, as in Llama's own decode.
                n_cached = ctx.kv_seq_pos_max(r.seq) + 1
                if r.pos > n_cached:
                    r.error = PowerInferError(f"position {r.pos} is past the {n_cached} cached positions of sequence {r.seq}")
                    continue
                if r.pos < n_cached:
                    ctx.kv_seq_rm(r.seq, r.pos, -1)
                ready.append(r)
            tokens: List[int] = []
            seqs: List[int] = []
            flags: List[bool] = []
            for r in ready:
                n = len(r.tokens)
                tokens += r.tokens
                seqs += [r.seq] * n
                flags += [r.logits_all] * (n - 1) + [True]
            try:
                if ready:
                    n_out = ctx.decode_batch(tokens, seqs, flags)
                    rows = ctx.logits(0, n_out).reshape(n_out, self.n_vocab)
                    k = 0
                    for r in ready:
                        n = len(r.tokens) if r.logits_all else 1
                        r.logits = self._rows_of(r.seq, n)
                        np.copyto(r.logits, rows[k : k + n])
                        k += n
            except BaseException as exc:
                for r in ready:
                    r.error = exc
        dt = time.perf_counter() - t0
        self._step_s = dt if self._step_s == 0.0 else 0.8 * self._step_s + 0.2 * dt
        stats = self.stats
        stats["steps"] += 1
        stats["busy_seconds"] += dt
        stats["batch_tokens_max"] = max(stats["batch_tokens_max"], len(tokens))
        for r in ready:
            stats["tokens_generated" if len(r.tokens) == 1 else "tokens_prompt"] += len(r.tokens)
        for r in group:
            r.done.set()

    def _rows_of(self, seq: int, n: int) -> np.ndarray:
        """Where sequence seq's n logits rows of this step go. One row (a generation step)
        reuses the sequence's buffer, as a Context reuses its own: the slot's view of the
        previous row is valid until its next decode, which is this one (and a fresh
        200-600 KB array per token is a fresh mmap, whose pages fault in one by one)."""
        if n > 1:
            return np.empty((n, self.n_vocab), dtype=np.float32)
        return self._row_buffers[seq]

    # ---- observability and lifetime ----------------------------------------------------------

    def sparse_active_fraction(self) -> Optional[float]:
        """Share of FFN neurons the sparse steps computed since the pool was made (None: no sparse step)."""
        n_layer = self._llama._model.n_layer()
        counts = self._with_ctx(lambda ctx: [ctx.sparse_stats(il) for il in range(n_layer)])
        total = sum(n for _, n in counts)
        return sum(a for a, _ in counts) / total if total else None

    def kv_cells_used(self) -> int:
        return self._with_ctx(lambda ctx: ctx.kv_used_cells())

    def close(self) -> None:
        """Stop the engine and free the pool's context (not the Llama it was made from)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with self._slot_cond:
            self._slot_cond.notify_all()
        self._engine.join()
        with self._ctx_lock:
            self._ctx.close()

    def __enter__(self) -> "ParallelLlama":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
