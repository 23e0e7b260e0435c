"""Llama's evaluation and generation family: decoding into the KV cache, logits views,
the sampler set-up, and the generate() loop with prefix reuse and draft-token checks.

Every function takes the powerinfer_py.Llama it serves as `llama`.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .._core import PowerInferError, Sampler
from .constants import ENGINE_LLAMA_CPP


def decode(llama: Any, tokens: Sequence[int], pos: int, logits_all: bool) -> None:
    n = len(tokens)
    if pos + n > llama._n_ctx:
        raise ValueError(f"Requested tokens ({pos + n}) exceed context window of {llama._n_ctx}")
    llama._ctx.decode(tokens, pos, logits_all)


def logits_view(llama: Any, row: int = -1, n_rows: int = 1) -> np.ndarray:
    """n_rows rows of logits of the last decode from `row` on, as a view that is valid
    until the next decode: float32 [n_rows, n_vocab] (or [n_vocab] for one row)."""
    return llama._ctx.logits(row, n_rows)


def last_logits_view(llama: Any) -> np.ndarray:
    """The logits after the last evaluated token (zeros before any decode)."""
    if llama._ctx is None or llama._ctx.n_outputs() <= 0:
        return np.zeros((llama._n_vocab,), dtype=np.float32)
    return logits_view(llama, -1)


def eval_tokens(llama: Any, tokens: Sequence[int], all_rows: bool) -> None:
    """Evaluate `tokens` after the first n_tokens tokens of the KV cache (logits of every
    row with all_rows or logits_all)."""
    llama._require_ctx()
    tokens = [int(t) for t in tokens]
    if not tokens:
        return
    n_past, n = llama.n_tokens, len(tokens)
    decode(llama, tokens, n_past, all_rows or llama._logits_all)
    llama.input_ids[n_past : n_past + n] = tokens
    if llama._logits_all:
        llama.scores[n_past : n_past + n, :] = logits_view(llama, 0, n)
    llama.n_tokens = n_past + n
    llama._requires_eval = False


def compute_logits(llama: Any, tokens: Sequence[int]) -> np.ndarray:
    """Logits of every token of `tokens` evaluated from position 0: float32 [n_tokens, n_vocab]."""
    tokens = [int(t) for t in tokens]
    fallback = llama._fallback
    if fallback is not None:
        if not fallback._logits_all:
            raise RuntimeError(f"compute_logits on the {ENGINE_LLAMA_CPP} fallback needs Llama(..., logits_all=True)")
        fallback.reset()
        fallback.eval(tokens)
        return np.array(fallback.scores[: len(tokens), :], dtype=np.float32)
    ctx = llama._require_ctx()
    if len(tokens) > llama._n_ctx:
        raise ValueError(f"Requested tokens ({len(tokens)}) exceed context window of {llama._n_ctx}")
    llama.reset()
    eval_tokens(llama, tokens, all_rows=True)
    n_out = ctx.n_outputs()
    if n_out != len(tokens):
        raise PowerInferError(f"powerinfer_decode(logits_all=True) of {len(tokens)} tokens returned {n_out} rows")
    return logits_view(llama, 0, n_out).copy()


# ---- sampling ----------------------------------------------------------------------------


# The sampling arguments of Llama.sample/generate that the sampler chain takes (tfs_z and
# penalize_nl are accepted there and ignored, as by llama-cpp-python 0.3.36).
SAMPLER_ARGS = ("top_k", "top_p", "min_p", "typical_p", "temp", "repeat_penalty", "frequency_penalty",
                "presence_penalty", "mirostat_mode", "mirostat_tau", "mirostat_eta", "logits_processor", "grammar")


def sampler_args(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """The SAMPLER_ARGS of a method's arguments (its locals())."""
    return {name: arguments[name] for name in SAMPLER_ARGS}


def init_sampler(llama: Any, *, temp: float, top_k: int, top_p: float, min_p: float, typical_p: float,
                 mirostat_mode: int, mirostat_tau: float, mirostat_eta: float, repeat_penalty: float,
                 frequency_penalty: float, presence_penalty: float, logits_processor, grammar) -> Sampler:
    """The sampler chain llama-cpp-python's Llama._init_sampler builds, with the Llama's seed."""
    return Sampler(
        llama._require_model(),
        seed=llama._seed,
        penalty_last_n=llama.last_n_tokens_size,
        temp=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        mirostat_mode=mirostat_mode,
        mirostat_tau=mirostat_tau,
        mirostat_eta=mirostat_eta,
        repeat_penalty=repeat_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        grammar=grammar,
        logits_processor=logits_processor,
    )


def sample(llama: Any, idx: Optional[int], **sampler_params: Any) -> int:
    """Llama.sample: with the sampler of the running generate() if any, else a new one."""
    if llama.n_tokens <= 0:
        raise RuntimeError("sample() needs evaluated tokens (call eval first)")
    sampler = llama._sampler
    if sampler is None:
        sampler = init_sampler(llama, **sampler_params)
    row = idx - llama.n_tokens if idx is not None else -1
    return sampler.sample(llama._require_ctx(), row, llama._input_ids)


def generate(llama: Any, tokens: Sequence[int], reset: bool, stopping_criteria, **sampler_params: Any) -> Iterator[int]:
    """Llama.generate. The sampler is built here, so a bad sampling parameter raises
    ValueError at the call, not at the first token."""
    llama._require_ctx()
    tokens = [int(t) for t in tokens]
    if not tokens and llama.n_tokens == 0:
        raise ValueError("generate needs at least one prompt token")
    return start(llama, tokens, init_sampler(llama, **sampler_params), reset, stopping_criteria)


def start(llama: Any, tokens: List[int], sampler: Sampler, reset: bool, stopping_criteria) -> Iterator[int]:
    """The generation loop over `tokens` with `sampler`, which becomes llama's while it runs."""
    llama._sampler = sampler
    return _generate(llama, tokens, sampler, reset, stopping_criteria)


class StopOnLastToken:
    """A stopping criterion: stop once the last evaluated token is one of `token_ids`
    (llama-cpp-python's Jinja2ChatFormatter builds this test as a closure). Kept as data,
    so a generation sampled in the core (a ParallelLlama slot) can end there in the core."""

    def __init__(self, token_ids: Any):
        self.token_ids = frozenset(int(t) for t in token_ids)

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return len(input_ids) > 0 and int(input_ids[-1]) in self.token_ids


def core_stop_tokens(stopping_criteria: Any) -> Optional[List[int]]:
    """The tokens to end a generation at, if `stopping_criteria` (None or a list) only ends
    generations at given last tokens; None if it needs Python."""
    if stopping_criteria is None:
        return []
    if isinstance(stopping_criteria, StopOnLastToken):
        return sorted(stopping_criteria.token_ids)
    if not isinstance(stopping_criteria, list) or not all(isinstance(c, StopOnLastToken) for c in stopping_criteria):
        return None
    return sorted({t for c in stopping_criteria for t in c.token_ids})


def prepare_prompt(llama: Any, tokens: List[int], reset: bool) -> List[int]:
    """Before a generation: keep the longest cached prefix of `tokens` (at least one prompt
    token is decoded again, for its logits, unless the whole prompt is cached with its
    logits), reset the rest, and return the tokens still to evaluate ([]: sample from the
    last logits)."""
    if reset and llama.n_tokens > 0:
        longest_prefix = llama.longest_token_prefix(llama._input_ids.tolist(), tokens)
        prompt_consumed = longest_prefix == len(tokens)
        if llama.n_tokens == len(tokens) and prompt_consumed and not llama._requires_eval:
            # The logits of the last decode are those after the whole prompt.
            reset, tokens, reuse_prefix = False, [], 0
            if llama.verbose:
                print("Llama.generate: full prompt already cached, skipping reset", file=sys.stderr)
        else:
            # At least one prompt token is decoded again, to refresh the logits.
            reuse_prefix = longest_prefix - 1 if prompt_consumed else longest_prefix
        if reuse_prefix > 0:
            llama._ctx.kv_truncate(reuse_prefix)
            reset = False
            tokens = tokens[reuse_prefix:]
            llama.n_tokens = reuse_prefix
            llama._requires_eval = True
            if llama.verbose:
                print(
                    f"Llama.generate: {reuse_prefix} prefix-match hit, "
                    f"remaining {len(tokens)} prompt tokens to eval",
                    file=sys.stderr,
                )
    if reset:
        llama.reset()
    return tokens


def _generate(llama: Any, tokens: List[int], sampler: Sampler, reset: bool, stopping_criteria,
              verify: bool = False) -> Iterator[int]:
    """The generation loop. With verify (draft tokens were sent in), `tokens` are the last
    sampled token and the drafts: every row of their decode is sampled and checked."""
    tokens = prepare_prompt(llama, tokens, reset)
    sample_idx = llama.n_tokens + (0 if verify else len(tokens) - 1)
    try:
        while True:
            eval_tokens(llama, tokens, all_rows=verify)
            while sample_idx < llama.n_tokens:
                row = sample_idx - llama.n_tokens
                token = sampler.sample(llama._ctx, row, llama._input_ids)
                sample_idx += 1
                if stopping_criteria is not None and stopping_criteria(
                    llama._input_ids[:sample_idx], logits_view(llama, row)
                ):
                    return
                tokens_or_none = yield token
                tokens = [token]
                verify = tokens_or_none is not None and len(tokens_or_none) > 0
                if tokens_or_none is not None:
                    tokens.extend(int(t) for t in tokens_or_none)
                if sample_idx < llama.n_tokens and token != llama.input_ids[sample_idx]:
                    llama.n_tokens = sample_idx
                    llama._requires_eval = True
                    break
    finally:
        if llama._sampler is sampler:
            llama._sampler = None
