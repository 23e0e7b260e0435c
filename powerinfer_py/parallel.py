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
- The core's batcher (`powerinfer_batcher`, batcher.c) computes every decode: a thread of
  its own turns what the slots ask for into one `powerinfer_decode_batch` per step, so a
  step of 4 generating slots reads the weights once. With pack_dense=True (what the server
  uses) the matmuls run on the packed kernels, which reuse each loaded weight for 4 batch
  columns and compute every column alone: a step of 4 costs about 1.5 steps of 1 and each
  stream equals its solo run bit for bit.
- A slot's generation runs ahead in the core when the core can sample it alone (no Python
  logits processor but a trailing logit bias and cancel checks, no stopping criteria but
  stop tokens, no logits rows read): the batcher samples each token with the slot's
  sampler right after its row is computed and decodes it in the next step, up to 16
  tokens ahead of the slot's Python code, which takes the tokens as it gets to them.
  Steps then never wait for Python. Other generations run in lockstep: the slot samples
  in Python and each step waits for the lockstep slots to ask (one step's duration at
  most).
- With a sparse model a step holds at most the context's sparse_max_batch tokens (above
  it the dense FFN would run); longer prompts and a sequence's first token are computed
  alone, so each request takes the FFN path it takes alone (up to summation order, see
  docs/parallel.md).
- A new request that finds a step just begun (less than `restart_within` of a step's time,
  default 0.5) interrupts it, and the step is computed again with the request's prompt in
  it: its first token then waits for one step, not nearly two. A step is interrupted once
  at most; dense models only (restart_within=0 turns it off; docs/parallel.md).
- Prompt cache: a slot keeps its last sequence in the cache; a new generation on a slot
  first takes over the longest prefix of its prompt held by any idle slot (cells are
  shared, not copied), then decodes only the rest.
- Before the batcher starts, the pool hands back the OpenMP worker pool of the thread that
  made it (powerinfer_release_threads): with two such pools on the CPUs libgomp's
  barriers sleep and steps run 2-3x slower (docs/parallel.md).
- `Llama` itself stays single-sequence, as upstream.
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ._core import Batcher, Context, PowerInferError, Sampler, release_threads
from ._core.errors import ERR_ABORTED
from ._llama.sequence import Sequence as SequenceState
from ._llama.sequence import common_prefix
from ._llama.speculative import SpeculativeStats
from .llama import Llama

__all__ = ["ParallelLlama"]

# Tokens a slot's generation may run ahead of its Python code (the batcher's lookahead):
# enough to ride out a burst of Python work (a stream's first chunks, the GIL held by
# another thread), few enough that a stop string found late wastes little.
_LOOKAHEAD = 16
# Longest a step waits for the lockstep slots to ask for their next decode (they join the
# next step otherwise); also at most the last step's duration.
_MAX_GATHER_MS = 20.0


class SlotBackend:
    """One sequence of the pool's context, the backend of a slot's Sequence
    (sequence.SequenceBackend): decoded by the pool's batcher. It also lets generation.generate
    run a generation ahead in the core (run_ahead), in lockstep with the batcher's steps
    (lockstep), and start from an idle slot's prefix (adopt_prefix)."""

    # A cancelled generation (CancelCheck) stops its prompt within a step of the batcher: the
    # Sequence does not cut the prompt into slices of its own (sequence.Sequence.eval).
    cancels_in_core = True

    def __init__(self, pool: "ParallelLlama", seq: int, n_ctx: int):
        self._pool, self.seq_id, self._n_ctx = pool, seq, n_ctx
        self._logits = np.zeros((0, pool.n_vocab), dtype=np.float32)
        self._row = np.empty((1, pool.n_vocab), dtype=np.float32)  # a generation step's row, reused
        self.params = pool._ctx.params

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_batch(self) -> int:
        return self._pool._ctx.n_batch()

    def sparse_max_batch(self) -> int:
        return self._pool._ctx.sparse_max_batch()

    def n_outputs(self) -> int:
        return len(self._logits)

    def decode(self, tokens: Sequence[int], pos: int, logits_all: bool = False) -> None:
        # One row reuses the sequence's buffer, as a Context reuses its own: the slot's view of
        # the previous row is valid until its next decode, which is this one (and a fresh
        # 200-600 KB array per token is a fresh mmap, whose pages fault in one by one).
        n_rows = len(tokens) if logits_all else 1
        out = self._row if n_rows == 1 else np.empty((n_rows, self._pool.n_vocab), dtype=np.float32)
        self._logits = self._logits[:0]  # a failed decode leaves no logits
        self._pool._batcher.decode(self.seq_id, tokens, pos, logits_all, out)
        self._logits = out

    def logits(self, row: int = -1, n_rows: int = 1) -> np.ndarray:
        n = len(self._logits)
        start = row + n if row < 0 else row
        if start < 0 or start + n_rows > n:
            raise PowerInferError(f"no logits for output row {row} ({n} rows)")
        return self._logits[start] if n_rows == 1 else self._logits[start : start + n_rows]

    def kv_pos(self) -> int:
        return self._pool._with_ctx(lambda ctx: ctx.kv_seq_pos_max(self.seq_id) + 1)

    def kv_truncate(self, n_keep: int) -> None:
        # Queued: applied before the next step, without waiting for the one being computed.
        self._pool._batcher.kv_keep(self.seq_id, n_keep)

    # ---- generations (generation.generate) ------------------------------------------------

    def adopt_prefix(self, seq: SequenceState, tokens: List[int], with_rows: bool) -> None:
        self._pool._adopt_prefix(self.seq_id, seq, tokens, with_rows)

    def lockstep(self, loop: Iterator[int], checks: Sequence[Any] = ()):
        return self._pool._lockstep(self.seq_id, loop, checks)

    def run_ahead(self, seq: SequenceState, tokens: List[int], sampler: Sampler, reset: bool,
                  n_predict: Optional[int], stop_tokens: List[int], resume, verbose: bool):
        return self._pool._run_ahead(self.seq_id, seq, tokens, sampler, reset, n_predict, stop_tokens, resume, verbose)

    # ---- what a Llama reads of its context --------------------------------------------------

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
        """The sequence's cached positions (keys and values; no logits: the next generation
        decodes its last prompt token again), between two steps of the batcher."""
        return self._pool._with_ctx(lambda ctx: ctx.state_seq_save(self.seq_id))

    def state_load(self, data: bytes) -> None:
        """Replace the sequence's cache with a state_save() (of a slot, or of a Llama's context)."""
        self._pool._with_ctx(lambda ctx: ctx.state_seq_load(self.seq_id, data))

    def embeddings(self, row: int = 0, n_rows: int = 1) -> np.ndarray:
        self._unsupported("embeddings")

    def close(self) -> None:
        pass

    @property
    def ptr(self):
        self._unsupported("the raw context pointer (Llama.ctx)")


class ParallelLlama:
    """`n_parallel` slots over one model: see the module docstring."""

    def __init__(self, llama: Llama, n_parallel: int = 4, *, n_ctx: Optional[int] = None,
                 restart_within: float = 0.5, prompt_slice_ms: float = 250.0):
        if not isinstance(llama, Llama) or getattr(llama, "_fallback", None) is not None:
            raise ValueError("ParallelLlama needs a powerinfer_py.Llama running on the powerinfer engine")
        if llama._model is None or llama._ctx is None:
            raise ValueError("ParallelLlama needs a Llama with a model and a context (not vocab_only, not closed)")
        if not isinstance(n_parallel, int) or not 1 <= n_parallel <= 64:
            raise ValueError(f"n_parallel must be an int in [1, 64], not {n_parallel!r}")
        if not isinstance(restart_within, (int, float)) or not 0.0 <= restart_within <= 1.0:
            raise ValueError(f"restart_within must be a number in [0, 1], not {restart_within!r}")
        if not isinstance(prompt_slice_ms, (int, float)) or not 0.0 <= prompt_slice_ms <= 1e6:
            raise ValueError(f"prompt_slice_ms must be a number in [0, 1e6], not {prompt_slice_ms!r}")
        n_ctx_slot = llama.n_ctx() if not n_ctx else int(n_ctx)
        if n_ctx_slot <= 0:
            raise ValueError(f"n_ctx must be > 0, not {n_ctx!r}")
        base_params = llama.context_params
        self._llama = llama
        # The pool's own handle on the model: closing `llama` first leaves the pool working.
        self._model = llama._model.share()
        self.n_parallel = n_parallel
        self.n_vocab = llama.n_vocab()
        self._ctx = Context(
            self._model, n_ctx=n_ctx_slot * n_parallel, n_batch=llama.n_batch, n_seq_max=n_parallel,
            n_threads=llama.n_threads, n_threads_batch=llama.n_threads_batch, seed=base_params.seed,
            # Flash attention visits a sequence's cells in position order and skips the rest;
            # with ggml's reference kernels (no tiling, no split of the cache over threads) a
            # token's result then depends neither on its batch nor on where its cells sit.
            flash_attn=base_params.flash_attn if base_params.flash_attn >= 0 else 1, embeddings=False,
            batch_invariant=True,
        )  # fmt: skip
        self.n_ctx_slot = min(n_ctx_slot, self._ctx.n_ctx())
        # Each slot drafts on its own (a draft model: a context of its own on the shared draft
        # model, one thread, on the slot's thread) when the Llama drafts.
        drafter = llama._drafter
        self._slots: List[Llama] = [
            Llama._over_sequence(llama, self._model, SlotBackend(self, i, self.n_ctx_slot), self,
                                 drafter.for_slot(n_ctx=self.n_ctx_slot, n_threads=1) if drafter is not None else None)
            for i in range(n_parallel)
        ]
        self._free: Deque[int] = collections.deque(range(n_parallel))  # idle longest first
        self._slot_cond = threading.Condition()  # also guards _counts and _seeds
        self._n_waiting = 0
        self._closed = False
        # Each request on any slot takes the next seed of one stream: slots that copied the
        # Llama's seed drew the same seeds, so the i-th sampled request on every slot was the
        # same sample (best-of-n and sampling evaluations saw n_parallel copies).
        self._seeds = random.Random(llama._seed)
        self._counts: Dict[str, int] = {
            "prompt_tokens_reused": 0,  # prompt tokens found in the cache (own or adopted prefix)
            "requests": 0,  # slots handed out
            "runs_ahead": 0,  # generations the core sampled
            "runs_lockstep": 0,  # generations sampled in Python
        }
        # A Llama that computed on this thread keeps an OpenMP pool here; the batcher's own
        # would make two (see the module docstring).
        release_threads()
        self._batcher = Batcher(self._ctx, lookahead=_LOOKAHEAD, max_gather_ms=_MAX_GATHER_MS,
                                restart_within=restart_within, prompt_slice_ms=prompt_slice_ms)

    # ---- slots -------------------------------------------------------------------------

    def acquire(self, timeout: Optional[float] = None, slot_id: Optional[int] = None) -> Llama:
        """A free slot (waits for one); give it back with release(). The slot that has been
        idle longest is handed out, so recent prompts stay cached for adoption; with `slot_id`,
        that slot (waiting until it is free: saving or restoring its cache, say)."""
        if slot_id is not None and not (isinstance(slot_id, int) and 0 <= slot_id < self.n_parallel):
            raise ValueError(f"slot_id must be an int in [0, {self.n_parallel}), not {slot_id!r}")
        with self._slot_cond:
            self._n_waiting += 1
            try:
                ready = (lambda: self._free or self._closed) if slot_id is None else \
                    (lambda: slot_id in self._free or self._closed)
                if not self._slot_cond.wait_for(ready, timeout):
                    raise TimeoutError(f"no free slot within {timeout} s")
            finally:
                self._n_waiting -= 1
            if self._closed:
                raise RuntimeError("the ParallelLlama is closed")
            self._counts["requests"] += 1
            if slot_id is None:
                slot_id = self._free.popleft()
            else:
                self._free.remove(slot_id)
            slot = self._slots[slot_id]
            slot._seed = self._seeds.randrange(2**32)  # an unseeded request derives its seed from it
            return slot

    def release(self, slot: Llama) -> None:
        with self._slot_cond:
            seq_id = _seq_id(slot)
            if getattr(slot, "_slot_of", None) is not self or seq_id in self._free:
                raise ValueError("release() takes a slot acquired from this pool, once")
            slot._seq.sampler = None
            self._free.append(seq_id)
            self._slot_cond.notify_all()  # a waiter may wait for this very slot

    @contextlib.contextmanager
    def slot(self, timeout: Optional[float] = None) -> Iterator[Llama]:
        s = self.acquire(timeout)
        try:
            yield s
        finally:
            self.release(s)

    @property
    def slots(self) -> Sequence[Llama]:
        """Every slot, by id (read their counters only: a slot is used between acquire and
        release)."""
        return tuple(self._slots)

    def slot_id(self, slot: Llama) -> int:
        """The id of a slot of this pool (its sequence in the shared KV cache)."""
        seq_id = _seq_id(slot)
        if getattr(slot, "_slot_of", None) is not self or seq_id is None:
            raise ValueError("not a slot of this pool")
        return seq_id

    @property
    def slots_busy(self) -> int:
        return self.n_parallel - len(self._free)

    @property
    def requests_waiting(self) -> int:
        return self._n_waiting

    def _adopt_prefix(self, seq_id: int, seq: SequenceState, tokens: List[int], with_rows: bool) -> None:
        """Before a generation on slot `seq_id`: if an idle slot holds a longer prefix of `tokens`
        than the slot itself, the slot's sequence becomes that prefix (shared cells). With_rows
        (the generation reads score rows: logprobs), only positions with their rows count, and
        the rows are copied too."""
        if not tokens:
            return
        if with_rows:
            # Only positions with their score rows may be reused: the rows are read.
            seq.n_tokens = min(seq.n_tokens, seq.n_scored)
        prompt = np.asarray(tokens, dtype=np.intc)
        own = common_prefix(seq.tokens, prompt)
        with self._slot_cond:  # idle slots stay idle (and unchanged) meanwhile
            best, best_len = None, own
            for i in self._free:
                other = self._slots[i]._seq
                n_own = min(other.n_tokens, other.n_scored) if with_rows else other.n_tokens
                n = common_prefix(other.input_ids[:n_own], prompt)
                if n > best_len:
                    best, best_len = i, n
            if best is not None:
                # Queued while `best` is held idle here: the batcher applies it before any later
                # request of `best` (its edits are applied in the order queued, ahead of decodes).
                other = self._slots[best]._seq
                self._batcher.kv_share(seq_id, best, best_len)
                seq.input_ids[:best_len] = other.input_ids[:best_len]
                seq.forget_rows_from(0)
                if with_rows:
                    seq.scores[:best_len] = other.scores[:best_len]
                    seq.n_scored = best_len
                seq.n_tokens = best_len
                seq.requires_eval = True
            # The last prompt token is decoded again for its logits.
            self._counts["prompt_tokens_reused"] += max(min(best_len, len(tokens) - 1), 0)

    # ---- generations ---------------------------------------------------------------------

    def _with_ctx(self, fn):
        with self._batcher.locked() as ctx:
            return fn(ctx)

    def _lockstep(self, seq_id: int, tokens: Iterator[int], checks: Sequence[Any] = ()):
        """A generation sampled in Python (Llama.generate on the slot): while it runs, each
        step waits for the slot's next decode. `checks`: its sampler's CancelChecks."""
        self._count("runs_lockstep")
        self._batcher.set_lockstep(seq_id, True)
        try:
            with self._cancel_on(seq_id, checks):
                return (yield from tokens)
        finally:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing waits for it
                self._batcher.set_lockstep(seq_id, False)

    @contextlib.contextmanager
    def _cancel_on(self, seq_id: int, checks: Sequence[Any]) -> Iterator[None]:
        """While a generation of slot `seq_id` runs: once one of its CancelChecks' events is
        set, the batcher stops the slot's work within a step (a long prompt is not read to its
        end for nobody), and the core's POWERINFER_ERR_ABORTED becomes the check's own error."""
        batcher = self._batcher

        def cancel() -> None:
            with contextlib.suppress(RuntimeError):  # closed: nothing runs any more
                batcher.set_cancelled(seq_id, True)

        batcher.set_cancelled(seq_id, False)
        try:
            with contextlib.ExitStack() as watches:
                for check in checks:
                    watches.enter_context(check.watch(cancel))
                yield
        except PowerInferError as exc:
            if exc.status == ERR_ABORTED:
                for check in checks:
                    check.check()
            raise
        finally:
            with contextlib.suppress(RuntimeError):
                batcher.set_cancelled(seq_id, False)

    def _count(self, name: str) -> None:
        with self._slot_cond:
            self._counts[name] += 1

    def _run_ahead(self, seq_id: int, seq: SequenceState, tokens: List[int], sampler: Sampler, reset: bool,
                   n_predict: Optional[int], stop_tokens: List[int], resume, verbose: bool):
        """Llama.generate for a slot whose sampler the core runs alone: the batcher samples
        and decodes ahead (powerinfer_batcher_generate), this generator hands the tokens over.

        The slot's state follows the tokens handed over, as Llama.generate's would: a token
        counts as decoded once the caller asks for the one after it, and when the caller
        stops, the sequence keeps exactly those positions (what the batcher computed beyond
        them is dropped), so the slot's cache and prompt-cache matching are as after a
        generation in Python. `stop_tokens` end it as generation.StopOnLastToken does: once
        such a token is evaluated (handed over, and the caller asks for the next), nothing
        more is handed over. Draft tokens sent in continue the generation in Python:
        resume([token, *drafts]) is generation's loop from there."""
        self._count("runs_ahead")
        batcher = self._batcher
        seq.sampler = sampler
        todo = seq.prepare(tokens, reset, verbose)
        if not todo:
            # The whole prompt is cached with its logits: decode its last token again (the
            # core samples from its own rows, not from the slot's copy).
            seq.n_tokens -= 1
            todo = [int(seq.input_ids[seq.n_tokens])]
        try:
            with self._cancel_on(seq_id, sampler.checks):
                yield from self._run(seq_id, seq, todo, sampler, n_predict, stop_tokens, resume)
        finally:
            batcher.stop(seq_id, seq.n_tokens)  # nothing to stop once the pool's close() ended every run
            seq.requires_eval = True  # the last logits were the core's, never the slot's
            if seq.sampler is sampler:
                seq.sampler = None

    def _run(self, seq_id: int, seq: SequenceState, todo: List[int], sampler: Sampler, n_predict: Optional[int],
             stop_tokens: List[int], resume):
        """_run_ahead's loop, from its first tokens to decode (`todo`)."""
        batcher = self._batcher
        while True:
            pos = seq.n_tokens
            seq.check_window(pos, len(todo))
            if todo[-1] in stop_tokens:
                # Llama.generate evaluates it, samples, and its stopping criterion ends
                # the generation before the sampled token is handed over.
                seq.eval(todo)
                return
            seq.forget_rows_from(pos)  # the core decodes from pos on: no rows in Python
            batcher.generate(seq_id, todo, pos, sampler, n_predict or 0, seq.n_ctx, stop_tokens)
            # Held once its first token comes: a cancel may stop the prompt midway, and the
            # slot must not offer a prompt prefix whose cells were never computed.
            seq.input_ids[pos : pos + len(todo)] = todo
            last: Optional[int] = None
            while True:
                got = batcher.next(seq_id)
                if not got:
                    break
                seq.n_tokens = max(seq.n_tokens, pos + len(todo))
                for token in got:
                    for check in sampler.checks:  # as the sampler runs them before each token
                        check.check()
                    if last is not None:  # the batcher decoded it before sampling this one
                        seq.input_ids[seq.n_tokens] = last
                        seq.n_tokens += 1
                    drafts = yield token
                    last = token
                    if drafts:
                        # Draft tokens to check: that is Llama.generate's loop, on rows of
                        # logits in Python; the run ahead ends at the token sent back.
                        batcher.stop(seq_id, seq.n_tokens)
                        yield from self._lockstep(seq_id, resume([token, *(int(t) for t in drafts)]),
                                                  sampler.checks)
                        return
            if last is None:
                raise PowerInferError(f"sequence {seq_id} ended its run without a token")
            # The run ended (n_predict, an end-of-generation or stop token, the context)
            # and the caller asks for more: its last token is decoded in a new run.
            todo, n_predict = [last], None

    # ---- observability and lifetime ----------------------------------------------------------

    @property
    def stats(self) -> Dict[str, float]:
        """Counters since the pool was made: the batcher's (steps, tokens, busy time) and the
        pool's (requests, prompt tokens reused, generations run ahead or in lockstep)."""
        st = self._batcher.stats()
        with self._slot_cond:
            counts = dict(self._counts)
        return {
            "steps": st["n_steps"],  # decode_batch calls
            "tokens_prompt": st["n_prompt_tokens"],  # tokens of requests of more than one token
            "tokens_generated": st["n_gen_tokens"],  # one-token requests (generation steps)
            "prompt_chunks": st["n_prompt_chunks"],  # pieces of prompts, one per step (prompt_slice_ms)
            "batch_tokens_max": st["max_batch_tokens"],
            "busy_seconds": st["busy_ms"] / 1000.0,  # time spent computing
            "step_seconds_max": st["max_step_ms"] / 1000.0,  # the longest step
            "steps_restarted": st["n_restarts"],  # steps interrupted for a new request (restart_within)
            "restart_seconds": st["restart_ms"] / 1000.0,  # what those steps had computed, thrown away
            "kv_cells_used": st["kv_cells_used"],  # after the last step
            "sparse_active": st["sparse_active"],  # FFN neurons the sparse steps computed, all layers
            "sparse_total": st["sparse_total"],
            **counts,
        }

    def sparse_active_fraction(self) -> Optional[float]:
        """Share of FFN neurons the sparse steps computed since the pool was made (None: no
        sparse step), as of the last step: it never waits for a step."""
        st = self._batcher.stats()
        return st["sparse_active"] / st["sparse_total"] if st["sparse_total"] else None

    def sparse_layer_counts(self) -> List[tuple]:
        """Per layer (FFN neurons the sparse steps computed, neurons they considered) since the
        pool was made: counters read as they are, never waiting for a step ([] once closed)."""
        if self._closed:
            return []
        return [self._ctx.sparse_stats(il) for il in range(self._model.n_layer())]

    @property
    def failed(self) -> bool:
        """True once an RPC worker of the model stopped answering: the pool computes nothing more."""
        return not self._model.closed and self._model.failed()

    def kv_cells_used(self) -> int:
        """KV cells in use after the last step (never waits for a step)."""
        return int(self._batcher.stats()["kv_cells_used"])

    def speculative_stats(self) -> Dict[str, Any]:
        """The slots' speculative decoding counters together (Llama.speculative_stats)."""
        total = SpeculativeStats()
        for slot in self._slots:
            if slot._drafter is not None:
                total.add(slot._drafter.stats)
        return total.as_dict()

    def close(self) -> None:
        """Stop the batcher and free the pool's context (not the Llama it was made from)."""
        with self._slot_cond:
            if self._closed:
                return
            self._closed = True
            self._slot_cond.notify_all()
        for slot in self._slots:
            slot.close()  # its drafter
        self._batcher.close()
        self._ctx.close()
        self._model.close()

    def __enter__(self) -> "ParallelLlama":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _seq_id(slot: Any) -> Optional[int]:
    backend = getattr(getattr(slot, "_seq", None), "backend", None)
    return backend.seq_id if isinstance(backend, SlotBackend) else None
