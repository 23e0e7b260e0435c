"""`Sampler`: an owned `struct powerinfer_sampler *`, the sampler of one generation: a
libpowerinfer sampler chain set up the way llama-cpp-python 0.3.36's
Llama._init_sampler sets up its libllama chain, plus the Python logits processors,
which run on a copy of the logits row before the chain. It is released exactly once
(close() or garbage collection); the core keeps its model alive, and a batcher running a
generation with it keeps it alive until that generation ends."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .bindings import ffi, lib
from .context import Context
from .errors import OK, core_error
from .handle import Handle
from .model import Model

LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]


class LogitBias:
    """A logits processor adding a bias to some tokens' logits (OpenAI's `logit_bias`).

    Called, it adds in place (the sampler hands its processors a copy of its own, as
    llama-cpp-python's does). A Sampler whose processor list ends with LogitBias
    processors applies them in the core instead (libllama's logit-bias sampler, first in
    the chain: the same float additions in the same order), so the logits row is not
    copied for them and the core can sample such a generation without Python."""

    def __init__(self, bias: Dict[Any, float], n_vocab: int):
        entries: Dict[int, float] = {}
        for k, v in bias.items():
            token = int(k)
            if not 0 <= token < n_vocab:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary [0, {n_vocab})")
            entries[token] = float(v)
        self.ids = np.fromiter(entries.keys(), dtype=np.intp, count=len(entries))
        self.values = np.fromiter(entries.values(), dtype=np.float32, count=len(entries))

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[self.ids] += self.values
        return scores


def grammar_text(grammar: Any) -> tuple:
    """(GBNF text, root rule) of a llama_cpp LlamaGrammar (or a plain GBNF string)."""
    if isinstance(grammar, str):
        return grammar, "root"
    text = getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise TypeError(f"grammar must be a LlamaGrammar or a GBNF string, not {type(grammar).__name__}")
    return text, getattr(grammar, "_root", None) or "root"


class CancelEvent(threading.Event):
    """A threading.Event whose set() also calls the callbacks registered with watch(): a
    generation waiting in the core (a long prompt read over several steps, a slot's next
    token) is told at once instead of at its next token."""

    def __init__(self) -> None:
        super().__init__()
        self._watch_lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []

    def set(self) -> None:
        super().set()
        # Under the lock: once watch() has ended, its callback is never called.
        with self._watch_lock:
            for callback in self._callbacks:
                callback()

    @contextlib.contextmanager
    def watch(self, callback: Callable[[], None]) -> Iterator[None]:
        """Call `callback` (which must not block) when the event is set while the block runs,
        or at once if it is set already."""
        with self._watch_lock:
            self._callbacks.append(callback)
            if self.is_set():
                callback()
        try:
            yield
        finally:
            with self._watch_lock:
                self._callbacks.remove(callback)


class CancelCheck:
    """A logits processor that changes no logit and raises `error()` once `event` is set: a
    way for another thread to stop a generation at its next token. A Sampler keeps these
    apart from its logits processors (`checks`) and runs them before each token, so the
    core can still sample such a generation alone. With a CancelEvent, watch() also tells
    code waiting in the core (a prompt being read) at once."""

    def __init__(self, event: Any, error: Callable[[], BaseException]):
        self.event, self.error = event, error

    def check(self) -> None:
        if self.event.is_set():
            raise self.error()

    def watch(self, callback: Callable[[], None]) -> ContextManager[None]:
        """callback() once the event is set during the block (a plain Event: never)."""
        watch = getattr(self.event, "watch", None)
        return watch(callback) if watch is not None else contextlib.nullcontext()

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        self.check()
        return scores


class Sampler(Handle):
    """Token selection for one generate() call.

    Chain, as upstream: [logits processors] -> grammar -> penalties -> greedy (temp == 0),
    a plain draw (temp < 0), Mirostat 1/2, or top-k -> typical -> top-p -> min-p ->
    temperature -> draw. The core's chain puts the grammar before the penalties;
    upstream puts it after: the two commute (the grammar only sets logits to -inf).
    """

    _kind = "sampler"

    def __init__(
        self,
        model: Model,
        *,
        seed: int,
        temp: float,
        top_k: int,
        top_p: float,
        min_p: float,
        typical_p: float,
        mirostat_mode: int,
        mirostat_tau: float,
        mirostat_eta: float,
        penalty_last_n: int,
        repeat_penalty: float,
        frequency_penalty: float,
        presence_penalty: float,
        grammar: Any = None,
        logits_processor: Optional[Sequence[LogitsProcessor]] = None,
    ):
        self.model = model  # the chain reads the model's vocabulary: keep it alive
        self.n_vocab = model.n_vocab()
        processors = list(logits_processor) if logits_processor else []
        self.checks = [p for p in processors if isinstance(p, CancelCheck)]  # before each token
        processors = [p for p in processors if not isinstance(p, CancelCheck)]
        biases: List[LogitBias] = []
        while processors and isinstance(processors[-1], LogitBias):
            biases.insert(0, processors.pop())
        self.logits_processor = processors if processors else None
        self._scratch: Optional[np.ndarray] = None  # the processors' copy of a logits row
        p = lib.powerinfer_sampler_default_params()
        p.seed = int(seed) & 0xFFFFFFFF
        p.penalty_last_n = penalty_last_n
        p.penalty_repeat = repeat_penalty
        p.penalty_freq = frequency_penalty
        p.penalty_present = presence_penalty
        self._mirostat = mirostat_mode if temp > 0.0 and mirostat_mode in (1, 2) else 0
        self.seed = int(seed) & 0xFFFFFFFF
        self.greedy = temp == 0.0
        # The draw without the state it keeps (penalties, grammar, processors): what a draft
        # model samples its proposals with (draw_settings() below).
        self._draw = dict(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p)
        p.mirostat_tau = mirostat_tau
        p.mirostat_eta = mirostat_eta
        if temp < 0.0:
            # Upstream draws from the softmax of the raw logits: no truncation, no temperature.
            p.temp, p.top_k, p.top_p, p.min_p, p.typical_p, p.mirostat = 1.0, 0, 1.0, 0.0, 1.0, 0
        elif temp == 0.0:
            p.temp = 0.0
        elif mirostat_mode in (1, 2):
            # Upstream's chain has no temperature step before Mirostat; the core's applies
            # `temp` there, so 1.0 (the identity) gives upstream's chain.
            p.temp, p.mirostat = 1.0, mirostat_mode
        else:
            # Other mirostat_mode values mean "off" upstream, too.
            p.temp, p.top_k, p.top_p, p.min_p, p.typical_p = temp, top_k, top_p, min_p, typical_p
        # The char buffers must outlive the sampler: keep them on this object.
        self._grammar_buf = self._root_buf = ffi.NULL
        if grammar is not None:
            text, root = grammar_text(grammar)
            self._grammar_buf = ffi.new("char[]", text.encode("utf-8"))
            self._root_buf = ffi.new("char[]", root.encode("utf-8"))
            p.grammar, p.grammar_root = self._grammar_buf, self._root_buf
        if biases:
            ids = [int(t) for b in biases for t in b.ids]
            values = [float(v) for b in biases for v in b.values]
            entries = ffi.new("struct powerinfer_logit_bias[]", len(ids))
            for i, (t, v) in enumerate(zip(ids, values)):
                entries[i].token, entries[i].bias = t, v
            p.n_logit_bias, p.logit_bias = len(ids), entries  # copied by the core
        ptr = lib.powerinfer_sampler_new(model.ptr, p)
        if ptr == ffi.NULL:
            raise core_error("invalid sampling parameters")
        self._ptr = ptr

    def _free(self, ptr) -> None:
        lib.powerinfer_sampler_free(ptr)

    def sample(self, ctx: Any, row: int, input_ids: np.ndarray) -> int:
        """Select a token from logits row `row` of the last decode (negative: from the end)
        and record it (penalty history, grammar state). `ctx` is a Context, or anything
        with its logits(row) method (a sequence of a ParallelLlama)."""
        for check in self.checks:
            check.check()
        if self.logits_processor is None and isinstance(ctx, Context):
            token = int(lib.powerinfer_sampler_sample(self.ptr, ctx.ptr, row))
        else:
            # The processors work on this sampler's own copy, in a buffer kept from token to
            # token: a fresh 200-600 KB array per token is a fresh mmap, whose pages fault in
            # one by one (~0.15 ms of a ~5 ms step).
            logits = self._processed(ctx, row, input_ids)
            token = int(lib.powerinfer_sampler_sample_logits(self.ptr, ffi.from_buffer("float[]", logits), self.n_vocab))
            if token >= 0 and lib.powerinfer_sampler_accept(self.ptr, token) != OK:
                token = -1
        if token < 0:
            raise core_error("sampling failed")
        return token

    def _processed(self, ctx: Any, row: int, input_ids: np.ndarray) -> np.ndarray:
        """Logits row `row` after the Python logits processors (a copy when there are any)."""
        logits = ctx.logits(row)
        if self.logits_processor is not None:
            if self._scratch is None or self._scratch.shape != logits.shape:
                self._scratch = np.empty(logits.shape, dtype=np.float32)
            np.copyto(self._scratch, logits)
            logits = self._scratch
            for processor in self.logits_processor:
                out = processor(input_ids, logits)
                if out is not logits:
                    logits[:] = out
        return np.ascontiguousarray(logits, dtype=np.float32)

    def probs(self, ctx: Any, row: int, input_ids: np.ndarray) -> np.ndarray:
        """The distribution sample() would draw from for logits row `row` (float32 [n_vocab];
        one-hot when greedy), recording nothing: speculative decoding's acceptance rule.
        PowerInferError for a Mirostat sampler."""
        for check in self.checks:
            check.check()
        logits = self._processed(ctx, row, input_ids)
        out = np.empty((self.n_vocab,), dtype=np.float32)
        rc = lib.powerinfer_sampler_probs(self.ptr, ffi.from_buffer("float[]", logits), self.n_vocab,
                                          ffi.from_buffer("float[]", out))
        if rc != OK:
            raise core_error("no distribution to sample from", rc)
        return out

    def draw_settings(self) -> Dict[str, Any]:
        """Temperature and truncation of this sampler's draw (no penalties, grammar or
        processors: state a draft cannot roll back), as Sampler keyword arguments."""
        return dict(self._draw, mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, penalty_last_n=0,
                    repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)

    @property
    def has_distribution(self) -> bool:
        """Whether probs() works (every chain but Mirostat's)."""
        return self._mirostat == 0

    def accept(self, token: int) -> None:
        """Record a token chosen outside sample() (penalty history, grammar state)."""
        rc = lib.powerinfer_sampler_accept(self.ptr, int(token))
        if rc != OK:
            raise core_error(f"token {token} cannot be accepted", rc)

    def reset(self) -> None:
        lib.powerinfer_sampler_reset(self.ptr)
