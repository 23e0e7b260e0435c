"""Llama.create_completion: prompt assembly (BOS, infill), prompt cache, the generation
loop with stop strings, streaming chunks and logprobs.

This follows llama-cpp-python 0.3.36's Llama._create_completion (MIT licence) closely,
so responses and stream chunks have the same keys, types and text. Deliberate
differences, each marked "Upstream:" below: infill uses the vocabulary's real FIM
tokens, logit_bias combines with logits_processor, and an empty prompt on a vocabulary
without automatic BOS starts from BOS instead of failing.
"""

from __future__ import annotations

import random
import sys
import time
import uuid
import warnings
from typing import Any, Dict, Iterator, List, Optional, Union

from .._core import LogitBias
from . import generation, tokenizer
from .constants import LLAMA_DEFAULT_SEED


def create_completion_stream(
    self: Any,
    prompt: Union[str, List[int]],
    suffix: Optional[str] = None,
    max_tokens: Optional[int] = 16,
    temperature: float = 0.8,
    top_p: float = 0.95,
    min_p: float = 0.05,
    typical_p: float = 1.0,
    logprobs: Optional[int] = None,
    echo: bool = False,
    stop: Optional[Union[str, List[str]]] = [],
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    repeat_penalty: float = 1.0,
    top_k: int = 40,
    stream: bool = False,
    seed: Optional[int] = None,
    tfs_z: float = 1.0,
    mirostat_mode: int = 0,
    mirostat_tau: float = 5.0,
    mirostat_eta: float = 0.1,
    model: Optional[str] = None,
    stopping_criteria=None,
    logits_processor=None,
    grammar=None,
    logit_bias: Optional[Dict[int, float]] = None,
) -> Iterator[Dict[str, Any]]:
    """Yields the completion (stream=False) or its chunks (stream=True); `self` is the
    powerinfer_py.Llama (the name keeps the code close to upstream's method)."""
    assert suffix is None or suffix.__class__ is str
    self._require_ctx()
    Llama = type(self)

    completion_id: str = f"cmpl-{str(uuid.uuid4())}"
    created: int = int(time.time())
    bos_token_id: int = self.token_bos()
    cls_token_id: int = tokenizer.token_cls(self)
    sep_token_id: int = tokenizer.token_sep(self)
    # Upstream: the FIM tokens are hard-coded to token 0 ("TODO: Fix"), which puts
    # arbitrary tokens around the infill prompt. We use the vocabulary's FIM tokens; a
    # vocabulary without them gets upstream's no-FIM path (prompt only, suffix appended).
    if suffix is not None:
        prefix_token_id, suffix_token_id, middle_token_id = tokenizer.fim_tokens(self)
    else:
        prefix_token_id = suffix_token_id = middle_token_id = -1
    bos_tokens: List[int] = [cls_token_id if cls_token_id != -1 else bos_token_id]
    eos_tokens: List[int] = [sep_token_id if sep_token_id != -1 else self.token_eos()]

    if (isinstance(prompt, list) and suffix is None) or not tokenizer.add_bos_token(self) or bos_tokens[:1] == [-1]:
        bos_tokens = []

    if (isinstance(prompt, list) and suffix is None) or (not tokenizer.add_eos_token(self) and sep_token_id == -1):
        eos_tokens = []

    # If prompt is empty, initialize completion with BOS token to avoid
    # detokenization including a space at the beginning of the completion
    completion_tokens: List[int] = [] if len(prompt) > 0 else [bos_token_id]
    prefix_tokens: List[int] = ([prefix_token_id] if prefix_token_id >= 0 and suffix is not None else []) + (
        (
            self.tokenize(
                prompt.encode("utf-8"),
                add_bos=False,
                special=(prefix_token_id < 0 or suffix is None),
            )
            if prompt != ""
            else []
        )
        if isinstance(prompt, str)
        else [int(t) for t in prompt]
    )
    # Upstream prepends "☺" to the suffix and drops two tokens to undo an SPM space
    # prefix; like llama.cpp's server we tokenize the suffix as it is.
    suffix_tokens: List[int] = (
        ([suffix_token_id] + (self.tokenize(suffix.encode("utf-8"), add_bos=False, special=False) if suffix else []))
        if suffix_token_id >= 0 and suffix is not None
        else []
    )
    middle_tokens: List[int] = [middle_token_id] if middle_token_id >= 0 and suffix is not None else []
    prompt_tokens: List[int] = (
        bos_tokens
        + (
            (suffix_tokens + prefix_tokens + middle_tokens)
            if self.spm_infill
            else (prefix_tokens + suffix_tokens + middle_tokens)
        )
        + eos_tokens
    )
    if not prompt_tokens:
        # Upstream fails (an assertion in sample()) on an empty prompt without automatic BOS.
        if bos_token_id == -1:
            raise ValueError("the prompt is empty and the vocabulary has no BOS token")
        prompt_tokens = [bos_token_id]
    text: bytes = b""
    returned_tokens: int = 0
    stop = stop if isinstance(stop, list) else [stop] if isinstance(stop, str) else []
    model_name: str = model if model is not None else self.model_path

    if prompt_tokens[:2] == [self.token_bos()] * 2:
        warnings.warn(
            f'Detected duplicate leading "{tokenizer.token_text(self, self.token_bos())}" in prompt, this will likely reduce '
            "response quality, consider removing it...",
            RuntimeWarning,
        )

    if logit_bias is not None:
        # Upstream: `logits_processor = logits_processor.extend(...)` drops both the
        # processors and the bias when both are given (list.extend returns None).
        processors = list(logits_processor) if logits_processor is not None else []
        processors.append(LogitBias(logit_bias, self._n_vocab))
        logits_processor = processors

    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"logprobs must be None or an int >= 0, not {logprobs!r}")

    if self.verbose:
        self.reset_timings()

    if len(prompt_tokens) >= self._n_ctx:
        raise ValueError(f"Requested tokens ({len(prompt_tokens)}) exceed context window of {self._n_ctx}")

    if max_tokens is None or max_tokens <= 0:
        # Unlimited, depending on n_ctx.
        max_tokens = self._n_ctx - len(prompt_tokens)

    # Truncate max_tokens if requested tokens would exceed the context window
    max_tokens = max_tokens if max_tokens + len(prompt_tokens) < self._n_ctx else (self._n_ctx - len(prompt_tokens))

    if stop != []:
        stop_sequences = [s.encode("utf-8") for s in stop]
    else:
        stop_sequences = []

    if logprobs is not None and self._logits_all is False:
        raise ValueError("logprobs is not supported for models created with logits_all=False")

    if self.cache:
        try:
            cache_item = self.cache[prompt_tokens]
            cache_prefix_len = Llama.longest_token_prefix(
                cache_item.input_ids[: cache_item.n_tokens].tolist(), prompt_tokens
            )
            eval_prefix_len = Llama.longest_token_prefix(self._input_ids.tolist(), prompt_tokens)
            if cache_prefix_len > eval_prefix_len:
                self.load_state(cache_item)
                if self.verbose:
                    print("Llama._create_completion: cache hit", file=sys.stderr)
        except KeyError:
            if self.verbose:
                print("Llama._create_completion: cache miss", file=sys.stderr)

    if not generation.is_random_seed(seed):
        self.set_seed(seed)
    else:
        # The next seed of the Llama's stream (upstream's rule; the stream starts from a random
        # seed unless the Llama was given one); -1 or LLAMA_DEFAULT_SEED per call: unseeded.
        self.set_seed(random.Random(self._seed).randint(0, 2**32) % LLAMA_DEFAULT_SEED)

    _record_finish(self, prompt_tokens, [], None)  # the prompt's size, known from the first chunk on
    finish_reason = "length"
    stop_found: Optional[bytes] = None
    multibyte_fix = 0
    # The completion's text, kept as tokens come: self.detokenize(completion_tokens) on every
    # token cost O(length) per token. The same bytes: the pieces joined, without the leading
    # space of a completion that starts with BOS (the tokenizer's rule).
    raw_text = b"".join(tokenizer.token_to_piece(self, t, False) for t in completion_tokens)
    starts_with_bos = bool(completion_tokens) and completion_tokens[0] == self._token_bos
    # This loop takes at most max_tokens tokens (a generation sampled ahead of it, on a
    # ParallelLlama slot, samples no more), and reads the logits rows (self._scores) only for
    # logprobs (without, a slot may sample it in the core).
    for token in self._generate_completion(
        prompt_tokens,
        max_tokens,
        logprobs is not None,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        temp=temperature,
        tfs_z=tfs_z,
        mirostat_mode=mirostat_mode,
        mirostat_tau=mirostat_tau,
        mirostat_eta=mirostat_eta,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repeat_penalty=repeat_penalty,
        stopping_criteria=stopping_criteria,
        logits_processor=logits_processor,
        grammar=grammar,
    ):
        if self.token_is_eog(token):
            text = self.detokenize(completion_tokens, prev_tokens=prompt_tokens)
            finish_reason = "stop"
            break

        completion_tokens.append(token)

        raw_text += tokenizer.token_to_piece(self, token, False)
        all_text = raw_text[1:] if starts_with_bos and raw_text[:1] == b" " else raw_text

        # Contains multi-byte UTF8
        for k, char in enumerate(all_text[-3:]):
            k = 3 - k
            for num, pattern in [(2, 192), (3, 224), (4, 240)]:
                # Bitwise AND check
                if num > k and pattern & char == pattern:
                    multibyte_fix = num - k

        # Stop incomplete bytes from passing
        if multibyte_fix > 0:
            multibyte_fix -= 1
            continue

        any_stop = [s for s in stop_sequences if s in all_text]
        if len(any_stop) > 0:
            first_stop = any_stop[0]
            text = all_text[: all_text.index(first_stop)]
            finish_reason = "stop"
            stop_found = first_stop
            break

        if stream:
            remaining_tokens = completion_tokens[returned_tokens:]
            remaining_text = self.detokenize(
                remaining_tokens,
                prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
            )
            remaining_length = len(remaining_text)

            # We want to avoid yielding any characters from
            # the generated text if they are part of a stop
            # sequence.
            first_stop_position = 0
            for s in stop_sequences:
                for i in range(min(len(s), remaining_length), 0, -1):
                    if remaining_text.endswith(s[:i]):
                        if i > first_stop_position:
                            first_stop_position = i
                        break

            token_end_position = 0

            if logprobs is not None:
                # not sure how to handle this branch when dealing
                # with CJK output, so keep it unchanged
                for token in remaining_tokens:
                    if token == bos_token_id:
                        continue
                    token_end_position += len(
                        self.detokenize(
                            [token],
                            prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                        )
                    )
                    # Check if stop sequence is in the token
                    if token_end_position > (remaining_length - first_stop_position):
                        break
                    token_str = self.detokenize(
                        [token],
                        prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                    ).decode("utf-8", errors="ignore")
                    text_offset = len(prompt) + len(
                        self.detokenize(
                            completion_tokens[:returned_tokens],
                            prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                        ).decode("utf-8", errors="ignore")
                    )
                    token_offset = len(prompt_tokens) + returned_tokens
                    logits = self._scores[token_offset - 1, :]
                    current_logprobs = Llama.logits_to_logprobs(logits).tolist()
                    sorted_logprobs = list(
                        sorted(
                            zip(current_logprobs, range(len(current_logprobs))),
                            reverse=True,
                        )
                    )
                    top_logprob = {
                        self.detokenize([i]).decode("utf-8", errors="ignore"): logprob
                        for logprob, i in sorted_logprobs[:logprobs]
                    }
                    top_logprob.update({token_str: current_logprobs[int(token)]})
                    logprobs_or_none = {
                        "tokens": [
                            self.detokenize(
                                [token],
                                prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                            ).decode("utf-8", errors="ignore")
                        ],
                        "text_offset": [text_offset],
                        "token_logprobs": [current_logprobs[int(token)]],
                        "top_logprobs": [top_logprob],
                    }
                    returned_tokens += 1
                    yield {
                        "id": completion_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {
                                "text": self.detokenize(
                                    [token],
                                    prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                                ).decode("utf-8", errors="ignore"),
                                "index": 0,
                                "logprobs": logprobs_or_none,
                                "finish_reason": None,
                            }
                        ],
                    }
            else:
                while len(remaining_tokens) > 0:
                    decode_success = False
                    for i in range(1, len(remaining_tokens) + 1):
                        try:
                            bs = self.detokenize(
                                remaining_tokens[:i],
                                prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                            )
                            ts = bs.decode("utf-8")
                            decode_success = True
                            break
                        except UnicodeError:
                            pass
                    else:
                        break
                    if not decode_success:
                        # all remaining tokens cannot be decoded to a UTF-8 character
                        break
                    token_end_position += len(bs)
                    if token_end_position > (remaining_length - first_stop_position):
                        break
                    remaining_tokens = remaining_tokens[i:]
                    returned_tokens += i

                    yield {
                        "id": completion_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {
                                "text": ts,
                                "index": 0,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }

        if len(completion_tokens) >= max_tokens:
            text = self.detokenize(completion_tokens, prev_tokens=prompt_tokens)
            finish_reason = "length"
            break

    if stopping_criteria is not None and stopping_criteria(self._input_ids, self._last_logits_view()):
        text = self.detokenize(completion_tokens, prev_tokens=prompt_tokens)
        finish_reason = "stop"

    if self.verbose:
        self.print_timings()

    if stream:
        remaining_tokens = completion_tokens[returned_tokens:]
        remaining_text = self.detokenize(
            remaining_tokens,
            prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
        )
        any_stop = [s for s in stop_sequences if s in remaining_text]
        if len(any_stop) > 0:
            end = min(remaining_text.index(stop) for stop in any_stop)
        else:
            end = len(remaining_text)

        token_end_position = 0
        for token in remaining_tokens:
            token_end_position += len(
                self.detokenize(
                    [token],
                    prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                )
            )

            logprobs_or_none: Optional[Dict[str, Any]] = None
            if logprobs is not None:
                if token == bos_token_id:
                    continue
                token_str = self.detokenize([token]).decode("utf-8", errors="ignore")
                text_offset = len(prompt) + len(
                    self.detokenize(
                        completion_tokens[:returned_tokens],
                        prev_tokens=prompt_tokens + completion_tokens[:returned_tokens],
                    )
                )
                token_offset = len(prompt_tokens) + returned_tokens - 1
                logits = self._scores[token_offset, :]
                current_logprobs = Llama.logits_to_logprobs(logits).tolist()
                sorted_logprobs = list(
                    sorted(
                        zip(current_logprobs, range(len(current_logprobs))),
                        reverse=True,
                    )
                )
                top_logprob = {
                    self.detokenize([i]).decode("utf-8", errors="ignore"): logprob
                    for logprob, i in sorted_logprobs[:logprobs]
                }
                top_logprob.update({token_str: current_logprobs[int(token)]})
                logprobs_or_none = {
                    "tokens": [self.detokenize([token]).decode("utf-8", errors="ignore")],
                    "text_offset": [text_offset],
                    "token_logprobs": [current_logprobs[int(token)]],
                    "top_logprobs": [top_logprob],
                }

            if token_end_position >= end:
                last_text = self.detokenize([token])
                if token_end_position == end - 1:
                    break
                returned_tokens += 1
                yield {
                    "id": completion_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [
                        {
                            "text": last_text[: len(last_text) - (token_end_position - end)].decode(
                                "utf-8", errors="ignore"
                            ),
                            "index": 0,
                            "logprobs": logprobs_or_none,
                            "finish_reason": None,
                        }
                    ],
                }
                break
            returned_tokens += 1
            yield {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "text": self.detokenize([token]).decode("utf-8", errors="ignore"),
                        "index": 0,
                        "logprobs": logprobs_or_none,
                        "finish_reason": None,
                    }
                ],
            }
        _record_finish(self, prompt_tokens, completion_tokens, stop_found)
        yield {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "text": "",
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
        }
        if self.cache:
            if self.verbose:
                print("Llama._create_completion: cache save", file=sys.stderr)
            self.cache[prompt_tokens + completion_tokens] = self.save_state()
            if self.verbose:
                print("Llama._create_completion: cache saved", file=sys.stderr)
        return

    if self.cache:
        if self.verbose:
            print("Llama._create_completion: cache save", file=sys.stderr)
        self.cache[prompt_tokens + completion_tokens] = self.save_state()

    text_str = text.decode("utf-8", errors="ignore")

    if echo:
        text_str = prompt + text_str

    if suffix_token_id < 0 and suffix is not None:
        text_str = text_str + suffix

    logprobs_or_none = None
    if logprobs is not None:
        text_offset = 0 if echo else len(prompt)
        token_offset = 0 if echo else len(prompt_tokens[1:])
        text_offsets: List[int] = []
        token_logprobs: List[Optional[float]] = []
        tokens: List[str] = []
        top_logprobs: List[Optional[Dict[str, float]]] = []

        if echo:
            # Remove leading BOS token if exists
            all_tokens = prompt_tokens[1 if prompt_tokens[0] == self.token_bos() else 0 :] + completion_tokens
        else:
            all_tokens = completion_tokens

        all_token_strs = [
            self.detokenize([token], prev_tokens=all_tokens[:i]).decode("utf-8", errors="ignore")
            for i, token in enumerate(all_tokens)
        ]
        all_logprobs = Llama.logits_to_logprobs(self._scores)[token_offset:]
        for idx, (token, token_str, logprobs_token) in enumerate(zip(all_tokens, all_token_strs, all_logprobs)):
            if token == bos_token_id:
                continue
            text_offsets.append(
                text_offset + len(self.detokenize(all_tokens[:idx]).decode("utf-8", errors="ignore"))
            )
            tokens.append(token_str)
            sorted_logprobs = list(sorted(zip(logprobs_token, range(len(logprobs_token))), reverse=True))
            token_logprobs.append(logprobs_token[int(token)])
            top_logprob: Optional[Dict[str, float]] = {
                self.detokenize([i], prev_tokens=all_tokens[:idx]).decode("utf-8", errors="ignore"): logprob
                for logprob, i in sorted_logprobs[:logprobs]
            }
            top_logprob.update({token_str: logprobs_token[int(token)]})
            top_logprobs.append(top_logprob)
        # Weird idosincracy of the OpenAI API where
        # token_logprobs and top_logprobs are null for
        # the first token.
        if echo and len(all_tokens) > 0:
            token_logprobs[0] = None
            top_logprobs[0] = None
        logprobs_or_none = {
            "tokens": tokens,
            "text_offset": text_offsets,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
        }

    _record_finish(self, prompt_tokens, completion_tokens, stop_found)
    yield {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [
            {
                "text": text_str,
                "index": 0,
                "logprobs": logprobs_or_none,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_tokens),
            "completion_tokens": len(completion_tokens),
            "total_tokens": len(prompt_tokens) + len(completion_tokens),
        },
    }


def _record_finish(llama: Any, prompt_tokens: List[int], completion_tokens: List[int], stop: Optional[bytes]) -> None:
    """What a completion's chunks do not say, for the server's other APIs (Anthropic's
    stop_sequence, a stream's usage): its token counts and the stop string that ended it
    (recorded when its generation starts, and again when it ends)."""
    llama._last_finish = {
        "prompt_tokens": len(prompt_tokens),
        "completion_tokens": len(completion_tokens),
        "stop_sequence": stop.decode("utf-8", errors="replace") if stop is not None else None,
    }
