"""Speculative decoding: draft tokens, and the rule that keeps or rejects them.

A drafter proposes up to `draft_max` tokens after a sequence's held tokens and the token just
sampled; the generation loop (generation.py) decodes the sampled token and the proposals in
one batch with every row's logits and keeps the proposals its own sampler agrees with, then
rolls the KV cache back past the first one it rejects. Decode on a CPU is bound by reading
the weights, so checking k proposals costs little more than one token (docs/speculative.md).

Drafters:
- `CallableDrafter`: llama-cpp-python's LlamaDraftModel objects (LlamaPromptLookupDecoding:
  the continuation of an earlier occurrence of the last n-gram), or any callable from the
  held token ids to proposed ones. Proposals are point masses.
- `ModelDrafter`: a smaller model on the same vocabulary (llama.cpp's -md) with a Sequence of
  its own: greedy proposals while its top probability is at least draft_p_min, or, when the
  generation samples, proposals drawn from its own distribution q.

The rule (`accept_draft`), the one that keeps the target's distribution exactly: a proposal
d drawn from q is kept with probability min(1, p(d) / q(d)), where p is the distribution the
target's sampler draws from at that row; when it is rejected, the token is drawn from
normalize(max(0, p - q)). For a point mass (q(d) = 1) that is: keep d with probability p(d),
else draw from p without d, which is exactly "draw from p and compare with d": the loop does
that through the sampler itself, so a generation with point-mass drafts makes the same draws
as one without, and gives the same tokens for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .._core import Context, Model, Sampler
from .sequence import Sequence, common_prefix

# llama.cpp's defaults (common_params_speculative): n_max 16, n_min 0, p_min 0.75.
DEFAULT_DRAFT_MAX = 16
DEFAULT_DRAFT_MIN = 0
DEFAULT_DRAFT_P_MIN = 0.75


def check_draft_params(draft_max: Any, draft_min: Any, draft_p_min: Any) -> None:
    """ValueError unless the three are llama.cpp's --draft-max, --draft-min, --draft-p-min."""
    if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 1:
        raise ValueError(f"draft_max must be an int >= 1 (tokens drafted per step), not {draft_max!r}")
    if isinstance(draft_min, bool) or not isinstance(draft_min, int) or draft_min < 0:
        raise ValueError(f"draft_min must be an int >= 0 (fewer drafted tokens are not checked), not {draft_min!r}")
    if draft_min > draft_max:
        raise ValueError(f"draft_min ({draft_min}) must not exceed draft_max ({draft_max})")
    if isinstance(draft_p_min, bool) or not isinstance(draft_p_min, (int, float)) or not 0.0 <= draft_p_min <= 1.0:
        raise ValueError(f"draft_p_min must be a number in [0, 1], not {draft_p_min!r}")


@dataclass
class DraftParams:
    """llama.cpp's meanings: at most n_max tokens drafted per step; a draft of fewer than n_min
    tokens is not checked (the step decodes one token); a draft model stops drafting when its
    most probable token's probability falls below p_min."""

    n_max: int = DEFAULT_DRAFT_MAX
    n_min: int = DEFAULT_DRAFT_MIN
    p_min: float = DEFAULT_DRAFT_P_MIN

    def __post_init__(self) -> None:
        check_draft_params(self.n_max, self.n_min, self.p_min)
        self.p_min = float(self.p_min)


@dataclass
class SpeculativeStats:
    """Counters of the steps that checked drafted tokens."""

    verify_steps: int = 0  # decodes of a sampled token and its drafts
    drafted: int = 0  # tokens proposed and checked
    accepted: int = 0  # of those, kept
    generated: int = 0  # tokens those steps produced (the kept drafts, and one the target sampled)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "verify_steps": self.verify_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "generated": self.generated,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "tokens_per_step": self.generated / self.verify_steps if self.verify_steps else None,
        }

    def add(self, other: "SpeculativeStats") -> None:
        self.verify_steps += other.verify_steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.generated += other.generated


@dataclass
class Draft:
    """Proposed tokens; q: for each, the distribution it was drawn from (None: point masses)."""

    tokens: List[int] = field(default_factory=list)
    q: Optional[List[np.ndarray]] = None


def accept_draft(p: np.ndarray, q: Optional[np.ndarray], draft: int, rng: np.random.Generator) -> int:
    """The token a row gives: `draft` (drawn from q; None: a point mass) kept with probability
    min(1, p[draft] / q[draft]), else a draw from normalize(max(0, p - q)). Over the draft's
    own randomness the result is distributed as p."""
    q_d = 1.0 if q is None else float(q[draft])
    p_d = float(p[draft])
    if q_d > 0.0 and rng.random() * q_d < p_d:
        return int(draft)
    residual = np.asarray(p, dtype=np.float64).copy()
    if q is None:
        residual[draft] = 0.0
    else:
        residual -= np.asarray(q, dtype=np.float64)
        np.maximum(residual, 0.0, out=residual)
    total = residual.sum()
    if not total > 0.0:
        # p <= q everywhere yet the draft was rejected: only rounding gets here; p itself is
        # then the residual's limit.
        residual = np.asarray(p, dtype=np.float64)
        total = float(residual.sum())
    return int(rng.choice(len(residual), p=residual / total))


class DraftLength:
    """How many tokens to draft next: the k that maximises a step's expected tokens per second,
    (1 + a + ... + a^k) / (V(k) + k D), from what the steps so far cost and kept:

    - V(k): seconds of the decode of a token and k drafts (k = 0: a one-token step), an average
      per k, piecewise linear between the k measured and extrapolated by the slope from 0;
    - D: seconds the drafter took per proposal (a draft model's decodes; ~0 for prompt lookup);
    - a: the chance a draft is kept, each kept independently until the first rejection (a step
      that kept m of k drafts counts m kept and, if m < k, one rejected), recent steps weighing
      more; while nothing is drafted it drifts back to its prior, so drafting resumes.

    On a CPU, V grows with k (a Qwen2.5-1.5B check of 8 drafts costs 2.3 one-token steps here,
    docs/speculative.md), so a long draft pays only when nearly all of it is kept; with a draft
    model D adds a large share of a step per token. Without measurements yet it drafts the
    most it may (that measures V), then takes one step without drafts (that measures V(0)).
    The choice changes only the speed: every draft is checked.

    Once drafting does not pay, only V(0) is measured any more: one check timed during a
    moment of load (200 ms against 10 ms steps) would turn drafting off for good. So after
    `_PROBE_FIRST` steps without drafts a step drafts anyway (a probe) and its timings replace
    the old ones (V(k > 0), D); while probes keep finding that drafting does not pay, the steps
    between them double, up to `_PROBE_MAX` (a probe then costs at most ~1/256 of the steps'
    time per unit of V(k) / V(0)), and a probe after which drafting pays starts over."""

    _PRIOR_KEPT, _PRIOR_REJECTED = 2.0, 1.0  # a = 2/3 before anything is measured
    _DECAY = 0.9  # weight of the past per step
    _SMOOTHING = 0.3  # weight of a new timing
    _PROBE_FIRST, _PROBE_MAX = 16, 256  # steps without drafts before a probe

    def __init__(self) -> None:
        self.kept, self.rejected = self._PRIOR_KEPT, self._PRIOR_REJECTED
        self.verify_s: Dict[int, float] = {}
        self.draft_s: Optional[float] = None
        self.probing = False  # the drafts asked for are a probe: their timings replace the old ones
        self.probes = 0  # probes made (counted when asked for)
        self._idle_steps = 0  # steps chosen without drafts since drafts were last asked for
        self._probe_after = self._PROBE_FIRST

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def _average(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1.0 - self._SMOOTHING) * old + self._SMOOTHING * new

    def record_decode(self, k: int, seconds: float) -> None:
        """A decode of a token and k drafts took `seconds`."""
        if k > 0 and self.probing:
            # The check timings are stale: this one is the curve's new measurement.
            self.probing = False
            self.verify_s = {j: v for j, v in self.verify_s.items() if j == 0}
            self.verify_s[k] = seconds
            return
        self.verify_s[k] = self._average(self.verify_s.get(k), seconds)

    def record_draft(self, n: int, seconds: float) -> None:
        """The drafter proposed n tokens in `seconds`."""
        if n > 0:
            self.draft_s = seconds / n if self.probing else self._average(self.draft_s, seconds / n)

    def record_outcome(self, drafted: int, accepted: int) -> None:
        """A step checked `drafted` tokens and kept `accepted` (0 drafted: a step without)."""
        d = self._DECAY
        if drafted == 0:
            self.kept = d * self.kept + (1 - d) * self._PRIOR_KEPT
            self.rejected = d * self.rejected + (1 - d) * self._PRIOR_REJECTED
            return
        self.kept = d * self.kept + accepted
        self.rejected = d * self.rejected + (1.0 if accepted < drafted else 0.0)

    def cost(self, k: int) -> float:
        """Estimated seconds of a decode of a token and k drafts (needs V(0) and one V(k > 0))."""
        if k in self.verify_s:
            return self.verify_s[k]
        known = sorted(self.verify_s)
        below = [j for j in known if j < k]
        above = [j for j in known if j > k]
        if above:
            j0, j1 = below[-1], above[0]
            v0, v1 = self.verify_s[j0], self.verify_s[j1]
            return v0 + (v1 - v0) * (k - j0) / (j1 - j0)
        top = known[-1]
        slope = max((self.verify_s[top] - self.verify_s[0]) / top, 0.0)
        return self.verify_s[top] + slope * (k - top)

    def choose(self, room: int, n_min: int) -> int:
        """Drafts to ask for, at most `room` (0: a step without drafts)."""
        if room < max(n_min, 1):
            return 0
        if 0 in self.verify_s and len(self.verify_s) == 1 or not self.verify_s:
            return room  # no check measured yet
        if 0 not in self.verify_s:
            return 0  # no one-token step measured yet
        if self.probing:
            return self._probe_k(room, n_min)  # the probe's drafter proposed nothing yet
        a, per_draft = self.acceptance, self.draft_s or 0.0
        best_k, best_rate = 0, 1.0 / max(self.verify_s[0], 1e-9)
        for k in range(max(n_min, 1), room + 1):
            rate = mean_tokens(a, k) / max(self.cost(k) + k * per_draft, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k > 0:
            self._idle_steps, self._probe_after = 0, self._PROBE_FIRST
            return best_k
        self._idle_steps += 1
        if self._idle_steps < self._probe_after:
            return 0
        self._idle_steps, self._probe_after = 0, min(2 * self._probe_after, self._PROBE_MAX)
        self.probing = True
        self.probes += 1
        return self._probe_k(room, n_min)

    def _probe_k(self, room: int, n_min: int) -> int:
        """A probe's draft length: the longest measured one that fits (the curve's far end)."""
        measured = [k for k in self.verify_s if max(n_min, 1) <= k <= room]
        return max(measured) if measured else room


class Drafter:
    """Proposes tokens for a generation; keeps its own counters and draft-length estimates."""

    def __init__(self, params: DraftParams):
        self.params = params
        self.stats = SpeculativeStats()
        self.length = DraftLength()

    def propose(self, history: np.ndarray, n_max: int, sampler: Sampler, rng: np.random.Generator) -> Draft:
        """Up to n_max tokens to follow `history` (the held tokens and the token just sampled)."""
        raise NotImplementedError

    def for_slot(self, *, n_ctx: int, n_threads: int) -> "Drafter":
        """A drafter of its own for another sequence of the same model (a ParallelLlama slot) of
        n_ctx positions, drafting on n_threads threads."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class CallableDrafter(Drafter):
    """llama-cpp-python's LlamaDraftModel (its __call__(input_ids) returns proposed ids), or any
    callable with that signature. Called as upstream's Llama.generate calls it: with every held
    token and the one just sampled."""

    def __init__(self, source: Callable[..., Any], params: DraftParams):
        super().__init__(params)
        self.source = source

    def propose(self, history: np.ndarray, n_max: int, sampler: Sampler, rng: np.random.Generator) -> Draft:
        proposed = np.asarray(self.source(history)).reshape(-1)[: max(n_max, 0)]
        tokens = [int(t) for t in proposed]
        return Draft(tokens if len(tokens) >= max(self.params.n_min, 1) else [])

    def for_slot(self, *, n_ctx: int, n_threads: int) -> "CallableDrafter":
        return CallableDrafter(self.source, self.params)


def check_vocabularies(target: Model, draft: Model, target_name: str, draft_name: str) -> None:
    """ValueError unless `draft` proposes in `target`'s vocabulary (llama.cpp's rule for -md:
    powerinfer_vocab_compatible)."""
    target.check_draft_vocab(draft, f"the draft model {draft_name} does not share the vocabulary of {target_name}; "
                                    "a draft model must use the target's tokenizer")


class ModelDrafter(Drafter):
    """A draft model (llama.cpp's -md): a sequence of its own on its own context, kept in step
    with the target's tokens (its longest prefix reused each step)."""

    def __init__(self, model: Model, params: DraftParams, *, n_ctx: int, n_batch: int, n_threads: int,
                 n_threads_batch: int):
        super().__init__(params)
        self.model = model
        self._ctx_params = dict(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, n_threads_batch=n_threads_batch)
        self.ctx = Context(model, **self._ctx_params)
        self.n_vocab = model.n_vocab()
        self.seq = Sequence(self.ctx, self.ctx.n_ctx(), self.n_vocab, keep_scores=False)
        self._q_sampler: Optional[Sampler] = None
        self._q_for: Optional[Sampler] = None

    def _draw_sampler(self, sampler: Sampler) -> Optional[Sampler]:
        """The distribution q proposals are drawn from when the generation samples: the
        generation's temperature and truncation on the draft's logits. None: greedy drafts
        (a greedy generation, or a Mirostat one, whose draw has no fixed distribution)."""
        if sampler.greedy or not sampler.has_distribution:
            return None
        if self._q_for is not sampler:
            self._q_sampler = Sampler(self.model, seed=sampler.seed, **sampler.draw_settings())
            self._q_for = sampler
        return self._q_sampler

    def propose(self, history: np.ndarray, n_max: int, sampler: Sampler, rng: np.random.Generator) -> Draft:
        n_max = min(n_max, self.seq.n_ctx - len(history))
        if n_max <= 0:
            return Draft()
        seq = self.seq
        # Keep what the draft holds of the history, and decode at least its last token (the
        # logits after it are what the first proposal comes from).
        keep = min(common_prefix(seq.tokens, history), len(history) - 1)
        if keep < seq.n_tokens:
            seq.rewind(keep)
        seq.eval(history[keep:])
        q_sampler = self._draw_sampler(sampler)
        tokens: List[int] = []
        qs: List[np.ndarray] = []
        for i in range(n_max):
            logits = seq.logits(-1)
            if q_sampler is None:
                token = int(np.argmax(logits))  # the greedy sampler's pick (the first maximum)
                top = 1.0 / float(np.sum(np.exp(logits.astype(np.float64) - float(logits[token]))))
            else:
                q = q_sampler.probs(seq.backend, -1, seq.tokens).astype(np.float64)
                q /= q.sum()
                token = int(rng.choice(self.n_vocab, p=q))
                top = float(q.max())
            if top < self.params.p_min:
                break
            tokens.append(token)
            if q_sampler is not None:
                qs.append(q)
            if i + 1 < n_max:
                seq.eval([token])
        if len(tokens) < max(self.params.n_min, 1):
            return Draft()
        return Draft(tokens, qs if q_sampler is not None else None)

    def for_slot(self, *, n_ctx: int, n_threads: int) -> "ModelDrafter":
        return ModelDrafter(self.model.share(), self.params, n_ctx=n_ctx, n_batch=self._ctx_params["n_batch"],
                            n_threads=n_threads, n_threads_batch=n_threads)

    def close(self) -> None:
        self._q_sampler = self._q_for = None
        self.ctx.close()
        self.model.close()


def mean_tokens(accept_rate: float, k: int) -> float:
    """Tokens a step that checks k drafts gives when each is kept with probability accept_rate
    (independently): 1 + a + ... + a^k."""
    return float(sum(accept_rate ** i for i in range(k + 1)))


def break_even_acceptance(k: int, cost_ratio: float) -> Optional[float]:
    """The acceptance rate at which drafting k tokens per step pays nothing: a step that costs
    `cost_ratio` single-token steps (the verify decode and the drafting) must give as many
    tokens. None when even keeping every draft does not pay (k + 1 < cost_ratio)."""
    if k + 1 < cost_ratio:
        return None
    if cost_ratio <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if mean_tokens(a, k) < cost_ratio else (lo, a)
    return (lo + hi) / 2
