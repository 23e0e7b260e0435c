"""`Llama`: the class users drive, with llama-cpp-python 0.3.36's interface and semantics.

It runs on libpowerinfer, through the handles of powerinfer_py._core (a Model and its
Context). For a model whose architecture (or a feature) the core does not implement, it
falls back to llama-cpp-python's own engine behind the same methods, so every model
llama.cpp runs still runs here. This module holds the constructor, the lifetime and
the public methods; their families live in powerinfer_py._llama (tokenizer, generation,
completion, chat, embedding, state, fallback).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import sys
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Generator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._core import Context, Model, PowerInferError
from ._core import accel as _accel
from ._core.bindings import kernel_level, set_log_level
from ._core.errors import ERR_UNSUPPORTED
from ._llama import aliases as _aliases
from ._llama import chat as _chat
from ._llama import completion as _completion
from ._llama import embedding as _embedding
from ._llama import fallback as _fallback_engine
from ._llama import generation as _generation
from ._llama import loading as _loading
from ._llama import overrides as _overrides
from ._llama import sequence as _sequence
from ._llama import speculative as _speculative
from ._llama import state as _state
from ._llama import tokenizer as _tokenizer
from ._llama import upstream as _upstream
from ._llama.constants import (  # noqa: F401  (also importable from powerinfer_py.llama, as before)
    ENGINE_LLAMA_CPP,
    ENGINE_POWERINFER,
    LLAMA_ATTENTION_TYPE_UNSPECIFIED,
    LLAMA_DEFAULT_SEED,
    LLAMA_POOLING_TYPE_CLS,
    LLAMA_POOLING_TYPE_LAST,
    LLAMA_POOLING_TYPE_MEAN,
    LLAMA_POOLING_TYPE_NONE,
    LLAMA_POOLING_TYPE_RANK,
    LLAMA_POOLING_TYPE_UNSPECIFIED,
    LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
    LLAMA_SPLIT_MODE_LAYER,
    SPARSE_MODES,
)

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama import LlamaState, LogitsProcessorList, StoppingCriteriaList
    from llama_cpp.llama_grammar import LlamaGrammar

_delegates = _fallback_engine.delegates


def __getattr__(name: str):
    # Names scripts import from llama_cpp.llama (LlamaState, LogitsProcessorList, ...).
    if name in _upstream.LLAMA_MODULE_NAMES:
        return getattr(_upstream.llama_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install_as_llama_cpp():
    """Make `import llama_cpp` (and `from llama_cpp import Llama`, `llama_cpp.llama.Llama`,
    `llama_cpp.llama_chat_format`, ...) resolve to PowerInfer-Py in this process.

    Call it before the script imports llama_cpp (modules that already hold the real
    `llama_cpp` keep it). Idempotent; returns the `llama_cpp` alias module.
    """
    return _aliases.install(Llama)


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
        rpc_servers: Optional[str] = None,
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
        flash_attn: Optional[bool] = None,
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
        vram_budget: Optional[Union[float, List[float]]] = None,
        sparse_mode: str = "auto",
        sparse_threshold: Optional[float] = None,
        fallback: bool = True,
        activation_dir: Optional[str] = None,
        reset_gpu_index: bool = False,
        emulate_device: bool = False,
        repack: Optional[bool] = None,
        pack_dense: Optional[bool] = None,
        batch_invariant: Optional[bool] = None,
        draft_model_path: Optional[str] = None,
        draft_max: Optional[int] = None,
        draft_min: Optional[int] = None,
        draft_p_min: Optional[float] = None,
        override_tensor: Optional[Union[str, Dict[str, str], List[Tuple[str, str]]]] = None,
        cpu_moe: bool = False,
        n_cpu_moe: int = 0,
        **kwargs: Any,  # accepted and ignored, as upstream does (LangChain passes n_parts, f16_kv, ...)
    ):
        """Load a model. The parameters are llama_cpp.Llama's (see its documentation),
        plus PowerInfer-Py's own:

        Args:
            vram_budget: Memory budget of each device (GPU, iGPU, RPC worker) for the placement,
                in GiB: one number for every device, or a list, one per device; None:
                automatic (what each reports free, less a margin); 0: nothing on a device.
            rpc_servers: "host:port,host:port": RPC workers (`powerinfer rpc-server`) whose
                devices the placement uses, as llama-cpp-python's rpc_servers
                (docs/distributed.md). split_mode: LLAMA_SPLIT_MODE_LAYER (the default) means
                "auto": llama.cpp's layer split for a dense model given n_gpu_layers (the last
                n_gpu_layers layers, -1 all, divided by tensor_split or the budgets), else
                PowerInfer's hybrid placement; "hybrid", "layer" and "none" (or
                LLAMA_SPLIT_MODE_NONE) choose.
            sparse_mode: Which FFN neurons are computed: "auto" (the best the model and
                build allow), "dense" (all), "gate" (those whose gate fires), "predictor"
                (those a trained predictor selects), "input" (every matrix reads only the
                columns of its input's entries with |x| above the file's thresholds; files
                made by `powerinfer sparsify`, docs/input-sparsity.md). "gate" and
                "predictor" need a file that has what they read (ffn_down_t; predictors),
                see docs/formats.md.
            sparse_threshold: Activation threshold of the sparse modes (gate: on |act(gate)|;
                predictor: on the predictor's logit; input: on |x|, for every input); None:
                the file's (or 0).
            activation_dir: PowerInfer's `activation/` folder (activation_{i}.pt per-neuron
                counts, read without running pickle code) for the hybrid placement; None:
                `<model folder>/activation` when it exists, else the model's own counts.
            reset_gpu_index: Ignore `<model>.generated.gpuidx` and solve the placement again.
            emulate_device: Hybrid placement with the device emulated by a CPU buffer under
                `vram_budget` (tests, machines without a GPU); see docs/hybrid.md.
            repack: Dense matmul weights in ggml's repacked CPU layouts (Q4_0, Q4_K, IQ4_NL on
                x86), as llama.cpp does (llama.cpp's --no-repack is repack=False). Their
                4-column kernels round a batch column differently from a lone one, so a
                ParallelLlama is bit-exact against solo runs only with repack=False (the
                server sets it with --n_parallel > 1); docs/parallel.md. None: not
                batch_invariant.
            pack_dense: Dense matmul weights of types Q4_0, Q4_1 and Q8_0 in PowerInfer's
                packed AVX-512 VNNI layout: each batch column computed alone (a ParallelLlama's
                streams equal their solo runs bit for bit) and a batch of several sequences'
                tokens for little more than one token; the server sets it with --n_parallel > 1.
                Its rounding is not ggml's: keep it off for logits equal to llama-cpp-python's.
                No effect on CPUs without AVX-512 VNNI; docs/parallel.md. None: batch_invariant.
            batch_invariant: Compute every token as it is computed alone, whatever else is in
                its batch: the packed kernels (pack_dense), no repacked weights, the slots'
                attention. On by default with a draft (draft_model or draft_model_path), so a
                speculative generation gives the tokens of one without drafts (on dense models
                bit for bit); off otherwise, for logits equal to llama-cpp-python's.
            draft_model: llama-cpp-python's LlamaDraftModel (LlamaPromptLookupDecoding, or any
                callable from the held token ids to proposed ones): speculative decoding,
                docs/speculative.md.
            draft_model_path: A smaller model on the same vocabulary that drafts tokens
                (llama.cpp's -md); a draft with another vocabulary raises ValueError.
            draft_max, draft_min, draft_p_min: llama.cpp's --draft-max (tokens drafted per
                step; default 16, for draft_model the count it proposes), --draft-min (fewer
                drafted tokens are not checked; default 0) and --draft-p-min (a draft model
                stops drafting below this probability of its best token; default 0.75).
            override_tensor: llama.cpp's --override-tensor: "PATTERN=BUFFER_TYPE,..." (or a dict,
                or (pattern, buffer type) pairs); a weight whose name the regular expression
                matches goes to that device's buffer type ("CPU", "Vulkan0", "CUDA0", ...).
                libllama places the weights, so the model runs on llama-cpp-python's engine
                (a sparsified file in input mode through the module, docs/accel.md).
            cpu_moe, n_cpu_moe: llama.cpp's --cpu-moe and --n-cpu-moe N: keep the expert
                weights of every layer, or of the first N layers, on the CPU (where the
                module runs a sparsified file's experts sparse) while n_gpu_layers puts the
                rest on a device.
            fallback: Run what the core does not implement (an architecture, LoRA, KV
                overrides, RoPE overrides, a quantized KV cache) on llama-cpp-python's engine.

        `flash_attn` defaults to None (auto): a fused attention op (the core's pi_attention
        on the CPU, ggml's flash attention on a device), except for dense mode on a standard
        GGUF, which keeps llama.cpp's plain attention graph and its exact results
        (True/False force it, as upstream).

        llama-cpp-python parameters that change nothing here (GPU split, NUMA, n_ubatch,
        YaRN details, ...) and unknown keyword arguments are accepted and ignored.

        Raises:
            ValueError: The path does not exist, a parameter is out of range, or the model
                cannot be loaded (a PowerInferError carrying the core's message).
        """
        init_params = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        init_params.update(kwargs)
        # The default seed is a random one, drawn once here: what this Llama samples unseeded
        # differs from start to start; an explicit seed repeats (the fallback engine gets it too).
        init_params["seed"] = _generation.resolve_seed(seed)
        # Set first so close() and __getattr__ work on a half-built object.
        self._model: Optional[Model] = None
        self._ctx: Optional[Context] = None
        self._fallback = None
        self._drafter: Optional[_speculative.Drafter] = None
        self._init_params = init_params

        self.model_path = model_path
        self.verbose = verbose
        self.engine = ENGINE_POWERINFER
        _loading.check_arguments(sparse_mode=sparse_mode, sparse_threshold=sparse_threshold, vram_budget=vram_budget,
                                n_ctx=n_ctx, n_batch=n_batch, split_mode=split_mode, tensor_split=tensor_split,
                                rpc_servers=rpc_servers)
        draft_params = _loading.draft_params(draft_model, draft_model_path, draft_max, draft_min, draft_p_min)
        # ValueError now for a bad pattern, buffer type or count (llama.cpp's meanings)
        self._tensor_overrides = _overrides.parse(override_tensor, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe)
        if batch_invariant is None:
            batch_invariant = draft_params is not None
        self.batch_invariant = bool(batch_invariant)
        self.sparse_mode = sparse_mode
        self.sparse_threshold = sparse_threshold
        self.vram_budget = vram_budget

        if not os.path.exists(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")

        n_threads = n_threads or max(multiprocessing.cpu_count() // 2, 1)
        n_threads_batch = n_threads_batch or multiprocessing.cpu_count()
        upstream_params = _loading.upstream_params(init_params, n_threads, n_threads_batch)
        missing = _loading.unsupported_features(
            lora_path=lora_path, kv_overrides=kv_overrides, rope_freq_base=rope_freq_base,
            rope_freq_scale=rope_freq_scale, rope_scaling_type=rope_scaling_type, type_k=type_k, type_v=type_v,
            embedding=embedding, pooling_type=pooling_type, override_tensor=override_tensor,
        )  # fmt: skip
        if missing:
            reason = f"the powerinfer engine does not implement {', '.join(missing)}"
            if not fallback:
                raise ValueError(f"{reason} (pass fallback=True to run on {ENGINE_LLAMA_CPP})")
            self._load_fallback(reason, upstream_params)
            return
        if repack is None:
            repack = not self.batch_invariant
        if pack_dense is None:
            pack_dense = self.batch_invariant

        set_log_level(verbose)
        try:
            self._model = Model(model_path, **_loading.model_fields(
                n_threads=n_threads, vram_budget=vram_budget, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                vocab_only=vocab_only, sparse_mode=sparse_mode, sparse_threshold=sparse_threshold,
                emulate_device=emulate_device, reset_gpu_index=reset_gpu_index, repack=repack,
                pack_dense=pack_dense, split_mode=split_mode, tensor_split=tensor_split, rpc_servers=rpc_servers,
            ))  # fmt: skip
        except PowerInferError as e:
            if fallback and e.status == ERR_UNSUPPORTED:
                self._load_fallback(e.core_message, upstream_params)
                return
            raise
        self.model_params = self._model.params
        if not vocab_only:
            try:
                _loading.set_activation_counts(self._model, model_path, activation_dir)
            except ValueError:
                self.close()
                raise

        self._attach(self._model, n_threads, n_threads_batch, None)
        if not vocab_only and draft_params is not None:
            try:
                self._drafter = _loading.make_drafter(self, draft_model, draft_model_path, draft_params)
            except (ValueError, PowerInferError):
                self.close()
                raise
        if verbose:
            _loading.print_banner(self, self._model.arch(), vocab_only, self._drafter)

    @classmethod
    def _over_sequence(cls, base: "Llama", model: Model, backend: _sequence.SequenceBackend, owner: Any,
                       drafter: Optional[_speculative.Drafter]) -> "Llama":
        """A Llama on `base`'s model that generates in `backend`, another sequence of it (a
        ParallelLlama slot, `owner`, which owns the model handle and the context): built from
        base's constructor arguments by the code that built base, with its own sequence,
        sampler, seed, prompt cache and drafter; the vocabulary's and chat templates' objects
        are base's."""
        self = cls.__new__(cls)
        self._fallback = None
        self._drafter = None
        self._slot_of = owner
        self._init_params = base._init_params
        self.batch_invariant = True  # the pool's context (docs/parallel.md)
        self._attach(model, base.n_threads, base.n_threads_batch, backend, shared=base)
        self._drafter = drafter
        return self

    def _attach(self, model: Model, n_threads: int, n_threads_batch: int,
                backend: Optional[_sequence.SequenceBackend], shared: Optional["Llama"] = None) -> None:
        """Everything a Llama knows of its loaded model (vocabulary, metadata, chat handlers,
        settings from its constructor's arguments), and the sequence it generates in: a context
        of its own (backend None), or `backend`, another sequence of the same model (a
        ParallelLlama slot), whose pieces, metadata and chat handlers are those of `shared`."""
        p = self._init_params
        n_ctx, n_batch, seed = p["n_ctx"], p["n_batch"], p["seed"]
        self.model_path = p["model_path"]
        self.verbose = p["verbose"]
        self.engine = ENGINE_POWERINFER
        self.sparse_mode, self.sparse_threshold, self.vram_budget = p["sparse_mode"], p["sparse_threshold"], p["vram_budget"]
        self._model = model
        self.model_params = model.params
        self.n_batch = min(n_ctx, n_batch) if n_ctx > 0 else n_batch
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self._seed = seed
        self._logits_all = p["logits_all"]
        self.last_n_tokens_size = p["last_n_tokens_size"]
        self.spm_infill = p["spm_infill"]
        self.lora_base, self.lora_scale, self.lora_path = p["lora_base"], p["lora_scale"], p["lora_path"]
        self.tensor_split = p["tensor_split"]
        self.kv_overrides = p["kv_overrides"]
        self.numa = p["numa"]
        self.draft_model = p["draft_model"]
        self.cache = None

        # (token, special) -> text: the vocabulary never changes
        self._pieces: Dict[tuple, bytes] = shared._pieces if shared is not None else {}
        self._n_vocab = model.n_vocab()
        self._token_eos = model.token_eos()
        self._token_bos = model.token_bos()
        if shared is not None:
            self.metadata: Dict[str, str] = shared.metadata
        else:
            try:
                self.metadata = model.metadata()
            except Exception as e:  # as upstream: a metadata problem does not stop the model
                self.metadata = {}
                if self.verbose:
                    print(f"Failed to load metadata: {e}", file=sys.stderr)
        pooling_type = p["pooling_type"]
        if pooling_type == LLAMA_POOLING_TYPE_UNSPECIFIED:
            pooling_type = int(self.metadata.get(f"{model.arch()}.pooling_type", LLAMA_POOLING_TYPE_NONE))
        self._pooling_type = pooling_type
        self.tokenizer_ = p["tokenizer"] or _tokenizer.CoreTokenizer(self)
        self._token_nl = self.token_nl()

        self._n_ctx = 0
        self.context_params = None
        if backend is not None:
            self._ctx = backend  # type: ignore[assignment]
            self._n_ctx = backend.n_ctx()
            self.context_params = backend.params
        elif not p["vocab_only"]:
            self._new_context(n_ctx, seed, p["flash_attn"], p["embedding"])
        # The tokens held in the KV cache and, with logits_all, the logits after each (as
        # upstream's input_ids, n_tokens and scores, which are views of it).
        self._seq = _sequence.Sequence(self._ctx, self._n_ctx, self._n_vocab, keep_scores=self._logits_all,
                                       score_rows=self.n_batch)
        # The largest batch a draft's check may take: a sparse model's larger batches run the
        # dense FFN (docs/speculative.md).
        self._draft_batch_max = (self._ctx.sparse_max_batch() if self._ctx is not None and
                                 model.sparse_mode() not in ("dense",) else 1 << 30)
        if shared is not None:
            self.chat_format, self.chat_handler = shared.chat_format, shared.chat_handler
            self._chat_handlers = shared._chat_handlers
        else:
            _chat.setup(self, p["chat_format"], p["chat_handler"])

    @property
    def failed(self) -> bool:
        """True once an RPC worker holding part of the model stopped answering (every decode
        then raises PowerInferError naming it): close this Llama and load the model again."""
        model = self.__dict__.get("_model")
        return model is not None and not model.closed and model.failed()

    def placement(self) -> Dict[str, Any]:
        """What the hybrid placement put on the device: sizes in bytes (never above
        `budget`), the device name, the FFN neurons placed."""
        return self._require_ctx().placement()

    def hot_neurons(self, layer: int) -> np.ndarray:
        """Ids of the FFN neurons of `layer` placed on the device (ascending)."""
        return self._require_ctx().hot_neurons(layer)

    def sparse_stats(self) -> Dict[str, Any]:
        """How sparse the FFN has been since the last reset_timings() (or load): the sparse
        mode in use, per layer the share of neurons the sparse steps computed (None for a
        layer no sparse step ran through: dense mode, or only batches larger than the
        sparse path takes), that share over all layers ("active"), and the ISA level the
        kernels run at on this CPU ("kernels": "avx512", "avx2", "dotprod", ...; None on
        the fallback engine)."""
        if self._fallback is not None:
            tag = self.__dict__.get("_accel_tag")
            if tag is None:
                return {"mode": "dense", "layers": [], "active": None, "kernels": None, "counts": []}
            # the module inside libllama (docs/accel.md): per weight, not per layer
            st = _accel.sparse_stats(tag)
            return {"mode": "input", "layers": [], "active": st["active"], "weights": st["weights"],
                    "kernels": kernel_level(), "counts": []}
        ctx = self._require_ctx()
        counts = [ctx.sparse_stats(il) for il in range(self._model.n_layer())]
        total = sum(n for _, n in counts)
        return {
            "mode": self.sparse_mode_in_use(),
            "layers": [a / n if n else None for a, n in counts],
            "active": sum(a for a, _ in counts) / total if total else None,
            "kernels": kernel_level(),
            "counts": counts,  # per layer (active, considered): the shares' counts
        }

    def _new_context(self, n_ctx: int, seed: int, flash_attn: Optional[bool], embedding: bool) -> None:
        if self.batch_invariant:
            flash_attn = True  # the slots' attention, which is flash attention's place in the graph
        try:
            ctx = Context(
                self._model, n_ctx=n_ctx, n_batch=self.n_batch, seed=seed,
                n_threads=self.n_threads, n_threads_batch=self.n_threads_batch,
                flash_attn=-1 if flash_attn is None else int(bool(flash_attn)),
                embeddings=embedding, batch_invariant=self.batch_invariant,
            )  # fmt: skip
        except PowerInferError:
            self.close()
            raise
        self._ctx = ctx
        self.context_params = ctx.params
        self.n_batch = ctx.n_batch()
        self._n_ctx = ctx.n_ctx()

    def _load_fallback(self, core_message: str, params: Dict[str, Any]) -> None:
        if self._init_params.get("draft_model_path") is not None:
            raise ValueError(f"draft_model_path needs the powerinfer engine, and {core_message} "
                             f"(llama-cpp-python's engine takes draft_model=LlamaPromptLookupDecoding(...))")
        _fallback_engine.load(self, core_message, params, self._tensor_overrides)

    def __getattr__(self, name: str):
        # Only reached for attributes this object lacks: on the fallback engine, every
        # llama_cpp.Llama attribute (input_ids, n_tokens, chat_format, ...) is the wrapped one's.
        fallback = self.__dict__.get("_fallback")
        if fallback is not None and not (name.startswith("__") and name.endswith("__")):
            return getattr(fallback, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model now (idempotent); a ParallelLlama slot's belong to
        its pool, which frees them."""
        if self.__dict__.get("_fallback") is not None:
            self._fallback.close()
            self._fallback = None
        seq = self.__dict__.get("_seq")
        if seq is not None:
            seq.sampler = None
        if self.__dict__.get("_drafter") is not None:
            self._drafter.close()
            self._drafter = None
        if self.__dict__.get("_slot_of") is not None:
            return
        if self.__dict__.get("_ctx") is not None:
            self._ctx.close()
            self._ctx = None
        if self.__dict__.get("_model") is not None:
            self._model.close()
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

    def _require_model(self) -> Model:
        if self._model is None:
            raise RuntimeError("the model was closed")
        return self._model

    def _require_ctx(self) -> Context:
        if self._ctx is None:
            raise RuntimeError(
                "the model was closed" if self._model is None else "the model was loaded with vocab_only=True"
            )
        return self._ctx

    @property
    def ctx(self):
        """The core's context (cffi pointer); the wrapped llama_context on the fallback engine."""
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return fallback.ctx
        return self._ctx.ptr if self._ctx is not None else None

    @property
    def model(self):
        """The core's model (cffi pointer); the wrapped llama_model on the fallback engine."""
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return fallback.model
        return self._model.ptr if self._model is not None else None

    # Upstream's token bookkeeping (input_ids, n_tokens, scores), kept by the Llama's Sequence;
    # on the fallback engine, the wrapped Llama's.

    def _sequence_or_fallback(self, name: str) -> Optional[_sequence.Sequence]:
        seq = self.__dict__.get("_seq")
        if seq is None:
            self.__getattr__(name)  # the fallback's attribute, or AttributeError
        return seq

    @property
    def input_ids(self) -> np.ndarray:
        """Token ids of the KV cache's positions (input_ids[:n_tokens] are held)."""
        seq = self._sequence_or_fallback("input_ids")
        return self._fallback.input_ids if seq is None else seq.input_ids

    @property
    def n_tokens(self) -> int:
        seq = self._sequence_or_fallback("n_tokens")
        return self._fallback.n_tokens if seq is None else seq.n_tokens

    @n_tokens.setter
    def n_tokens(self, value: int) -> None:
        seq = self._sequence_or_fallback("n_tokens")
        if seq is None:
            self._fallback.n_tokens = value
        else:
            seq.n_tokens = int(value)

    @property
    def scores(self) -> np.ndarray:
        """With logits_all, the logits after each held token (scores[:n_tokens])."""
        seq = self._sequence_or_fallback("scores")
        return self._fallback.scores if seq is None else seq.scores

    @property
    def _input_ids(self) -> np.ndarray:
        fallback = self.__dict__.get("_fallback")
        return fallback._input_ids if fallback is not None else self._seq.tokens

    @property
    def _scores(self) -> np.ndarray:
        fallback = self.__dict__.get("_fallback")
        return fallback._scores if fallback is not None else self._seq.scores[: self._seq.n_tokens, :]

    @property
    def eval_tokens(self) -> Deque[int]:
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return fallback.eval_tokens
        return deque(self._seq.tokens.tolist(), maxlen=self._n_ctx)

    @property
    def eval_logits(self) -> Deque[List[float]]:
        fallback = self.__dict__.get("_fallback")
        if fallback is not None:
            return fallback.eval_logits
        return deque(self._scores.tolist(), maxlen=self._n_ctx if self._logits_all else 1)

    def _override_draft(self, draft_max: Optional[int] = None, draft_min: Optional[int] = None,
                        draft_p_min: Optional[float] = None) -> Callable[[], None]:
        """The drafting parameters with those given changed, for one request (the server's
        speculative.n_max/n_min/p_min); returns the function that restores them. ValueError
        for values that do not go together. Without a draft, nothing changes."""
        drafter = self.__dict__.get("_drafter")
        if drafter is None:
            return lambda: None
        old = drafter.params
        drafter.params = _speculative.DraftParams(
            n_max=old.n_max if draft_max is None else draft_max,
            n_min=old.n_min if draft_min is None else draft_min,
            p_min=old.p_min if draft_p_min is None else draft_p_min,
        )

        def restore() -> None:
            drafter.params = old

        return restore

    def speculative_stats(self) -> Dict[str, Any]:
        """Counters of speculative decoding since the model was loaded: verify steps (decodes of
        a sampled token with its drafts), tokens drafted and accepted, tokens those steps gave,
        the acceptance rate and tokens per verify step (None before any step). All zero
        without a draft."""
        drafter = self.__dict__.get("_drafter")
        return (drafter.stats if drafter is not None else _speculative.SpeculativeStats()).as_dict()

    # ---- model and vocabulary --------------------------------------------------

    @_delegates
    def n_ctx(self) -> int:
        """The context window size."""
        self._require_model()
        return self._n_ctx

    @_delegates
    def n_embd(self) -> int:
        """The embedding size."""
        return self._require_model().n_embd()

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
        return self._require_model().token_bos()

    @_delegates
    def token_eos(self) -> int:
        """The end-of-sequence token, -1 if the vocabulary has none."""
        return self._require_model().token_eos()

    @_delegates
    def token_nl(self) -> int:
        """The newline token (the last token of "\\n", which is the byte token for SPM vocabularies)."""
        return _tokenizer.token_nl(self)

    @_delegates
    def pooling_type(self) -> int:
        """The pooling of embed() (LLAMA_POOLING_TYPE_*): the constructor's, else the model's
        `<arch>.pooling_type`, else NONE (one embedding per token), as llama.cpp."""
        return self._pooling_type

    def token_is_eog(self, token: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ...)."""
        if self._fallback is not None:
            return _fallback_engine.token_is_eog(self._fallback, token)
        return self._require_model().token_is_eog(token)

    def arch(self) -> str:
        """The model's architecture (general.architecture)."""
        if self._fallback is not None:
            return self._fallback.metadata.get("general.architecture", "")
        return self._require_model().arch()

    def sparse_mode_in_use(self) -> str:
        """The sparse mode the core runs ("dense", "gate", "predictor" or "input"; "auto" resolved)."""
        if self._model is None:
            return "dense"
        return self._model.sparse_mode()

    def ffn_activation(self) -> str:
        """The FFN activation the core uses ("silu", "relu", "gelu"); "" on the fallback engine."""
        if self._fallback is not None:
            return ""
        return self._require_model().ffn_activation()

    def _fim_tokens(self) -> tuple:
        """(prefix, suffix, middle) fill-in-the-middle tokens, -1 where the vocabulary has none."""
        return _tokenizer.fim_tokens(self)

    def _token_text(self, token: int) -> str:
        """The text of a special token ("" for -1)."""
        return _tokenizer.token_text(self, token)

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

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The text of one token."""
        if self._fallback is not None:
            return self._fallback._model.detokenize([int(token)], special=special)
        return _tokenizer.token_to_piece(self, token, special)

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

    # ---- evaluation --------------------------------------------------------------

    @_delegates
    def set_cache(self, cache) -> None:
        """Use `cache` (a llama_cpp LlamaRAMCache/LlamaDiskCache, keyed by token prefix) to
        restore the state of the longest cached prompt prefix in create_completion."""
        self.cache = cache

    @_delegates
    def set_seed(self, seed: int) -> None:
        """The seed of the next sampler (create_completion derives a new one per call unless given);
        -1 or LLAMA_DEFAULT_SEED: a random one."""
        self._seed = _generation.resolve_seed(seed)

    @_delegates
    def reset(self) -> None:
        """Forget the evaluated tokens (the KV cache is overwritten from position 0)."""
        self._seq.reset()

    def _last_logits_view(self) -> np.ndarray:
        """The logits after the last evaluated token (zeros before any decode), as a view."""
        return self._seq.last_logits()

    @_delegates
    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate `tokens` after the first n_tokens tokens of the KV cache."""
        _generation.eval_tokens(self, tokens, self._logits_all)

    def compute_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits of every token of `tokens` evaluated from position 0: float32 [n_tokens, n_vocab].

        Row i scores the token that follows tokens[i]; this is the perplexity path. It
        works without logits_all (the rows come from one decode).
        """
        return _generation.compute_logits(self, tokens)

    # ---- sampling and generation -----------------------------------------------------

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
        return _generation.sample(self, idx, **_generation.sampler_args(locals()))

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
        return _generation.generate(self, tokens, reset, stopping_criteria, **_generation.sampler_args(locals()))

    def _generate_completion(self, tokens: List[int], n_predict: int, reads_rows: bool,
                             **kwargs: Any) -> Generator[int, Optional[Sequence[int]], None]:
        """generate() for create_completion: it takes at most n_predict tokens and reads the
        score rows only if reads_rows (logprobs), which lets a ParallelLlama slot sample it
        ahead in the core."""
        if type(self).generate is not Llama.generate or "generate" in self.__dict__:
            # A generate() of a subclass or of this object runs, as upstream's would.
            return self.generate(tokens, **kwargs)
        stopping_criteria = kwargs.pop("stopping_criteria", None)
        kwargs.pop("tfs_z", None)
        kwargs.pop("penalize_nl", None)
        return _generation.generate(self, tokens, kwargs.pop("reset", True), stopping_criteria, n_predict=n_predict,
                                    reads_rows=reads_rows, **kwargs)

    # ---- state -------------------------------------------------------------------

    @_delegates
    def save_state(self) -> "LlamaState":
        """The evaluated tokens, their logits (with logits_all) and the core's context state
        (KV cache and last logits), as llama_cpp.llama.LlamaState."""
        return _state.save_state(self)

    @_delegates
    def load_state(self, state: "LlamaState") -> None:
        """Restore a state from save_state() of a model on the same file, with no larger context."""
        _state.load_state(self, state)

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
        completion_or_chunks = _completion.create_completion_stream(
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
        args = dict(locals())
        del args["self"]
        return _chat.create_chat_completion(self, **args)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any):
        """create_chat_completion with the `openai` package's return types."""
        return _upstream.llama_module().Llama.create_chat_completion_openai_v1(self, *args, **kwargs)

    @_delegates
    def create_embedding(self, input: Union[str, List[str]], model: Optional[str] = None):
        """Embed a string or a list of strings, in the OpenAI response shape (needs embedding=True)."""
        return _embedding.create_embedding(self, input, model)

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
        return _embedding.embed(self, input, normalize=normalize, truncate=truncate, return_count=return_count)

    # ---- timings and helpers -----------------------------------------------------------

    def timings(self) -> Dict[str, float]:
        """The core's counters since the last reset, by struct powerinfer_timings field name
        (prompt: decodes of more than one token; eval: decodes of one token)."""
        if self._fallback is not None:
            return _fallback_engine.timings(self._fallback)
        return self._require_ctx().timings()

    def reset_timings(self) -> None:
        if self._fallback is not None:
            _fallback_engine.reset_timings(self._fallback)
            return
        self._require_ctx().reset_timings()

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
