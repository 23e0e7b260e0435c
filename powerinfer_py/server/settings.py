"""Settings of the OpenAI-compatible server: the fields (and so the command-line flags and
environment variables) of `llama_cpp.server` 0.3.36, plus PowerInfer-Py's own.

Fields that only make sense for llama.cpp features PowerInfer-Py does not have (LoRA,
multi-GPU split, RPC, KV overrides, ...) are still accepted, so launch scripts written
for `python -m llama_cpp.server` run unchanged; they are passed on to `Llama`, which
ignores what its engine does not use.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# llama_cpp.server's one --draft_model value (LlamaPromptLookupDecoding).
PROMPT_LOOKUP = "prompt-lookup-decoding"

# llama.cpp's values of these enums, written out so the settings do not import llama_cpp
# (which install_as_llama_cpp() may have pointed at this package).
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_SPLIT_MODE_LAYER = 1
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1


class ModelSettings(BaseSettings):
    """Model settings used to load a Llama model."""

    # "model" and "model_alias" are field names of llama_cpp.server; pydantic would warn.
    model_config = SettingsConfigDict(protected_namespaces=())

    model: str = Field(description="The path to the model to use for generating completions.")
    model_alias: Optional[str] = Field(
        default=None,
        description="The alias of the model to use for generating completions.",
    )
    # Model Params
    n_gpu_layers: int = Field(
        default=0,
        ge=-1,
        description="The number of layers to put on the GPU. The rest will be on the CPU. Set -1 to move all to GPU.",
    )
    split_mode: int = Field(default=LLAMA_SPLIT_MODE_LAYER, description="The split mode to use.")
    main_gpu: int = Field(default=0, ge=0, description="Main GPU to use.")
    tensor_split: Optional[List[float]] = Field(
        default=None, description="Split layers across multiple GPUs in proportion."
    )
    vocab_only: bool = Field(default=False, description="Whether to only return the vocabulary.")
    use_mmap: bool = Field(default=True, description="Use mmap.")
    use_mlock: bool = Field(default=True, description="Use mlock.")
    kv_overrides: Optional[List[str]] = Field(
        default=None,
        description="List of model kv overrides in the format key=type:value where type is one of (bool, int, float). Valid true values are (true, TRUE, 1), otherwise false.",
    )
    override_tensor: Optional[str] = Field(
        default=None,
        description="llama.cpp's --override-tensor (also -ot): PATTERN=BUFFER_TYPE,... puts the weights whose "
        "names the regular expression matches on that device's buffer type (CPU, Vulkan0, CUDA0, ...); the "
        "model then runs on libllama, a sparsified file through the module (docs/accel.md#placement)",
    )
    cpu_moe: bool = Field(
        default=False,
        description="llama.cpp's --cpu-moe (also -cmoe): keep every layer's expert weights on the CPU",
    )
    n_cpu_moe: int = Field(
        default=0,
        ge=0,
        description="llama.cpp's --n-cpu-moe (also -ncmoe): keep the expert weights of the first N layers on the CPU",
    )
    rpc_servers: Optional[str] = Field(
        default=None,
        description="comma separated list of RPC workers (host:port, `powerinfer rpc-server`) whose devices the "
        "placement uses (also --rpc, llama.cpp's spelling); see docs/distributed.md",
    )
    # Context Params
    seed: int = Field(default=LLAMA_DEFAULT_SEED, description="Random seed. -1 for random.")
    n_ctx: int = Field(default=2048, ge=0, description="The context size.")
    n_batch: int = Field(default=512, ge=1, description="The batch size to use per eval.")
    n_ubatch: int = Field(default=512, ge=1, description="The physical batch size used by llama.cpp")
    n_threads: int = Field(
        default=max(multiprocessing.cpu_count() // 2, 1),
        ge=1,
        description="The number of threads to use. Use -1 for max cpu threads",
    )
    n_threads_batch: int = Field(
        default=max(multiprocessing.cpu_count(), 1),
        ge=0,
        description="The number of threads to use when batch processing. Use -1 for max cpu threads",
    )
    rope_scaling_type: int = Field(default=LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)
    rope_freq_base: float = Field(default=0.0, description="RoPE base frequency")
    rope_freq_scale: float = Field(default=0.0, description="RoPE frequency scaling factor")
    yarn_ext_factor: float = Field(default=-1.0)
    yarn_attn_factor: float = Field(default=1.0)
    yarn_beta_fast: float = Field(default=32.0)
    yarn_beta_slow: float = Field(default=1.0)
    yarn_orig_ctx: int = Field(default=0)
    mul_mat_q: bool = Field(default=True, description="if true, use experimental mul_mat_q kernels")
    logits_all: bool = Field(default=True, description="Whether to return logits.")
    embedding: bool = Field(default=False, description="Whether to use embeddings.")
    # Not a llama_cpp.server setting (its Llama has the parameter): how /v1/embeddings
    # pools token vectors. Decoder models default to none, one vector per token; the
    # OpenAI API expects one per input, so set 1 (mean) or 3 (last) for OpenAI clients.
    pooling_type: int = Field(
        default=-1,
        ge=-1,
        le=4,
        description="Embedding pooling: -1 the model's, 0 none (per token), 1 mean, 2 cls, 3 last.",
    )
    offload_kqv: bool = Field(default=True, description="Whether to offload kqv to the GPU.")
    flash_attn: Optional[bool] = Field(
        default=None,
        description="Whether to use flash attention; unset: auto (on, except for dense mode on a standard GGUF).",
    )
    # Sampling Params
    last_n_tokens_size: int = Field(
        default=64, ge=0, description="Last n tokens to keep for repeat penalty calculation."
    )
    # LoRA Params
    lora_base: Optional[str] = Field(
        default=None,
        description="Optional path to base model, useful if using a quantized base model and you want to apply LoRA to an f16 model.",
    )
    lora_path: Optional[str] = Field(default=None, description="Path to a LoRA file to apply to the model.")
    # Backend Params
    numa: Union[bool, int] = Field(default=False, description="Enable NUMA support.")
    # Chat Format Params
    chat_format: Optional[str] = Field(default=None, description="Chat format to use.")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        default=None,
        description="Extra keyword arguments forwarded to chat templates at model load time. Matches llama.cpp server `chat_template_kwargs`.",
    )
    clip_model_path: Optional[str] = Field(
        default=None, description="Path to a CLIP model to use for multi-modal chat completion."
    )
    # Cache Params
    cache: bool = Field(
        default=False, description="Use a cache to reduce processing times for evaluated prompts."
    )
    cache_type: Literal["ram", "disk"] = Field(
        default="ram", description="The type of cache to use. Only used if cache is True."
    )
    cache_size: int = Field(
        default=2 << 30, description="The size of the cache in bytes. Only used if cache is True."
    )
    # Tokenizer Options
    hf_tokenizer_config_path: Optional[str] = Field(
        default=None, description="The path to a HuggingFace tokenizer_config.json file."
    )
    hf_pretrained_model_name_or_path: Optional[str] = Field(
        default=None,
        description="The model name or path to a pretrained HuggingFace tokenizer model. Same as you would pass to AutoTokenizer.from_pretrained().",
    )
    # Loading from HuggingFace Model Hub
    hf_model_repo_id: Optional[str] = Field(
        default=None, description="The model repo id to use for the HuggingFace tokenizer model."
    )
    # Speculative Decoding
    draft_model: Optional[str] = Field(
        default=None,
        description="Method to use for speculative decoding. One of (prompt-lookup-decoding).",
    )
    draft_model_num_pred_tokens: int = Field(
        default=10, ge=1, description="Number of tokens to predict using the draft model."
    )
    model_draft: Optional[str] = Field(
        default=None,
        description="A draft model (GGUF on the model's vocabulary) for speculative decoding, llama.cpp's "
        "--model-draft; each slot drafts with it under --n_parallel.",
    )
    draft_max: Optional[int] = Field(
        default=None, ge=1, description="Tokens drafted per step (llama.cpp's --draft-max; default 16)."
    )
    draft_min: Optional[int] = Field(
        default=None, ge=0, description="Fewer drafted tokens are not checked (llama.cpp's --draft-min; default 0)."
    )
    draft_p_min: Optional[float] = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="A draft model stops drafting below this probability of its best token (llama.cpp's "
        "--draft-p-min; default 0.75).",
    )
    # KV Cache Quantization
    type_k: Optional[int] = Field(default=None, description="Type of the key cache quantization.")
    type_v: Optional[int] = Field(default=None, description="Type of the value cache quantization.")
    # PowerInfer-Py
    vram_budget: Optional[float] = Field(
        default=None,
        ge=0.0,
        description="Device memory budget for hybrid hot/cold neuron placement, in GiB. Unset: automatic.",
    )
    sparse_mode: Literal["auto", "dense", "gate", "predictor"] = Field(
        default="auto",
        description="How FFN sparsity is exploited: auto, dense, gate or predictor.",
    )
    sparse_threshold: Optional[float] = Field(
        default=None,
        description="Activation threshold of the predictor above which a neuron counts as active. Unset: the model's.",
    )
    fallback: bool = Field(
        default=True,
        description="Run architectures the PowerInfer core does not implement on llama-cpp-python's engine.",
    )
    # Misc
    verbose: bool = Field(default=True, description="Whether to print debug information.")

    @field_validator("draft_model")
    @classmethod
    def known_draft_method(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value != PROMPT_LOOKUP:
            raise ValueError(f"--draft_model {value!r} is not a drafting method: the one there is is {PROMPT_LOOKUP!r} "
                             "(a draft GGUF goes in --model_draft)")
        return value

    @model_validator(mode="after")
    def draft_bounds_agree(self) -> "ModelSettings":
        if self.draft_min is not None and self.draft_max is not None and self.draft_min > self.draft_max:
            raise ValueError(f"--draft_min ({self.draft_min}) must not exceed --draft_max ({self.draft_max})")
        return self

    @model_validator(mode="before")
    @classmethod
    def set_dynamic_defaults(cls, values: Any) -> Any:
        # -1 threads means all cores, as in llama_cpp.server.
        if isinstance(values, dict):
            cpu_count = multiprocessing.cpu_count()
            for key in ("n_threads", "n_threads_batch"):
                if values.get(key) in (-1, "-1"):
                    values[key] = cpu_count
        return values


class ServerSettings(BaseSettings):
    """Server settings used to configure the FastAPI and Uvicorn server."""

    # Uvicorn Settings
    host: str = Field(default="localhost", description="Listen address")
    port: int = Field(default=8000, description="Listen port")
    ssl_keyfile: Optional[str] = Field(default=None, description="SSL key file for HTTPS")
    ssl_certfile: Optional[str] = Field(default=None, description="SSL certificate file for HTTPS")
    # FastAPI Settings
    api_key: Optional[str] = Field(
        default=None,
        description="API key for authentication. If set all requests need to be authenticated.",
    )
    # llama_cpp.server defaults this to True: a new request cuts the running stream
    # short. We default to False so concurrent streams all complete, in turn.
    interrupt_requests: bool = Field(
        default=False,
        description="Whether to interrupt requests when a new request is received.",
    )
    n_parallel: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Requests served at once, in slots that share one model and decode in one batch "
        "(llama.cpp's -np); each slot keeps the full n_ctx.",
    )
    slot_save_path: Optional[str] = Field(
        default=None,
        description="Folder for POST /slots/{id}?action=save|restore (llama-server's --slot-save-path); unset: "
        "slot save and restore are off.",
    )
    disable_ping_events: bool = Field(
        default=False,
        description="Disable EventSource pings (may be needed for some clients).",
    )
    root_path: str = Field(
        default="",
        description="The root path for the server. Useful when running behind a reverse proxy.",
    )


class Settings(ServerSettings, ModelSettings):
    model_config = SettingsConfigDict(protected_namespaces=())


class ConfigFileSettings(ServerSettings):
    """Configuration file format settings."""

    models: List[ModelSettings] = Field(default=[], description="Model configs")
