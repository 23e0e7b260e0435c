"""Llama's evaluation and generation family: decoding into the KV cache, the sampler set-up,
and the generate() loop with prefix reuse, draft tokens and their verification.

Every function takes the powerinfer_py.Llama it serves as `llama`; the tokens it holds are
its Sequence (`llama._seq`, sequence.py), whose backend is the Llama's own context or, on a
ParallelLlama slot, one sequence of the pool's (which may run a generation in the core).
"""

from __future__ import annotations

import random
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .._core import PowerInferError, Sampler
from .constants import ENGINE_LLAMA_CPP, LLAMA_DEFAULT_SEED
from .speculative import Draft, Drafter, accept_draft


def eval_tokens(llama: Any, tokens: Sequence[int], all_rows: bool) -> None:
    """Evaluate `tokens` after the held tokens (logits of every row with all_rows or
    logits_all)."""
    llama._require_ctx()
    llama._seq.eval(tokens, all_rows)


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
    seq = llama._seq
    seq.check_window(0, len(tokens))
    seq.reset()
    seq.eval(tokens, all_rows=True)
    n_out = ctx.n_outputs()
    if n_out != len(tokens):
        raise PowerInferError(f"powerinfer_decode(logits_all=True) of {len(tokens)} tokens returned {n_out} rows")
    return ctx.logits(0, n_out).copy()


# ---- sampling ----------------------------------------------------------------------------


# The sampling arguments of Llama.sample/generate that the sampler chain takes (tfs_z and
# penalize_nl are accepted there and ignored, as by llama-cpp-python 0.3.36).
SAMPLER_ARGS = ("top_k", "top_p", "min_p", "typical_p", "temp", "repeat_penalty", "frequency_penalty",
                "presence_penalty", "mirostat_mode", "mirostat_tau", "mirostat_eta", "logits_processor", "grammar")


def is_random_seed(seed: Any) -> bool:
    """Whether `seed` asks for a random one: None, negative (llama.cpp's -s -1) or
    LLAMA_DEFAULT_SEED (0xFFFFFFFF)."""
    return seed is None or (isinstance(seed, int) and (seed < 0 or seed == LLAMA_DEFAULT_SEED))


def resolve_seed(seed: Any) -> int:
    """The seed a Llama starts its seed stream from: `seed` itself (0 .. 2**32 - 2, so the same
    seed gives the same samples on every start), or a fresh random one for is_random_seed.
    # Upstream: llama-cpp-python keeps LLAMA_DEFAULT_SEED and derives each completion's seed
    # from it with random.Random, so unseeded samples repeat on every start of a program."""
    if isinstance(seed, bool) or not (seed is None or isinstance(seed, int)):
        raise ValueError(f"seed must be an int (-1 or LLAMA_DEFAULT_SEED: random), not {seed!r}")
    if is_random_seed(seed):
        return random.SystemRandom().randrange(LLAMA_DEFAULT_SEED)  # never LLAMA_DEFAULT_SEED itself
    if seed > LLAMA_DEFAULT_SEED:
        raise ValueError(f"seed must be below 2**32 (-1 or LLAMA_DEFAULT_SEED: random), not {seed}")
    return int(seed)


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
    seq = llama._seq
    if seq.n_tokens <= 0:
        raise RuntimeError("sample() needs evaluated tokens (call eval first)")
    sampler = seq.sampler
    if sampler is None:
        sampler = init_sampler(llama, **sampler_params)
    row = idx - seq.n_tokens if idx is not None else -1
    llama._require_ctx()
    return sampler.sample(seq.backend, row, seq.tokens)


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


def generate(llama: Any, tokens: Sequence[int], reset: bool, stopping_criteria, *, n_predict: Optional[int] = None,
             reads_rows: Optional[bool] = None, **sampler_params: Any) -> Iterator[int]:
    """Llama.generate. The sampler is built here, so a bad sampling parameter raises
    ValueError at the call, not at the first token.

    n_predict: the caller takes at most this many tokens (a generation sampled ahead in the
    core samples no more); reads_rows: whether the caller reads the score rows (logprobs;
    default: logits_all). create_completion passes both."""
    llama._require_ctx()
    seq = llama._seq
    tokens = [int(t) for t in tokens]
    if not tokens and seq.n_tokens == 0:
        raise ValueError("generate needs at least one prompt token")
    reads_rows = llama._logits_all if reads_rows is None else reads_rows
    backend = seq.backend
    adopt = getattr(backend, "adopt_prefix", None)
    if reset and adopt is not None:
        adopt(seq, tokens, reads_rows)
    sampler = init_sampler(llama, **sampler_params)
    drafter = llama._drafter
    run_ahead = getattr(backend, "run_ahead", None)
    stop_tokens = core_stop_tokens(stopping_criteria)
    if (run_ahead is not None and drafter is None and stop_tokens is not None and not reads_rows
            and sampler.logits_processor is None):
        # The core samples it alone; drafts sent in continue it here.
        def resume(verify_tokens: List[int]) -> Iterator[int]:
            return start(llama, verify_tokens, sampler, False, None, verify=True)

        return run_ahead(seq, tokens, sampler, reset, n_predict, stop_tokens, resume, llama.verbose)
    loop = start(llama, tokens, sampler, reset, stopping_criteria)
    lockstep = getattr(backend, "lockstep", None)
    return lockstep(loop, sampler.checks) if lockstep is not None else loop


def start(llama: Any, tokens: List[int], sampler: Sampler, reset: bool, stopping_criteria,
          verify: bool = False) -> Iterator[int]:
    """The generation loop over `tokens` with `sampler`, which becomes the sequence's while it
    runs. With verify, `tokens` are a sampled token and drafts sent in: every row is checked."""
    llama._seq.sampler = sampler
    return _generate(llama, tokens, sampler, reset, stopping_criteria, verify)


def _draft_room(llama: Any, n_past: int) -> int:
    """How many draft tokens may follow the token decoded at position n_past: draft_max, the
    context window, and, on a sparse model, the largest batch that takes the sparse path (a
    larger one would run the dense FFN, whose results are not a lone token's)."""
    return min(llama._drafter.params.n_max, llama._seq.n_ctx - n_past - 1, llama._draft_batch_max - 1)


def _generate(llama: Any, tokens: List[int], sampler: Sampler, reset: bool, stopping_criteria,
              verify: bool = False) -> Iterator[int]:
    """The generation loop. When `tokens` holds more than the next token to decode (drafts,
    sent in by the caller or proposed by the Llama's drafter), their decode keeps every row and
    each row is sampled: a row whose token is the next draft accepts it; the first that is not
    ends the step, and the KV cache is rolled back to the tokens kept."""
    seq = llama._seq
    drafter: Optional[Drafter] = llama._drafter
    tokens = seq.prepare(tokens, reset, llama.verbose)
    # The next position whose logits are sampled.
    sample_idx = seq.n_tokens + (0 if verify else len(tokens) - 1)
    draft: Optional[Draft] = None  # the drafter's proposals being checked
    rng = np.random.default_rng(sampler.seed) if drafter is not None else None
    length = drafter.length if drafter is not None else None
    try:
        while True:
            n_drafted = len(draft.tokens) if draft is not None else 0
            t0 = time.perf_counter()
            seq.eval(tokens, all_rows=verify)
            if length is not None and len(tokens) == n_drafted + 1:
                length.record_decode(n_drafted, time.perf_counter() - t0)
            n_kept = 0
            while sample_idx < seq.n_tokens:
                row = sample_idx - seq.n_tokens
                history = seq.input_ids[: sample_idx + 1]  # what one-token decoding would hold here
                proposal = sample_idx + 1 < seq.n_tokens
                i_draft = sample_idx + 1 - (seq.n_tokens - len(draft.tokens)) if draft is not None else -1
                if proposal and draft is not None and draft.q is not None:
                    # A proposal drawn from the draft's distribution: the standard rule.
                    token = accept_draft(sampler.probs(seq.backend, row, history), draft.q[i_draft],
                                         int(seq.input_ids[sample_idx + 1]), rng)
                    sampler.accept(token)
                else:
                    # A point mass (or no proposal): drawing from p and comparing is the rule.
                    token = sampler.sample(seq.backend, row, history)
                sample_idx += 1
                kept = proposal and token == int(seq.input_ids[sample_idx])
                if draft is not None:
                    drafter.stats.generated += 1
                    drafter.stats.accepted += int(kept)
                    n_kept += int(kept)
                if stopping_criteria is not None and stopping_criteria(seq.input_ids[:sample_idx], seq.logits(row)):
                    return
                sent = yield token
                tokens = [token]
                verify = sent is not None and len(sent) > 0
                if sent is not None:
                    tokens.extend(int(t) for t in sent)
                if proposal and not kept:
                    seq.rewind(sample_idx)  # past the first rejected token
                    break
            if length is not None:
                length.record_outcome(n_drafted, n_kept)
            draft = None
            if drafter is not None and not verify:
                n_room = length.choose(_draft_room(llama, sample_idx), drafter.params.n_min)
                if n_room > 0:
                    history = np.append(seq.input_ids[:sample_idx], np.intc(tokens[0]))
                    t0 = time.perf_counter()
                    draft = drafter.propose(history, n_room, sampler, rng)
                    length.record_draft(len(draft.tokens), time.perf_counter() - t0)
                    if draft.tokens:
                        tokens.extend(draft.tokens)
                        verify = True
                        drafter.stats.verify_steps += 1
                        drafter.stats.drafted += len(draft.tokens)
                    else:
                        draft = None
    finally:
        if seq.n_tokens > sample_idx:
            seq.rewind(sample_idx)  # drafts decoded past the last token handed over
        if seq.sampler is sampler:
            seq.sampler = None
