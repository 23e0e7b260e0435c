"""`Llama`: the class users drive, with llama-cpp-python 0.3.36's interface and semantics.

It runs on libpowerinfer. For a model whose architecture (or a feature) the core does
not implement, it falls back to llama-cpp-python's own engine behind the same methods,
so every model llama.cpp runs still runs here. Completion, chat and embedding live in
_completion.py, _chat.py and _embedding.py; the sampler chain in _sampler.py.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import math
import os
import sys
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, Generator, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import PowerInferError, _upstream
from ._bindings import STATUS_NAMES, ffi, last_error, last_status, lib, string, version
from ._sampler import Sampler

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama import LlamaState, LogitsProcessorList, StoppingCriteriaList
    from llama_cpp.llama_grammar import LlamaGrammar

# llama.cpp's enum values, written out so that importing this module does not load llama_cpp.
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_SPLIT_MODE_LAYER = 1
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_POOLING_TYPE_MEAN = 1
LLAMA_POOLING_TYPE_CLS = 2
LLAMA_POOLING_TYPE_LAST = 3
LLAMA_POOLING_TYPE_RANK = 4
LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1

ENGINE_POWERINFER = "powerinfer"
ENGINE_LLAMA_CPP = "llama-cpp-python"

# Which neurons the FFN computes. Only the dense path exists in the core today.
SPARSE_MODES = ("auto", "dense", "gate", "predictor")
_SPARSE_MODE_IDS = {"auto": 0, "dense": 1, "gate": 2, "predictor": 3}  # enum powerinfer_sparse_mode

# Names scripts import from llama_cpp.llama, served from llama-cpp-python (pure Python).
_UPSTREAM_NAMES = (
    "LlamaState",
    "LogitsProcessor",
    "LogitsProcessorList",
    "StoppingCriteria",
    "StoppingCriteriaList",
    "MinTokensLogitsProcessor",
    "LlamaGrammar",
    "BaseLlamaCache",
    "LlamaCache",
    "LlamaRAMCache",
    "LlamaDiskCache",
)


def __getattr__(name: str):
    if name in _UPSTREAM_NAMES:
        return getattr(_upstream.llama_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _delegates(method):
    """On the fallback engine, the method of the same name of the wrapped llama_cpp.Llama runs."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return getattr(fallback, name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return wrapper


class _CoreTokenizer:
    """llama_cpp.llama_tokenizer.LlamaTokenizer's interface over the core's vocabulary."""

    def __init__(self, llama: "Llama"):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> List[int]:
        return self._llama._tokenize(text, add_bos, special)

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None, special: bool = False) -> bytes:
        return self._llama._detokenize(tokens, special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> List[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: List[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


class Llama:
    """High-level wrapper of a libpowerinfer model and context, mirroring llama_cpp.Llama."""

    def __init__(
        self,
        model_path: str,
        *,
        # Model params
        n_gpu_layers: int = 0,
        split_mode: int = LLAMA_SPLIT_MODE_LAYER,
        main_gpu: int = 0,
        tensor_split: Optional[List[float]] = None,
        vocab_only: bool = False,
        use_mmap: bool = True,
        use_mlock: bool = False,
        kv_overrides: Optional[Dict[str, Union[bool, int, float, str]]] = None,
        # Context params
        seed: int = LLAMA_DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: Optional[int] = None,
        n_threads_batch: Optional[int] = None,
        rope_scaling_type: Optional[int] = LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
        pooling_type: int = LLAMA_POOLING_TYPE_UNSPECIFIED,
        attention_type: int = LLAMA_ATTENTION_TYPE_UNSPECIFIED,
        rope_freq_base: float = 0.0,
        rope_freq_scale: float = 0.0,
        yarn_ext_factor: float = -1.0,
        yarn_attn_factor: float = 1.0,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
        yarn_orig_ctx: int = 0,
        logits_all: bool = False,
        embedding: bool = False,
        offload_kqv: bool = True,
        flash_attn: bool = False,
        op_offload: Optional[bool] = None,
        swa_full: Optional[bool] = None,
        # Sampling params
        no_perf: bool = False,
        last_n_tokens_size: int = 64,
        # LoRA params
        lora_base: Optional[str] = None,
        lora_scale: float = 1.0,
        lora_path: Optional[str] = None,
        # Backend params
        numa: Union[bool, int] = False,
        # Chat format params
        chat_format: Optional[str] = None,
        chat_handler: Optional[Any] = None,
        # Speculative decoding
        draft_model: Optional[Any] = None,
        # Tokenizer override
        tokenizer: Optional[Any] = None,
        # KV cache quantization
        type_k: Optional[int] = None,
        type_v: Optional[int] = None,
        # Misc
        spm_infill: bool = False,
        verbose: bool = True,
        # PowerInfer-Py
        vram_budget: Optional[float] = None,
        sparse_mode: str = "auto",
        sparse_threshold: Optional[float] = None,
        fallback: bool = True,
        activation_dir: Optional[str] = None,
        reset_gpu_index: bool = False,
        emulate_device: bool = False,
        **kwargs: Any,  # accepted and ignored, as upstream does (LangChain passes n_parts, f16_kv, ...)
    ):
        """Load a model. The parameters are llama_cpp.Llama's (see its documentation),
        plus PowerInfer-Py's own:

        Args:
            vram_budget: Device memory budget for hybrid placement, in GiB; None: automatic.
            sparse_mode: Which FFN neurons are computed: "auto" (the best the model and
                build allow), "dense" (all), "gate" (those whose gate fires), "predictor"
                (those a trained predictor selects). "gate" and "predictor" need a file that
                has what they read (ffn_down_t; predictors), see docs/formats.md.
            sparse_threshold: Activation threshold of the sparse modes (gate: on |act(gate)|;
                predictor: on the predictor's logit); None: the file's (or 0).
            activation_dir: PowerInfer's `activation/` folder (activation_{i}.pt per-neuron
                counts, read without running pickle code) for the hybrid placement; None:
                `<model folder>/activation` when it exists, else the model's own counts.
            reset_gpu_index: Ignore `<model>.generated.gpuidx` and solve the placement again.
            emulate_device: Hybrid placement with the device emulated by a CPU buffer under
                `vram_budget` (tests, machines without a GPU); see docs/hybrid.md.
            fallback: Run what the core does not implement (an architecture, LoRA, KV
                overrides, RoPE overrides, a quantized KV cache) on llama-cpp-python's engine.

        llama-cpp-python parameters that change nothing here (GPU split, NUMA, n_ubatch,
        YaRN details, ...) and unknown keyword arguments are accepted and ignored.
        `draft_model` is ignored: speculative decoding does not change the output.

        Raises:
            ValueError: The path does not exist, a parameter is out of range, or the model
                cannot be loaded (a PowerInferError carrying the core's message).
        """
        init_params = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        init_params.update(kwargs)
        # Set first so close() and __getattr__ work on a half-built object.
        self._model = None
        self._ctx = None
        self._fallback = None
        self._init_params = init_params

        self.model_path = model_path
        self.verbose = verbose
        self.engine = ENGINE_POWERINFER
        if sparse_mode not in SPARSE_MODES:
            raise ValueError(f"sparse_mode must be one of {', '.join(map(repr, SPARSE_MODES))}, not {sparse_mode!r}")
        if sparse_threshold is not None and not math.isfinite(float(sparse_threshold)):
            raise ValueError(f"sparse_threshold must be a finite number, not {sparse_threshold!r}")
        if vram_budget is not None and not (float(vram_budget) >= 0.0):
            raise ValueError(f"vram_budget must be >= 0 GiB (or None for automatic), not {vram_budget!r}")
        if not isinstance(n_ctx, int) or n_ctx < 0:
            raise ValueError(f"n_ctx must be an int >= 0, not {n_ctx!r}")
        if not isinstance(n_batch, int) or n_batch < 1:
            raise ValueError(f"n_batch must be an int >= 1, not {n_batch!r}")
        self.sparse_mode = sparse_mode
        self.sparse_threshold = sparse_threshold
        self.vram_budget = vram_budget

        if not os.path.exists(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")

        n_threads = n_threads or max(multiprocessing.cpu_count() // 2, 1)
        n_threads_batch = n_threads_batch or multiprocessing.cpu_count()
        upstream_params = {
            k: v
            for k, v in init_params.items()
            if k not in ("model_path", "vram_budget", "sparse_mode", "sparse_threshold", "fallback",
                         "activation_dir", "reset_gpu_index", "emulate_device")
        }
        upstream_params.update(n_threads=n_threads, n_threads_batch=n_threads_batch)

        # Features whose effect on the output the core cannot reproduce.
        missing = [
            what
            for what, wanted in (
                ("LoRA adapters", lora_path is not None),
                ("kv_overrides", bool(kv_overrides)),
                ("RoPE overrides", bool(rope_freq_base) or bool(rope_freq_scale)
                 or rope_scaling_type not in (None, LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)),
                ("a quantized KV cache (type_k/type_v)", type_k is not None or type_v is not None),
                ("rank pooling", embedding and pooling_type == LLAMA_POOLING_TYPE_RANK),
            )
            if wanted
        ]
        if missing:
            reason = f"the powerinfer engine does not implement {', '.join(missing)}"
            if not fallback:
                raise ValueError(f"{reason} (pass fallback=True to run on {ENGINE_LLAMA_CPP})")
            self._load_fallback(reason, upstream_params)
            return

        lib.powerinfer_log_set_level(lib.POWERINFER_LOG_INFO if verbose else lib.POWERINFER_LOG_NONE)
        self.model_params = lib.powerinfer_model_default_params()
        self.model_params.n_threads = n_threads
        self.model_params.vram_budget_gib = -1.0 if vram_budget is None else float(vram_budget)
        self.model_params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers
        self.model_params.use_mmap = use_mmap
        self.model_params.vocab_only = vocab_only
        self.model_params.sparse_mode = _SPARSE_MODE_IDS[sparse_mode]
        self.model_params.sparse_threshold = float("nan") if sparse_threshold is None else float(sparse_threshold)
        if vram_budget is not None and vram_budget > 0:
            self.model_params.vram_budget_bytes = int(float(vram_budget) * 2**30)  # exact, not a C float
        self.model_params.emulate_device = bool(emulate_device)
        self.model_params.reset_gpu_index = bool(reset_gpu_index)

        model = lib.powerinfer_model_load(os.fsencode(model_path), self.model_params)
        if model == ffi.NULL:
            message = last_error() or "no message from the core"
            status = last_status()
            if fallback and status == lib.POWERINFER_ERR_UNSUPPORTED:
                self._load_fallback(message, upstream_params)
                return
            raise PowerInferError(f"Failed to load model from file: {model_path}: {message}", status)
        self._model = model
        if not vocab_only:
            self._set_activation_counts(activation_dir)

        self.n_batch = min(n_ctx, n_batch) if n_ctx > 0 else n_batch
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self._seed = seed or LLAMA_DEFAULT_SEED
        self._logits_all = logits_all
        self.last_n_tokens_size = last_n_tokens_size
        self.spm_infill = spm_infill
        self.lora_base, self.lora_scale, self.lora_path = lora_base, lora_scale, lora_path
        self.tensor_split = tensor_split
        self.kv_overrides = kv_overrides
        self.numa = numa
        self.draft_model = draft_model  # not used: speculative decoding does not change the output
        self.cache = None
        self._sampler: Optional[Sampler] = None

        self._pieces: Dict[tuple, bytes] = {}  # (token, special) -> text: the vocabulary never changes
        self._n_vocab = int(lib.powerinfer_model_n_vocab(self._model))
        self._token_eos = int(lib.powerinfer_token_eos(self._model))
        self._token_bos = int(lib.powerinfer_token_bos(self._model))
        try:
            self.metadata: Dict[str, str] = self._read_metadata()
        except Exception as e:  # as upstream: a metadata problem does not stop the model
            self.metadata = {}
            if verbose:
                print(f"Failed to load metadata: {e}", file=sys.stderr)
        arch = string(lib.powerinfer_model_arch(self._model))
        if pooling_type == LLAMA_POOLING_TYPE_UNSPECIFIED:
            pooling_type = int(self.metadata.get(f"{arch}.pooling_type", LLAMA_POOLING_TYPE_NONE))
        self._pooling_type = pooling_type
        self.tokenizer_ = tokenizer or _CoreTokenizer(self)
        self._token_nl = self.token_nl()

        self.n_tokens = 0
        self._requires_eval = True
        self._n_ctx = 0
        self.context_params = None
        if not vocab_only:
            self._new_context(n_ctx, seed, flash_attn, embedding)
        # Tokens held in the KV cache (input_ids[:n_tokens]) and, with logits_all, the
        # logits after each of them (scores[:n_tokens]), as upstream.
        self.input_ids: np.ndarray = np.zeros((self._n_ctx,), dtype=np.intc)
        self.scores: np.ndarray = np.zeros(
            (self._n_ctx if logits_all else self.n_batch, self._n_vocab), dtype=np.single
        )

        from . import _chat

        _chat.setup(self, chat_format, chat_handler)

        if verbose:
            where = "vocabulary only" if vocab_only else f"n_ctx {self._n_ctx}, threads {self.n_threads}/{self.n_threads_batch}"
            print(
                f"powerinfer_py: engine {ENGINE_POWERINFER} (libpowerinfer {version()}): "
                f"arch {arch}, ffn activation {self.ffn_activation()}, sparse mode {self.sparse_mode_in_use()}, "
                f"{lib.powerinfer_model_n_params(self._model) / 1e6:.1f}M params, "
                f"{lib.powerinfer_model_size(self._model) / 2**20:.1f} MiB of weights, {where}",
                file=sys.stderr,
            )
            if draft_model is not None:
                print("powerinfer_py: draft_model is ignored (no speculative decoding yet)", file=sys.stderr)

    def _set_activation_counts(self, activation_dir: Optional[str]) -> None:
        """Hands PowerInfer's activation_{i}.pt counts to the core's placement."""
        folder = activation_dir
        if folder is None:
            folder = os.path.join(os.path.dirname(os.path.abspath(self.model_path)), "activation")
            if not os.path.isdir(folder):
                return
        from . import pt_io

        n_layer = int(lib.powerinfer_model_n_layer(self._model))
        n_ff = int(lib.powerinfer_model_n_ff(self._model))
        try:
            counts = pt_io.read_activation_dir(folder, n_layer=n_layer)
        except (OSError, ValueError) as e:
            self.close()
            raise ValueError(f"cannot use the activation counts in {folder}: {e}") from e
        bad = [i for i, c in enumerate(counts) if c.shape != (n_ff,)]
        if bad:
            self.close()
            raise ValueError(f"{folder}: activation_{bad[0]}.pt has shape {counts[bad[0]].shape}, the model has n_ff = {n_ff}")
        flat = np.ascontiguousarray(np.stack(counts).astype(np.float32))
        rc = lib.powerinfer_model_set_act_counts(self._model, ffi.cast("float *", flat.ctypes.data), n_layer, n_ff)
        if rc != 0:
            err = _core_error(f"{folder}: activation counts rejected")
            self.close()
            raise err

    def placement(self) -> Dict[str, Any]:
        """What the hybrid placement put on the device: sizes in bytes (never above
        `budget`), the device name, the FFN neurons placed."""
        ctx = self._require_ctx()
        p = ffi.new("struct powerinfer_placement *")
        lib.powerinfer_get_placement(ctx, p)
        out: Dict[str, Any] = {"device": ffi.string(p.device).decode()}
        for k in ("active", "emulated", "from_cache"):
            out[k] = bool(getattr(p, k))
        for k in ("budget", "bytes_total", "bytes_dense", "bytes_kv", "bytes_compute", "bytes_ffn",
                  "n_layers_attn", "n_hot", "n_neurons"):
            out[k] = int(getattr(p, k))
        return out

    def hot_neurons(self, layer: int) -> np.ndarray:
        """Ids of the FFN neurons of `layer` placed on the device (ascending)."""
        ctx = self._require_ctx()
        n = lib.powerinfer_layer_hot_neurons(ctx, layer, ffi.NULL, 0)
        if n < 0:
            raise _core_error("hot_neurons")
        ids = np.zeros(max(n, 1), dtype=np.int32)
        lib.powerinfer_layer_hot_neurons(ctx, layer, ffi.cast("int32_t *", ids.ctypes.data), n)
        return ids[:n]

    def _new_context(self, n_ctx: int, seed: int, flash_attn: bool, embedding: bool) -> None:
        params = lib.powerinfer_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = self.n_batch
        params.seed = (seed or LLAMA_DEFAULT_SEED) & 0xFFFFFFFF
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads_batch
        params.flash_attn = flash_attn
        params.embeddings = embedding
        ctx = lib.powerinfer_context_new(self._model, params)
        if ctx == ffi.NULL:
            err = _core_error(f"Failed to create a context for {self.model_path}")
            self.close()
            raise err
        self._ctx = ctx
        self.context_params = params
        self.n_batch = int(lib.powerinfer_n_batch(ctx))
        self._n_ctx = int(lib.powerinfer_n_ctx(ctx))

    def _load_fallback(self, core_message: str, params: Dict[str, Any]) -> None:
        try:
            upstream_llama = _upstream.llama_module().Llama
        except ImportError:
            raise PowerInferError(
                f"Failed to load model from file: {self.model_path}: {core_message} "
                "(install llama-cpp-python==0.3.36 to run it on the dense fallback engine)",
                lib.POWERINFER_ERR_UNSUPPORTED,
            ) from None
        if self.verbose:
            print(f"powerinfer_py: {core_message}; falling back to engine {ENGINE_LLAMA_CPP}", file=sys.stderr)
        try:
            fallback = upstream_llama(model_path=self.model_path, **params)
        except Exception as e:
            raise PowerInferError(
                f"Failed to load model from file: {self.model_path}: {core_message}; "
                f"the {ENGINE_LLAMA_CPP} fallback failed too: {e}",
                lib.POWERINFER_ERR_UNSUPPORTED,
            ) from e
        self._fallback = fallback
        self.engine = ENGINE_LLAMA_CPP
        if self.verbose:
            print(f"powerinfer_py: engine {ENGINE_LLAMA_CPP} (dense)", file=sys.stderr)

    def __getattr__(self, name: str):
        # Only reached for attributes this object lacks: on the fallback engine, every
        # llama_cpp.Llama attribute (input_ids, n_tokens, chat_format, ...) is the wrapped one's.
        fallback = self.__dict__.get("_fallback")
        if fallback is not None and not (name.startswith("__") and name.endswith("__")):
            return getattr(fallback, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model now (idempotent)."""
        if self.__dict__.get("_fallback") is not None:
            self._fallback.close()
            self._fallback = None
        self._sampler = None
        if self.__dict__.get("_ctx") is not None:
            lib.powerinfer_context_free(self._ctx)
            self._ctx = None
        if self.__dict__.get("_model") is not None:
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

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self._init_params)
        state["seed"] = self.__dict__.get("_seed", state.get("seed"))
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)

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

    @property
    def ctx(self):
        """The core's context (cffi pointer); the wrapped llama_context on the fallback engine."""
        fallback = self.__dict__.get("_fallback")
        return fallback.ctx if fallback is not None else self._ctx

    @property
    def model(self):
        """The core's model (cffi pointer); the wrapped llama_model on the fallback engine."""
        fallback = self.__dict__.get("_fallback")
        return fallback.model if fallback is not None else self._model

    @property
    def _input_ids(self) -> np.ndarray:
        fallback = self.__dict__.get("_fallback")
        return fallback._input_ids if fallback is not None else self.input_ids[: self.n_tokens]

    @property
    def _scores(self) -> np.ndarray:
        fallback = self.__dict__.get("_fallback")
        return fallback._scores if fallback is not None else self.scores[: self.n_tokens, :]

    @property
    def eval_tokens(self) -> Deque[int]:
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return fallback.eval_tokens
        return deque(self.input_ids[: self.n_tokens].tolist(), maxlen=self._n_ctx)

    @property
    def eval_logits(self) -> Deque[List[float]]:
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return fallback.eval_logits
        return deque(self.scores[: self.n_tokens, :].tolist(), maxlen=self._n_ctx if self._logits_all else 1)

    # ---- model and vocabulary --------------------------------------------------

    @_delegates
    def n_ctx(self) -> int:
        """The context window size."""
        self._require_model()
        return self._n_ctx

    @_delegates
    def n_embd(self) -> int:
        """The embedding size."""
        return int(lib.powerinfer_model_n_embd(self._require_model()))

    @_delegates
    def n_vocab(self) -> int:
        """The vocabulary size."""
        self._require_model()
        return self._n_vocab

    @_delegates
    def tokenizer(self):
        """The tokenizer (LlamaTokenizer's interface)."""
        self._require_model()
        return self.tokenizer_

    @_delegates
    def token_bos(self) -> int:
        """The beginning-of-sequence token, -1 if the vocabulary has none."""
        return int(lib.powerinfer_token_bos(self._require_model()))

    @_delegates
    def token_eos(self) -> int:
        """The end-of-sequence token, -1 if the vocabulary has none."""
        return int(lib.powerinfer_token_eos(self._require_model()))

    @_delegates
    def token_nl(self) -> int:
        """The newline token (the last token of "\\n", which is the byte token for SPM vocabularies)."""
        tokens = self._tokenize(b"\n", False, False)
        return tokens[-1] if tokens else -1

    @_delegates
    def pooling_type(self) -> int:
        """The pooling of embed() (LLAMA_POOLING_TYPE_*): the constructor's, else the model's
        `<arch>.pooling_type`, else NONE (one embedding per token), as llama.cpp."""
        return self._pooling_type

    def token_is_eog(self, token: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ...)."""
        if self._fallback is not None:
            return bool(_upstream.module().llama_vocab_is_eog(self._fallback._model.vocab, token))
        return bool(lib.powerinfer_token_is_eog(self._require_model(), token))

    def arch(self) -> str:
        """The model's architecture (general.architecture)."""
        if self._fallback is not None:
            return self._fallback.metadata.get("general.architecture", "")
        return string(lib.powerinfer_model_arch(self._require_model()))

    def sparse_mode_in_use(self) -> str:
        """The sparse mode the core runs ("dense", "gate" or "predictor"; "auto" resolved)."""
        if self._model is None:
            return "dense"
        return string(lib.powerinfer_sparse_mode_name(lib.powerinfer_model_sparse_mode(self._model)))

    def ffn_activation(self) -> str:
        """The FFN activation the core uses ("silu", "relu", "gelu"); "" on the fallback engine."""
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

    def _meta_token(self, *keys: str) -> int:
        for key in keys:
            value = self.metadata.get(key)
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    pass
        return -1

    def _add_bos_token(self) -> bool:
        return bool(lib.powerinfer_vocab_add_bos(self._require_model()))

    def _add_eos_token(self) -> bool:
        # Not in the C API yet: read the GGUF key libllama reads (false for llama/qwen2 vocabularies).
        return self.metadata.get("tokenizer.ggml.add_eos_token", "false") == "true"

    def _token_sep(self) -> int:
        return self._meta_token("tokenizer.ggml.seperator_token_id")

    def _token_cls(self) -> int:
        # libllama's llama_vocab_cls is the BOS token.
        return self._token_bos

    def _token_text(self, token: int) -> str:
        return self.token_to_piece(token, special=True).decode("utf-8", errors="replace") if token != -1 else ""

    def _fim_tokens(self) -> tuple:
        """(prefix, suffix, middle) fill-in-the-middle tokens, -1 where the vocabulary has none.

        The C API does not expose them yet: read the GGUF keys, then look up the texts
        libllama recognizes (as llama-vocab.cpp does)."""
        cached = self.__dict__.get("_fim_cache")
        if cached is not None:
            return cached
        found = []
        for key, old_key, texts in (
            ("fim_pre", "prefix", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>")),
            ("fim_suf", "suffix", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>")),
            ("fim_mid", "middle", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>")),
        ):
            token = self._meta_token(f"tokenizer.ggml.{key}_token_id", f"tokenizer.ggml.{old_key}_token_id")
            if token == -1:
                for text in texts:
                    ids = self._tokenize(text.encode("utf-8"), False, True)
                    if len(ids) == 1 and self._token_text(ids[0]) == text:
                        token = ids[0]
                        break
            found.append(token)
        self._fim_cache = tuple(found) if -1 not in found else (-1, -1, -1)
        return self._fim_cache

    @_delegates
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        """Tokenize utf-8 `text`.

        Args:
            add_bos: Add the vocabulary's special prefix (BOS) when it asks for one.
            special: Parse special tokens (e.g. "<|im_start|>") in the text.

        Raises:
            RuntimeError: The tokenization failed.
        """
        return self.tokenizer_.tokenize(text, add_bos, special)

    def _tokenize(self, text: bytes, add_bos: bool, special: bool) -> List[int]:
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
        """The text of one token."""
        if self._fallback is not None:
            return self._fallback._model.detokenize([int(token)], special=special)
        key = (int(token), bool(special))
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._token_to_piece(*key)
        return piece

    def _token_to_piece(self, token: int, special: bool) -> bytes:
        model = self._require_model()
        size = 64
        while True:
            buf = ffi.new("char[]", size)
            n = lib.powerinfer_token_to_piece(model, int(token), buf, size, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:]
            if -n <= size:  # a negative count that is not a size request
                raise RuntimeError(f"Failed to convert token {token} to text: {last_error()}")
            size = -n

    @_delegates
    def detokenize(
        self,
        tokens: List[int],
        prev_tokens: Optional[List[int]] = None,
        special: bool = False,
    ) -> bytes:
        """Concatenated pieces of `tokens` (llama-cpp-python's LlamaTokenizer rule: a leading
        space after an initial BOS is dropped; prev_tokens is unused, as upstream)."""
        return self.tokenizer_.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def _detokenize(self, tokens: Sequence[int], special: bool) -> bytes:
        output = b"".join(self.token_to_piece(int(t), special) for t in tokens)
        if len(tokens) > 0 and tokens[0] == self._token_bos and output[0:1] == b" ":
            return output[1:]
        return output

    # ---- evaluation --------------------------------------------------------------

    @_delegates
    def set_cache(self, cache) -> None:
        """Use `cache` (a llama_cpp LlamaRAMCache/LlamaDiskCache, keyed by token prefix) to
        restore the state of the longest cached prompt prefix in create_completion."""
        self.cache = cache

    @_delegates
    def set_seed(self, seed: int) -> None:
        """The seed of the next sampler (create_completion derives a new one per call unless given)."""
        self._seed = seed

    @_delegates
    def reset(self) -> None:
        """Forget the evaluated tokens (the KV cache is overwritten from position 0)."""
        self.n_tokens = 0
        self._requires_eval = True

    def _decode(self, tokens: Sequence[int], pos: int, logits_all: bool) -> None:
        n = len(tokens)
        if pos + n > self._n_ctx:
            raise ValueError(f"Requested tokens ({pos + n}) exceed context window of {self._n_ctx}")
        buf = ffi.new("powerinfer_token[]", [int(t) for t in tokens])
        rc = lib.powerinfer_decode(self._ctx, buf, n, pos, logits_all)
        if rc != lib.POWERINFER_OK:
            raise _core_error(f"powerinfer_decode of {n} tokens at position {pos} failed", rc)

    def _logits_view(self, row: int = -1, n_rows: int = 1) -> np.ndarray:
        """n_rows rows of logits of the last decode from `row` on, as a view that is valid
        until the next decode: float32 [n_rows, n_vocab] (or [n_vocab] for one row)."""
        ptr = lib.powerinfer_get_logits_ith(self._ctx, row)
        if ptr == ffi.NULL:
            raise _core_error(f"no logits for output row {row}")
        view = np.frombuffer(ffi.buffer(ptr, n_rows * self._n_vocab * 4), dtype=np.float32)
        return view if n_rows == 1 else view.reshape(n_rows, self._n_vocab)

    def _last_logits_view(self) -> np.ndarray:
        """The logits after the last evaluated token (zeros before any decode)."""
        if self._ctx is None or int(lib.powerinfer_n_outputs(self._ctx)) <= 0:
            return np.zeros((self._n_vocab,), dtype=np.float32)
        return self._logits_view(-1)

    @_delegates
    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate `tokens` after the first n_tokens tokens of the KV cache."""
        self._eval(tokens, self._logits_all)

    def _eval(self, tokens: Sequence[int], all_rows: bool) -> None:
        self._require_ctx()
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        n_past, n = self.n_tokens, len(tokens)
        self._decode(tokens, n_past, all_rows or self._logits_all)
        self.input_ids[n_past : n_past + n] = tokens
        if self._logits_all:
            self.scores[n_past : n_past + n, :] = self._logits_view(0, n)
        self.n_tokens = n_past + n
        self._requires_eval = False

    def compute_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits of every token of `tokens` evaluated from position 0: float32 [n_tokens, n_vocab].

        Row i scores the token that follows tokens[i]; this is the perplexity path. It
        works without logits_all (the rows come from one decode).
        """
        tokens = [int(t) for t in tokens]
        if self._fallback is not None:
            if not self._fallback._logits_all:
                raise RuntimeError(f"compute_logits on the {ENGINE_LLAMA_CPP} fallback needs Llama(..., logits_all=True)")
            self._fallback.reset()
            self._fallback.eval(tokens)
            return np.array(self._fallback.scores[: len(tokens), :], dtype=np.float32)
        self._require_ctx()
        if len(tokens) > self._n_ctx:
            raise ValueError(f"Requested tokens ({len(tokens)}) exceed context window of {self._n_ctx}")
        self.reset()
        self._eval(tokens, all_rows=True)
        n_out = int(lib.powerinfer_n_outputs(self._ctx))
        if n_out != len(tokens):
            raise PowerInferError(f"powerinfer_decode(logits_all=True) of {len(tokens)} tokens returned {n_out} rows")
        return self._logits_view(0, n_out).copy()

    # ---- sampling and generation -----------------------------------------------------

    def _init_sampler(
        self,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_eta: float = 0.1,
        mirostat_tau: float = 5.0,
        penalize_nl: bool = True,
        logits_processor: Optional["LogitsProcessorList"] = None,
        grammar: Optional["LlamaGrammar"] = None,
    ) -> Sampler:
        return Sampler(
            self._require_model(),
            self._n_vocab,
            seed=self._seed,
            temp=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            penalty_last_n=self.last_n_tokens_size,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            grammar=grammar,
            logits_processor=logits_processor,
        )

    @_delegates
    def sample(
        self,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_eta: float = 0.1,
        mirostat_tau: float = 5.0,
        penalize_nl: bool = True,
        logits_processor: Optional["LogitsProcessorList"] = None,
        grammar: Optional["LlamaGrammar"] = None,
        idx: Optional[int] = None,
    ) -> int:
        """Sample a token from the logits after position `idx` (default: the last evaluated
        token), with the sampler of the running generate() if any, else a new one."""
        if self.n_tokens <= 0:
            raise RuntimeError("sample() needs evaluated tokens (call eval first)")
        sampler = self._sampler
        if sampler is None:
            sampler = self._init_sampler(
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                typical_p=typical_p,
                temp=temp,
                repeat_penalty=repeat_penalty,
                frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty,
                mirostat_mode=mirostat_mode,
                mirostat_tau=mirostat_tau,
                mirostat_eta=mirostat_eta,
                logits_processor=logits_processor,
                grammar=grammar,
            )
        row = idx - self.n_tokens if idx is not None else -1
        return sampler.sample(self._require_ctx(), row, self._input_ids)

    @_delegates
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
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        penalize_nl: bool = True,
        logits_processor: Optional["LogitsProcessorList"] = None,
        stopping_criteria: Optional["StoppingCriteriaList"] = None,
        grammar: Optional["LlamaGrammar"] = None,
    ) -> Generator[int, Optional[Sequence[int]], None]:
        """Yield tokens sampled after the prompt `tokens`, without end (as llama_cpp.Llama.generate).

        With reset (the default), the longest common prefix with the tokens already in
        the KV cache is kept; the rest of the prompt is evaluated. Tokens sent into the
        generator are evaluated after the sampled one and checked against what the model
        would sample, as upstream does for draft tokens. The sampler is built here, so a
        bad sampling parameter raises ValueError at the call, not at the first token.
        """
        self._require_ctx()
        tokens = [int(t) for t in tokens]
        if not tokens and self.n_tokens == 0:
            raise ValueError("generate needs at least one prompt token")
        sampler = self._init_sampler(
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            temp=temp,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            logits_processor=logits_processor,
            grammar=grammar,
        )
        self._sampler = sampler
        return self._generate(tokens, sampler, reset, stopping_criteria)

    def _generate(self, tokens: List[int], sampler: Sampler, reset: bool, stopping_criteria) -> Iterator[int]:
        if reset and self.n_tokens > 0:
            longest_prefix = self.longest_token_prefix(self._input_ids.tolist(), tokens)
            prompt_consumed = longest_prefix == len(tokens)
            if self.n_tokens == len(tokens) and prompt_consumed and not self._requires_eval:
                # The logits of the last decode are those after the whole prompt.
                reset, tokens, reuse_prefix = False, [], 0
                if self.verbose:
                    print("Llama.generate: full prompt already cached, skipping reset", file=sys.stderr)
            else:
                # At least one prompt token is decoded again, to refresh the logits.
                reuse_prefix = longest_prefix - 1 if prompt_consumed else longest_prefix
            if reuse_prefix > 0:
                rc = lib.powerinfer_kv_truncate(self._ctx, reuse_prefix)
                if rc != lib.POWERINFER_OK:
                    raise _core_error(f"powerinfer_kv_truncate({reuse_prefix}) failed", rc)
                reset = False
                tokens = tokens[reuse_prefix:]
                self.n_tokens = reuse_prefix
                self._requires_eval = True
                if self.verbose:
                    print(
                        f"Llama.generate: {reuse_prefix} prefix-match hit, "
                        f"remaining {len(tokens)} prompt tokens to eval",
                        file=sys.stderr,
                    )
        if reset:
            self.reset()

        sample_idx = self.n_tokens + len(tokens) - 1
        verify = False  # tokens were sent in: every row of the next decode is sampled
        try:
            while True:
                self._eval(tokens, all_rows=verify)
                while sample_idx < self.n_tokens:
                    row = sample_idx - self.n_tokens
                    token = sampler.sample(self._ctx, row, self._input_ids)
                    sample_idx += 1
                    if stopping_criteria is not None and stopping_criteria(
                        self._input_ids[:sample_idx], self._logits_view(row)
                    ):
                        return
                    tokens_or_none = yield token
                    tokens = [token]
                    verify = tokens_or_none is not None and len(tokens_or_none) > 0
                    if tokens_or_none is not None:
                        tokens.extend(int(t) for t in tokens_or_none)
                    if sample_idx < self.n_tokens and token != self.input_ids[sample_idx]:
                        self.n_tokens = sample_idx
                        self._requires_eval = True
                        break
        finally:
            if self._sampler is sampler:
                self._sampler = None

    # ---- state -------------------------------------------------------------------

    @_delegates
    def save_state(self) -> "LlamaState":
        """The evaluated tokens, their logits (with logits_all) and the core's context state
        (KV cache and last logits), as llama_cpp.llama.LlamaState."""
        from ._state import save_state

        return save_state(self)

    @_delegates
    def load_state(self, state: "LlamaState") -> None:
        """Restore a state from save_state() of a model on the same file, with no larger context."""
        from ._state import load_state

        load_state(self, state)

    # ---- completion, chat, embeddings ----------------------------------------------------

    @_delegates
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
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: Optional[str] = None,
        stopping_criteria: Optional["StoppingCriteriaList"] = None,
        logits_processor: Optional["LogitsProcessorList"] = None,
        grammar: Optional["LlamaGrammar"] = None,
        logit_bias: Optional[Dict[int, float]] = None,
    ):
        """Generate text from a prompt, as llama_cpp.Llama.create_completion (same
        arguments, response and stream chunks).

        Raises:
            ValueError: The requested tokens exceed the context window, or a sampling
                parameter is out of range.
            RuntimeError: The prompt fails to tokenize or the model fails to evaluate it.

        Returns:
            A Completion dict, or with stream=True an iterator of completion chunks.
        """
        from ._completion import create_completion_stream

        completion_or_chunks = create_completion_stream(
            self,
            prompt=prompt,
            suffix=suffix,
            max_tokens=-1 if max_tokens is None else max_tokens,
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
            tfs_z=tfs_z,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            model=model,
            stopping_criteria=stopping_criteria,
            logits_processor=logits_processor,
            grammar=grammar,
            logit_bias=logit_bias,
        )
        if stream:
            return completion_or_chunks
        return next(completion_or_chunks)

    def __call__(self, prompt: Union[str, List[int]], *args: Any, **kwargs: Any):
        """Same as create_completion (same parameters)."""
        return self.create_completion(prompt, *args, **kwargs)

    __call__.__signature__ = inspect.signature(create_completion)  # type: ignore[attr-defined]

    def create_chat_completion(
        self,
        messages: List[Dict[str, Any]],
        functions: Optional[List[Dict[str, Any]]] = None,
        function_call: Optional[Union[str, Dict[str, Any]]] = None,
        tools: Optional[List[Dict[str, Any]]] = None,
        tool_choice: Optional[Union[str, Dict[str, Any]]] = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        stream: bool = False,
        stop: Optional[Union[str, List[str]]] = [],
        seed: Optional[int] = None,
        response_format: Optional[Dict[str, Any]] = None,
        max_tokens: Optional[int] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: Optional[str] = None,
        logits_processor: Optional["LogitsProcessorList"] = None,
        grammar: Optional["LlamaGrammar"] = None,
        logit_bias: Optional[Dict[int, float]] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
    ):
        """Generate a chat completion from a list of messages, as
        llama_cpp.Llama.create_chat_completion: the chat handler (chat_handler, the GGUF's
        chat template through Jinja2, or the registered `chat_format`) formats the prompt.

        `response_format` may also be OpenAI's {"type": "json_schema", "json_schema":
        {"schema": ...}}, which upstream ignores: the schema is enforced with a grammar.

        Returns:
            A ChatCompletion dict, or with stream=True an iterator of ChatCompletionChunk dicts.
        """
        from ._chat import create_chat_completion

        args = dict(locals())
        del args["self"], args["create_chat_completion"]
        return create_chat_completion(self, **args)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any):
        """create_chat_completion with the `openai` package's return types."""
        return _upstream.llama_module().Llama.create_chat_completion_openai_v1(self, *args, **kwargs)

    @_delegates
    def create_embedding(self, input: Union[str, List[str]], model: Optional[str] = None):
        """Embed a string or a list of strings, in the OpenAI response shape (needs embedding=True)."""
        from ._embedding import create_embedding

        return create_embedding(self, input, model)

    @_delegates
    def embed(
        self,
        input: Union[str, List[str]],
        normalize: bool = False,
        truncate: bool = True,
        return_count: bool = False,
    ):
        """Embeddings of a string or a list of strings (needs embedding=True): with pooling
        NONE (decoder models) one vector per token, else one per input.

        Args:
            normalize: Scale each vector to unit L2 norm.
            truncate: Cut inputs to n_batch tokens (else a longer input raises ValueError).
            return_count: Also return the number of tokens embedded.
        """
        from ._embedding import embed

        return embed(self, input, normalize=normalize, truncate=truncate, return_count=return_count)

    # ---- timings and helpers -----------------------------------------------------------

    def timings(self) -> Dict[str, float]:
        """The core's counters since the last reset, by struct powerinfer_timings field name
        (prompt: decodes of more than one token; eval: decodes of one token)."""
        if self._fallback is not None:
            t = _upstream.module().llama_perf_context(self._fallback.ctx)
            return {
                "t_load_ms": t.t_load_ms,
                "t_prompt_ms": t.t_p_eval_ms,
                "n_prompt": t.n_p_eval,
                "t_eval_ms": t.t_eval_ms,
                "n_eval": t.n_eval,
            }
        t = lib.powerinfer_get_timings(self._require_ctx())
        return {name: getattr(t, name) for name, _ in ffi.typeof(t).fields}

    def reset_timings(self) -> None:
        if self._fallback is not None:
            _upstream.module().llama_perf_context_reset(self._fallback.ctx)
            return
        lib.powerinfer_reset_timings(self._require_ctx())

    def print_timings(self) -> None:
        t = self.timings()

        def line(label: str, ms_key: str, n_key: str, unit: str) -> str:
            ms, n = t.get(ms_key, 0.0), t.get(n_key, 0)
            rate = f" ({1e3 * n / ms:8.2f} tokens per second)" if ms > 0 and n > 0 else ""
            return f"powerinfer_py: {label} = {ms:10.2f} ms / {n:5d} {unit}{rate}"

        lines = [f"powerinfer_py: load time   = {t.get('t_load_ms', 0.0):10.2f} ms"]
        lines.append(line("prompt eval", "t_prompt_ms", "n_prompt", "tokens"))
        lines.append(line("eval time  ", "t_eval_ms", "n_eval", "runs  "))
        print("\n".join(lines), file=sys.stderr)

    @staticmethod
    def logits_to_logprobs(logits: Union[np.ndarray, List], axis: int = -1) -> np.ndarray:
        """log_softmax in float32, as upstream (infinite maxima are treated as 0)."""
        logits_maxs: np.ndarray = np.amax(logits, axis=axis, keepdims=True)
        if logits_maxs.ndim > 0:
            logits_maxs[~np.isfinite(logits_maxs)] = 0
        elif not np.isfinite(logits_maxs):
            logits_maxs = 0
        subtract_maxs = np.subtract(logits, logits_maxs, dtype=np.single)
        exp = np.exp(subtract_maxs)
        with np.errstate(divide="ignore"):
            summed = np.sum(exp, axis=axis, keepdims=True)
            out = np.log(summed)
        return subtract_maxs - out

    @staticmethod
    def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
        longest_prefix = 0
        for _a, _b in zip(a, b):
            if _a == _b:
                longest_prefix += 1
            else:
                break
        return longest_prefix

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: Optional[str], **kwargs: Any) -> "Llama":
        """Download a GGUF from the Hugging Face Hub (needs huggingface-hub) and load it,
        exactly as llama_cpp.Llama.from_pretrained (whose code runs, building this class)."""
        return _upstream.llama_module().Llama.from_pretrained.__func__(cls, repo_id, filename, **kwargs)
