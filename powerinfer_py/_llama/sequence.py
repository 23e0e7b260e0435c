"""One sequence of tokens held in a KV cache, and the bookkeeping every generation path shares:
which tokens the cache holds, their logits rows (logits_all), whether the last logits are
those after the last token, the context-window check, prompt-prefix reuse, rolling back.

A Sequence computes through a backend (`SequenceBackend`): a Context of its own (a Llama)
or one sequence of a ParallelLlama's shared context (its slots, decoded by the core's
batcher). A speculative generation holds two: the draft's and the target's.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Protocol, Sequence as Seq

import numpy as np


class SequenceBackend(Protocol):
    """What a Sequence needs of the KV cache it lives in. `Context` is one; a ParallelLlama
    slot's `SlotBackend` (parallel.py) is the other."""

    def n_ctx(self) -> int:
        """Positions the sequence may hold."""

    def n_batch(self) -> int:
        """Tokens one decode computes at a time (the chunks of a longer one)."""

    def decode(self, tokens: Seq[int], pos: int, logits_all: bool = False) -> None:
        """Compute `tokens` at positions pos, pos+1, ... (cached positions from pos on are
        overwritten); logits rows of every token with logits_all, else of the last."""

    def logits(self, row: int = -1, n_rows: int = 1) -> np.ndarray:
        """Rows of logits of the last decode (negative: from the end), as a view valid until
        the next decode: float32 [n_vocab], or [n_rows, n_vocab]."""

    def n_outputs(self) -> int:
        """Rows of logits of the last decode."""

    def kv_pos(self) -> int:
        """Positions held in the KV cache."""

    def kv_truncate(self, n_keep: int) -> None:
        """Keep the first n_keep positions of the KV cache."""


def window_error(n_requested: int, n_ctx: int) -> ValueError:
    """llama-cpp-python's message for a context window overflow (callers match it)."""
    return ValueError(f"Requested tokens ({n_requested}) exceed context window of {n_ctx}")


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class Sequence:
    """The tokens one KV cache sequence holds (input_ids[:n_tokens]) and, with keep_scores
    (logits_all), the logits after each of them (scores[:n_scored]), as llama-cpp-python's
    Llama keeps them.

    `requires_eval` is True when the backend's last logits are not those after the last
    held token (after a reset, a truncation, a state load): the next generation decodes its
    last prompt token again. `sampler` is the running generation's, if any (Llama.sample
    uses it)."""

    def __init__(self, backend: Optional[SequenceBackend], n_ctx: int, n_vocab: int, keep_scores: bool,
                 score_rows: int = 1):
        self.backend = backend
        self.n_ctx = n_ctx
        self.n_vocab = n_vocab
        self.keep_scores = keep_scores
        self.input_ids = np.zeros((n_ctx,), dtype=np.intc)
        self.scores = np.zeros((n_ctx if keep_scores else max(score_rows, 1), n_vocab), dtype=np.single)
        self.n_tokens = 0
        # Positions whose score rows hold their logits: rows are written by eval() only, so a
        # run sampled in the core, a truncation or an adopted prefix leaves later ones stale.
        self.n_scored = 0
        self.requires_eval = True
        self.sampler = None

    @property
    def tokens(self) -> np.ndarray:
        """The held tokens (a view)."""
        return self.input_ids[: self.n_tokens]

    def check_window(self, pos: int, n: int) -> None:
        """ValueError unless n tokens fit after position pos."""
        if pos + n > self.n_ctx:
            raise window_error(pos + n, self.n_ctx)

    def eval(self, tokens: Seq[int], all_rows: bool = False) -> None:
        """Decode `tokens` after the held ones (logits of every row with all_rows or
        keep_scores, else of the last), and hold them.

        While a generation whose sampler has cancel checks runs, a long prompt is decoded in
        slices of n_batch tokens (the chunks the decode computes anyway, so the results are
        the same) with the checks between them: a cancelled request stops within a slice
        instead of reading its whole prompt for nobody, and holds the slices read. A backend
        that stops cancelled work itself (a ParallelLlama slot) gets the prompt whole."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        n_past, n = self.n_tokens, len(tokens)
        self.check_window(n_past, n)
        self.n_scored = min(self.n_scored, n_past)
        checks = self.sampler.checks if self.sampler is not None else ()
        step = n
        if checks and not getattr(self.backend, "cancels_in_core", False):
            step = max(int(self.backend.n_batch()), 1)
        for start in range(0, n, step):
            if start:
                for check in checks:
                    check.check()
            piece = tokens[start : start + step]
            pos, m = n_past + start, len(piece)
            self.backend.decode(piece, pos, all_rows or self.keep_scores)
            self.input_ids[pos : pos + m] = piece
            if self.keep_scores:
                self.scores[pos : pos + m, :] = self.backend.logits(0, m)
                if self.n_scored == pos:
                    self.n_scored = pos + m
            self.n_tokens = pos + m
        self.requires_eval = False

    def logits(self, row: int = -1) -> np.ndarray:
        """Row `row` of the last decode's logits (a view)."""
        return self.backend.logits(row)

    def last_logits(self) -> np.ndarray:
        """The logits after the last decode's last token (zeros before any decode)."""
        if self.backend is None or self.backend.n_outputs() <= 0:
            return np.zeros((self.n_vocab,), dtype=np.float32)
        return self.backend.logits(-1)

    def reset(self) -> None:
        """Forget the held tokens (the cache is overwritten from position 0 by the next eval)."""
        self.n_tokens = 0
        self.requires_eval = True

    def rewind(self, n_keep: int) -> None:
        """Hold only the first n_keep tokens, in the KV cache as well (what a rejected draft
        or a reused prompt prefix leaves)."""
        n_keep = max(0, min(int(n_keep), self.n_tokens))
        self.backend.kv_truncate(n_keep)
        self.n_tokens = n_keep
        self.n_scored = min(self.n_scored, n_keep)
        self.requires_eval = True

    def forget_rows_from(self, pos: int) -> None:
        """Score rows from `pos` on are stale (the core decoded there without copying them)."""
        self.n_scored = min(self.n_scored, pos)

    def restore(self, input_ids: np.ndarray, n_tokens: int, scores: Optional[np.ndarray]) -> None:
        """Hold `input_ids[:n_tokens]` (and their score rows) after the backend's state was
        loaded; the next generation decodes its last prompt token again, as upstream's."""
        self.input_ids = np.zeros((self.n_ctx,), dtype=np.intc)
        self.input_ids[:n_tokens] = np.asarray(input_ids[:n_tokens], dtype=np.intc)
        n_scores = min(len(scores), n_tokens) if scores is not None else 0
        if self.keep_scores and n_scores:
            self.scores[:n_scores, :] = scores[:n_scores]
        self.n_tokens = n_tokens
        self.n_scored = n_scores if self.keep_scores else 0
        self.requires_eval = True

    def prepare(self, tokens: List[int], reset: bool, verbose: bool = False) -> List[int]:
        """Before a generation over the prompt `tokens`: keep the longest held prefix of it (at
        least one prompt token is decoded again, for its logits, unless the whole prompt is
        held with its logits), forget the rest, and return the tokens still to evaluate ([]:
        sample from the last logits). llama-cpp-python's Llama.generate rule."""
        if reset and self.n_tokens > 0:
            longest_prefix = common_prefix(self.tokens, tokens)
            prompt_consumed = longest_prefix == len(tokens)
            if self.n_tokens == len(tokens) and prompt_consumed and not self.requires_eval:
                # The logits of the last decode are those after the whole prompt.
                reset, tokens, reuse_prefix = False, [], 0
                if verbose:
                    print("Llama.generate: full prompt already cached, skipping reset", file=sys.stderr)
            else:
                # At least one prompt token is decoded again, to refresh the logits.
                reuse_prefix = longest_prefix - 1 if prompt_consumed else longest_prefix
            if reuse_prefix > 0:
                self.rewind(reuse_prefix)
                reset = False
                tokens = tokens[reuse_prefix:]
                if verbose:
                    print(f"Llama.generate: {reuse_prefix} prefix-match hit, "
                          f"remaining {len(tokens)} prompt tokens to eval", file=sys.stderr)
        if reset:
            self.reset()
        return tokens
