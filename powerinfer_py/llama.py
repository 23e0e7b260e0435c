"""`Llama`: the class users drive, with llama-cpp-python 0.3.36's interface and semantics.

It runs on libpowerinfer. For a model whose architecture the core does not
implement, it falls back to llama-cpp-python's dense engine (when installed), so
every model llama.cpp runs still runs here.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time
import uuid
from typing import Any, Dict, Generator, List, Optional, Sequence, Union

import numpy as np

from . import PowerInferError
from ._bindings import STATUS_NAMES, ffi, last_error, last_status, lib, string, version

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

ENGINE_POWERINFER = "powerinfer"
ENGINE_LLAMA_CPP = "llama-cpp-python"

def _status_name(status: Optional[int]) -> str:
    return STATUS_NAMES.get(status, str(status)) if status is not None else "unknown status"


def _core_error(what: str, status: Optional[int] = None) -> PowerInferError:
    message = last_error() or "no message from the core"
    if status is not None:
        return PowerInferError(f"{what} ({_status_name(status)}): {message}", status)
    return PowerInferError(f"{what}: {message}", last_status())


def _read_string(fn, *args) -> str:
    """Calls a core function of the form f(..., char *buf, size_t buf_size) -> full length."""
    size = 256
    while True:
        buf = ffi.new("char[]", size)
        n = fn(*args, buf, size)
        if n < 0:
            return ""
        if n < size:
            return ffi.string(buf).decode("utf-8", errors="replace")
        size = n + 1


class Llama:
    """High-level wrapper of a libpowerinfer model and context, mirroring llama_cpp.Llama."""

    def __init__(
        self,
        model_path: str,
        *,
        n_gpu_layers: int = 0,
        vocab_only: bool = False,
        use_mmap: bool = True,
        seed: int = LLAMA_DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_threads: Optional[int] = None,
        n_threads_batch: Optional[int] = None,
        logits_all: bool = False,
        flash_attn: bool = False,
        last_n_tokens_size: int = 64,
        vram_budget: Optional[float] = None,
        fallback: bool = True,
        verbose: bool = True,
        **kwargs: Any,  # llama-cpp-python parameters this engine does not use
    ):
        """Load a model.

        Args:
            model_path: Path to a GGUF (standard or PowerInfer) model.
            vocab_only: Load only the vocabulary and metadata (tokenize/detokenize); no context.
            n_ctx: KV cache size in tokens; 0: the model's training context.
            n_batch: Largest number of tokens computed in one graph.
            n_threads: Decode threads (default: half the cores, as llama-cpp-python).
            n_threads_batch: Prompt threads (default: all cores).
            seed: Seed of the sampler; LLAMA_DEFAULT_SEED: random.
            logits_all: Keep the logits of every evaluated token in `scores`.
            vram_budget: Device memory budget for hybrid placement, in GiB; None: automatic.
            fallback: Run architectures the core does not implement on llama-cpp-python.
            verbose: Print the engine, the core's log and timings to stderr.

        Raises:
            ValueError: The path does not exist or the model cannot be loaded
                (a PowerInferError carrying the core's message).
        """
        # Set first so close() works on a half-built object.
        self._model = None
        self._ctx = None
        self._fallback = None

        self.model_path = model_path
        self.verbose = verbose
        self.engine = ENGINE_POWERINFER
        self._logits_all = logits_all
        self.last_n_tokens_size = last_n_tokens_size
        self._seed = seed or LLAMA_DEFAULT_SEED
        self.n_batch = min(n_ctx, n_batch) if n_ctx > 0 else n_batch
        self.n_threads = n_threads or max(multiprocessing.cpu_count() // 2, 1)
        self.n_threads_batch = n_threads_batch or multiprocessing.cpu_count()

        if not os.path.exists(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")

        lib.powerinfer_log_set_level(lib.POWERINFER_LOG_INFO if verbose else lib.POWERINFER_LOG_NONE)

        model_params = lib.powerinfer_model_default_params()
        model_params.n_threads = self.n_threads
        model_params.vram_budget_gib = -1.0 if vram_budget is None else float(vram_budget)
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_mmap = use_mmap
        model_params.vocab_only = vocab_only

        model = lib.powerinfer_model_load(os.fsencode(model_path), model_params)
        if model == ffi.NULL:
            message = last_error() or "no message from the core"
            status = last_status()
            unsupported = status == lib.POWERINFER_ERR_UNSUPPORTED
            if fallback and unsupported:
                self._load_fallback(
                    message,
                    dict(
                        n_gpu_layers=n_gpu_layers,
                        vocab_only=vocab_only,
                        use_mmap=use_mmap,
                        seed=seed,
                        n_ctx=n_ctx,
                        n_batch=n_batch,
                        n_threads=self.n_threads,
                        n_threads_batch=self.n_threads_batch,
                        logits_all=logits_all,
                        flash_attn=flash_attn,
                        last_n_tokens_size=last_n_tokens_size,
                        verbose=verbose,
                        **kwargs,
                    ),
                )
                return
            raise PowerInferError(f"Failed to load model from file: {model_path}: {message}", status)
        self._model = model
        self._n_vocab = int(lib.powerinfer_model_n_vocab(self._model))
        self._token_eos = int(lib.powerinfer_token_eos(self._model))
        self._token_bos = int(lib.powerinfer_token_bos(self._model))
        self.metadata: Dict[str, str] = self._read_metadata()
        # Tokens held in the KV cache, in order; n_tokens == powerinfer_kv_pos(ctx).
        self.n_tokens = 0
        self.input_ids: List[int] = []
        self.scores: Optional[np.ndarray] = None
        self._n_ctx = 0
        if vocab_only:
            if verbose:
                print(f"powerinfer_py: engine {ENGINE_POWERINFER}, vocabulary only", file=sys.stderr)
            return

        ctx_params = lib.powerinfer_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = self.n_batch
        ctx_params.seed = self._seed & 0xFFFFFFFF
        ctx_params.n_threads = self.n_threads
        ctx_params.n_threads_batch = self.n_threads_batch
        ctx_params.flash_attn = flash_attn
        ctx = lib.powerinfer_context_new(self._model, ctx_params)
        if ctx == ffi.NULL:
            err = _core_error(f"Failed to create a context for {model_path}")
            self.close()
            raise err
        self._ctx = ctx
        self.n_batch = int(lib.powerinfer_n_batch(self._ctx))
        self._n_ctx = int(lib.powerinfer_n_ctx(self._ctx))
        # Logits of every evaluated token, only with logits_all (as llama-cpp-python).
        if logits_all:
            self.scores = np.zeros((self._n_ctx, self._n_vocab), dtype=np.single)

        if verbose:
            print(
                f"powerinfer_py: engine {ENGINE_POWERINFER} (libpowerinfer {version()}): "
                f"arch {self.arch()}, ffn activation {self.ffn_activation()}, "
                f"{lib.powerinfer_model_n_params(self._model) / 1e6:.1f}M params, "
                f"{lib.powerinfer_model_size(self._model) / 2**20:.1f} MiB of weights, "
                f"n_ctx {self._n_ctx}, threads {self.n_threads}/{self.n_threads_batch}",
                file=sys.stderr,
            )

    def _load_fallback(self, core_message: str, params: Dict[str, Any]) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise PowerInferError(
                f"Failed to load model from file: {self.model_path}: {core_message} "
                "(install llama-cpp-python==0.3.36 to run it on the dense fallback engine)",
                lib.POWERINFER_ERR_UNSUPPORTED,
            ) from None
        if self.verbose:
            print(
                f"powerinfer_py: {core_message}; falling back to engine {ENGINE_LLAMA_CPP}",
                file=sys.stderr,
            )
        try:
            self._fallback = llama_cpp.Llama(model_path=self.model_path, **params)
        except Exception as e:
            raise PowerInferError(
                f"Failed to load model from file: {self.model_path}: {core_message}; "
                f"the {ENGINE_LLAMA_CPP} fallback failed too: {e}",
                lib.POWERINFER_ERR_UNSUPPORTED,
            ) from e
        self.engine = ENGINE_LLAMA_CPP
        self.metadata = self._fallback.metadata
        self.n_batch = self._fallback.n_batch
        if self.verbose:
            print(f"powerinfer_py: engine {ENGINE_LLAMA_CPP} (dense)", file=sys.stderr)

    # ---- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model now (idempotent)."""
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        if self._ctx is not None:
            lib.powerinfer_context_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            lib.powerinfer_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_model(self):
        if self._model is None:
            raise RuntimeError("the model was closed")
        return self._model

    def _require_ctx(self):
        if self._ctx is None:
            raise RuntimeError(
                "the model was closed" if self._model is None else "the model was loaded with vocab_only=True"
            )
        return self._ctx

    # ---- model and vocabulary --------------------------------------------------

    def n_ctx(self) -> int:
        """The context window size."""
        if self._fallback is not None:
            return self._fallback.n_ctx()
        self._require_model()
        return self._n_ctx

    def n_embd(self) -> int:
        if self._fallback is not None:
            return self._fallback.n_embd()
        return int(lib.powerinfer_model_n_embd(self._require_model()))

    def n_vocab(self) -> int:
        if self._fallback is not None:
            return self._fallback.n_vocab()
        self._require_model()
        return self._n_vocab

    def token_bos(self) -> int:
        """The beginning-of-sequence token, -1 if the vocabulary has none."""
        if self._fallback is not None:
            return self._fallback.token_bos()
        return int(lib.powerinfer_token_bos(self._require_model()))

    def token_eos(self) -> int:
        """The end-of-sequence token, -1 if the vocabulary has none."""
        if self._fallback is not None:
            return self._fallback.token_eos()
        return int(lib.powerinfer_token_eos(self._require_model()))

    def token_is_eog(self, token: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ...)."""
        if self._fallback is not None:
            import llama_cpp

            return bool(llama_cpp.llama_vocab_is_eog(self._fallback._model.vocab, token))
        return bool(lib.powerinfer_token_is_eog(self._require_model(), token))

    def arch(self) -> str:
        """The model's architecture (general.architecture)."""
        if self._fallback is not None:
            return self.metadata.get("general.architecture", "")
        return string(lib.powerinfer_model_arch(self._require_model()))

    def ffn_activation(self) -> str:
        """The FFN activation the core uses ("silu", "relu", "gelu")."""
        if self._fallback is not None:
            return ""
        return string(lib.powerinfer_model_ffn_activation(self._require_model()))

    def _read_metadata(self) -> Dict[str, str]:
        metadata: Dict[str, str] = {}
        model = self._model
        for i in range(lib.powerinfer_model_meta_count(model)):
            key = _read_string(lib.powerinfer_model_meta_key_by_index, model, i)
            metadata[key] = _read_string(lib.powerinfer_model_meta_val_str_by_index, model, i)
        return metadata

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        """Tokenize utf-8 `text`.

        Args:
            add_bos: Add the vocabulary's special prefix (BOS) when it asks for one.
            special: Parse special tokens (e.g. "<|im_start|>") in the text.
        """
        if self._fallback is not None:
            return self._fallback.tokenize(text, add_bos=add_bos, special=special)
        model = self._require_model()
        n_max = len(text) + 8
        for _ in range(2):
            buf = ffi.new("powerinfer_token[]", n_max)
            n = lib.powerinfer_tokenize(model, text, len(text), buf, n_max, add_bos, special)
            if n >= 0:
                return list(ffi.unpack(buf, n))
            n_max = -n
        raise RuntimeError(f'Failed to tokenize: text="{text!r}" n_tokens={n}: {last_error()}')

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        model = self._require_model()
        size = 64
        while True:
            buf = ffi.new("char[]", size)
            n = lib.powerinfer_token_to_piece(model, token, buf, size, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:]
            if -n <= size:  # a negative count that is not a size request
                raise RuntimeError(f"Failed to convert token {token} to text: {last_error()}")
            size = -n

    def detokenize(
        self,
        tokens: Sequence[int],
        prev_tokens: Optional[Sequence[int]] = None,
        special: bool = False,
    ) -> bytes:
        """Concatenated pieces of `tokens` (llama-cpp-python's LlamaTokenizer rule:
        a leading space after an initial BOS is dropped; prev_tokens is unused)."""
        if self._fallback is not None:
            return self._fallback.detokenize(list(tokens), prev_tokens=prev_tokens, special=special)
        output = b"".join(self.token_to_piece(int(t), special) for t in tokens)
        if len(tokens) > 0 and tokens[0] == self._token_bos and output[0:1] == b" ":
            return output[1:]
        return output

    # ---- evaluation --------------------------------------------------------------

    def reset(self) -> None:
        """Forget the evaluated tokens (the KV cache is overwritten from position 0)."""
        if self._fallback is not None:
            self._fallback.reset()
            return
        self.n_tokens = 0
        self.input_ids = []

    def _decode(self, tokens: Sequence[int], pos: int, logits_all: bool) -> None:
        n = len(tokens)
        if pos + n > self._n_ctx:
            raise ValueError(
                f"Requested tokens ({pos + n}) exceed context window of {self._n_ctx}"
            )
        buf = ffi.new("powerinfer_token[]", [int(t) for t in tokens])
        rc = lib.powerinfer_decode(self._ctx, buf, n, pos, logits_all)
        if rc != lib.POWERINFER_OK:
            raise _core_error(f"powerinfer_decode of {n} tokens at position {pos} failed", rc)

    def _logits_row(self, i: int) -> np.ndarray:
        ptr = lib.powerinfer_get_logits_ith(self._ctx, i)
        if ptr == ffi.NULL:
            raise _core_error(f"no logits for output row {i}")
        return np.frombuffer(ffi.buffer(ptr, self._n_vocab * 4), dtype=np.float32).copy()

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate `tokens` after the ones already in the KV cache (llama_cpp.Llama.eval)."""
        if self._fallback is not None:
            self._fallback.eval(tokens)
            return
        self._require_ctx()
        tokens = list(tokens)
        for start in range(0, len(tokens), self.n_batch):
            batch = tokens[start : start + self.n_batch]
            pos = self.n_tokens
            self._decode(batch, pos, self._logits_all)
            if self._logits_all:
                for r in range(len(batch)):
                    self.scores[pos + r, :] = self._logits_row(r)
            self.input_ids[pos:] = batch
            self.n_tokens = pos + len(batch)

    def eval_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits of every token of `tokens` evaluated from position 0: float32 [n_tokens, n_vocab].

        Row i scores the token that follows tokens[i]; this is the perplexity path.
        """
        tokens = [int(t) for t in tokens]
        if self._fallback is not None:
            if not self._fallback._logits_all:
                raise RuntimeError(
                    f"eval_logits on the {ENGINE_LLAMA_CPP} fallback needs Llama(..., logits_all=True)"
                )
            self._fallback.reset()
            self._fallback.eval(tokens)
            return np.array(self._fallback.scores[: len(tokens), :], dtype=np.float32)
        self._require_ctx()
        if len(tokens) > self._n_ctx:
            raise ValueError(
                f"Requested tokens ({len(tokens)}) exceed context window of {self._n_ctx}"
            )
        out = np.empty((len(tokens), self._n_vocab), dtype=np.float32)
        self.reset()
        for start in range(0, len(tokens), self.n_batch):
            batch = tokens[start : start + self.n_batch]
            self._decode(batch, start, True)
            n_out = int(lib.powerinfer_n_outputs(self._ctx))
            if n_out != len(batch):
                raise PowerInferError(
                    f"powerinfer_decode(logits_all=True) of {len(batch)} tokens returned {n_out} logits rows"
                )
            for r in range(n_out):
                out[start + r] = self._logits_row(r)
            self.input_ids[start:] = batch
            self.n_tokens = start + len(batch)
        return out

    # ---- generation ----------------------------------------------------------------

    def _new_sampler(
        self,
        *,
        temp: float,
        top_k: int,
        top_p: float,
        min_p: float,
        typical_p: float,
        repeat_penalty: float,
        frequency_penalty: float,
        presence_penalty: float,
    ):
        params = lib.powerinfer_sampler_default_params()
        params.seed = self._seed & 0xFFFFFFFF
        params.temp = temp
        params.top_k = top_k
        params.top_p = top_p
        params.min_p = min_p
        params.typical_p = typical_p
        params.penalty_last_n = self.last_n_tokens_size
        params.penalty_repeat = repeat_penalty
        params.penalty_freq = frequency_penalty
        params.penalty_present = presence_penalty
        smpl = lib.powerinfer_sampler_new(self._model, params)
        if smpl == ffi.NULL:
            raise _core_error("powerinfer_sampler_new failed")
        return ffi.gc(smpl, lib.powerinfer_sampler_free)

    def generate(
        self,
        tokens: Sequence[int],
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        reset: bool = True,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        **kwargs: Any,
    ) -> Generator[int, Optional[Sequence[int]], None]:
        """Yield tokens sampled after the prompt `tokens`, without end (as llama_cpp.Llama.generate).

        The longest common prefix with the tokens already in the KV cache is kept
        (powerinfer_kv_truncate); at least the last prompt token is decoded again so
        the first sample uses fresh logits. temp <= 0 samples greedily.
        """
        if self._fallback is not None:
            yield from self._fallback.generate(
                tokens,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                typical_p=typical_p,
                temp=temp,
                repeat_penalty=repeat_penalty,
                reset=reset,
                frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty,
                **kwargs,
            )
            return
        self._require_ctx()
        sampler = self._new_sampler(
            temp=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
        )
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("generate needs at least one prompt token")

        if reset:
            prefix = 0
            for a, b in zip(self.input_ids[: self.n_tokens], tokens):
                if a != b:
                    break
                prefix += 1
            keep = min(prefix, len(tokens) - 1)
            if keep > 0:
                rc = lib.powerinfer_kv_truncate(self._ctx, keep)
                if rc != lib.POWERINFER_OK:
                    raise _core_error(f"powerinfer_kv_truncate({keep}) failed", rc)
                if self.verbose:
                    print(
                        f"Llama.generate: {keep} prefix-match hit, "
                        f"remaining {len(tokens) - keep} prompt tokens to eval",
                        file=sys.stderr,
                    )
            self.n_tokens = keep
            del self.input_ids[keep:]
            tokens = tokens[keep:]

        while True:
            self.eval(tokens)
            token = int(lib.powerinfer_sampler_sample(sampler, self._ctx, -1))
            if token < 0:
                raise _core_error("powerinfer_sampler_sample failed")
            more = yield token
            tokens = [token]
            if more is not None:
                tokens.extend(more)

    def create_completion(
        self,
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
        model: Optional[str] = None,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        """Generate a completion of `prompt` (non-streaming), in llama-cpp-python's response shape.

        Raises:
            ValueError: The prompt does not fit in the context window.
        """
        if self._fallback is not None:
            return self._fallback.create_completion(
                prompt,
                suffix=suffix,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                min_p=min_p,
                typical_p=typical_p,
                logprobs=logprobs,
                echo=echo,
                stop=stop,
                frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty,
                repeat_penalty=repeat_penalty,
                top_k=top_k,
                stream=stream,
                seed=seed,
                model=model,
                **kwargs,
            )
        if stream:
            raise NotImplementedError("stream=True is not supported by the powerinfer engine yet")
        if suffix is not None:
            raise NotImplementedError("suffix (infill) is not supported by the powerinfer engine yet")
        if logprobs is not None and not self._logits_all:
            raise ValueError("logprobs is not supported for models created with logits_all=False")
        if logprobs is not None:
            raise NotImplementedError("logprobs are not supported by the powerinfer engine yet")
        self._require_ctx()

        completion_id = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        bos = self._token_bos

        if isinstance(prompt, str):
            add_bos = bool(lib.powerinfer_vocab_add_bos(self._model)) and bos != -1
            prompt_tokens = ([bos] if add_bos else []) + (
                self.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) if prompt else []
            )
        else:
            prompt_tokens = [int(t) for t in prompt]
        # An empty prompt starts from BOS, which llama-cpp-python counts as generated.
        completion_tokens: List[int] = [] if len(prompt) > 0 else [bos]
        if not prompt_tokens:
            if bos == -1:
                raise ValueError("the prompt is empty and the vocabulary has no BOS token")
            prompt_tokens = [bos]

        stop_list = stop if isinstance(stop, list) else [stop] if isinstance(stop, str) else []
        stop_sequences = [s.encode("utf-8") for s in stop_list]
        model_name = model if model is not None else self.model_path

        if len(prompt_tokens) >= self._n_ctx:
            raise ValueError(
                f"Requested tokens ({len(prompt_tokens)}) exceed context window of {self._n_ctx}"
            )
        if max_tokens is None or max_tokens <= 0:
            max_tokens = self._n_ctx - len(prompt_tokens)
        max_tokens = min(max_tokens, self._n_ctx - len(prompt_tokens))

        # llama-cpp-python derives each call's seed from the previous one.
        if seed is not None:
            self._seed = seed
        else:
            self._seed = random.Random(self._seed).randint(0, 2**32)

        if self.verbose:
            lib.powerinfer_reset_timings(self._ctx)

        text = b""
        finish_reason = "length"
        multibyte_fix = 0
        for token in self.generate(
            prompt_tokens,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            temp=temperature,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
        ):
            if self.token_is_eog(token):
                text = self.detokenize(completion_tokens, prev_tokens=prompt_tokens)
                finish_reason = "stop"
                break

            completion_tokens.append(token)
            all_text = self.detokenize(completion_tokens, prev_tokens=prompt_tokens)

            # Hold back an incomplete utf-8 sequence at the end (llama-cpp-python's rule).
            for k, char in enumerate(all_text[-3:]):
                k = 3 - k
                for num, pattern in [(2, 192), (3, 224), (4, 240)]:
                    if num > k and pattern & char == pattern:
                        multibyte_fix = num - k
            if multibyte_fix > 0:
                multibyte_fix -= 1
                continue

            any_stop = [s for s in stop_sequences if s in all_text]
            if any_stop:
                text = all_text[: all_text.index(any_stop[0])]
                finish_reason = "stop"
                break

            if len(completion_tokens) >= max_tokens:
                text = all_text
                finish_reason = "length"
                break

        if self.verbose:
            self.print_timings()

        text_str = text.decode("utf-8", errors="ignore")
        if echo:
            text_str = prompt + text_str if isinstance(prompt, str) else text_str

        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "text": text_str,
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_tokens),
                "completion_tokens": len(completion_tokens),
                "total_tokens": len(prompt_tokens) + len(completion_tokens),
            },
        }

    def __call__(self, prompt: Union[str, List[int]], *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Same as create_completion."""
        return self.create_completion(prompt, *args, **kwargs)

    # ---- timings ---------------------------------------------------------------------

    def timings(self) -> Dict[str, float]:
        """The core's counters since the last reset, by struct powerinfer_timings field name
        (prompt: decodes of more than one token; eval: decodes of one token)."""
        t = lib.powerinfer_get_timings(self._require_ctx())
        return {name: getattr(t, name) for name, _ in ffi.typeof(t).fields}

    def print_timings(self) -> None:
        t = self.timings()

        def line(label: str, ms_key: str, n_key: str, unit: str) -> str:
            ms, n = t.get(ms_key, 0.0), t.get(n_key, 0)
            rate = f" ({1e3 * n / ms:8.2f} tokens per second)" if ms > 0 and n > 0 else ""
            return f"powerinfer_py: {label} = {ms:10.2f} ms / {n:5d} {unit}{rate}"

        lines = [f"powerinfer_py: load time   = {t.get('t_load_ms', 0.0):10.2f} ms"]
        lines.append(line("prompt eval", "t_prompt_ms", "n_prompt", "tokens"))
        lines.append(line("eval time  ", "t_eval_ms", "n_eval", "runs  "))
        if "t_sample_ms" in t:
            lines.append(line("sample time", "t_sample_ms", "n_sample", "runs  "))
        print("\n".join(lines), file=sys.stderr)
