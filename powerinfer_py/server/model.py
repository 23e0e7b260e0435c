"""Loading the server's model(s) from ModelSettings, and picking one per request.

Like llama_cpp.server's LlamaProxy: one model is loaded at a time; a request naming
another configured alias swaps it in (the caller holds the model lock while it does).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterator, List, Optional, Union

from .settings import ModelSettings

# Settings that are not Llama constructor arguments, or that need translating first.
_NOT_LLAMA_KWARGS = {
    "model",
    "model_alias",
    "kv_overrides",
    "chat_template_kwargs",
    "clip_model_path",
    "cache",
    "cache_type",
    "cache_size",
    "hf_tokenizer_config_path",
    "hf_pretrained_model_name_or_path",
    "hf_model_repo_id",
    "draft_model",
    "draft_model_num_pred_tokens",
    "model_draft",
    # PowerInfer-Py's own: passed only when set, so Llama's defaults apply otherwise.
    "vram_budget",
    "sparse_threshold",
}

# chat_format values that need a CLIP/mmproj model (multi-modal); not supported here.
_MULTIMODAL_CHAT_FORMATS = {
    "llava-1-5",
    "llava-1-6",
    "obsidian",
    "mtmd",
    "gemma4",
    "moondream",
    "nanollava",
    "llama-3-vision-alpha",
    "minicpm-v-2.6",
    "qwen2.5-vl",
}


def _parse_kv_overrides(items: List[str]) -> Dict[str, Union[bool, int, float, str]]:
    """key=type:value strings (llama_cpp.server's format) -> {key: value}."""
    out: Dict[str, Union[bool, int, float, str]] = {}
    for kv in items:
        key, sep, value = kv.partition("=")
        if not sep or ":" not in value:
            raise ValueError(f"kv override {kv!r} is not of the form key=type:value")
        value_type, _, raw = value.partition(":")
        if value_type == "bool":
            out[key] = raw.lower() in ("true", "1")
        elif value_type == "int":
            out[key] = int(raw)
        elif value_type == "float":
            out[key] = float(raw)
        elif value_type == "str":
            out[key] = raw
        else:
            raise ValueError(f"Unknown value type {value_type}")
    return out


def load_llama_from_model_settings(settings: ModelSettings, **overrides: Any):
    """A powerinfer_py.Llama configured as llama_cpp.server would configure llama_cpp.Llama
    (`overrides`: Llama keyword arguments the server itself sets, e.g. repack=False).

    Raises:
        ValueError: The settings ask for something this server cannot do (a Hugging Face
            download, a multi-modal chat handler), or the model does not load.
    """
    from .. import Llama

    if settings.hf_model_repo_id is not None:
        raise ValueError(
            "--hf_model_repo_id is not supported by powerinfer_py.server: download the GGUF "
            "and pass its path with --model"
        )
    if settings.chat_format in _MULTIMODAL_CHAT_FORMATS or settings.clip_model_path is not None:
        raise ValueError(
            f"multi-modal chat formats (--chat_format {settings.chat_format}, --clip_model_path) "
            "are not supported by powerinfer_py.server"
        )
    if settings.chat_format in ("hf-autotokenizer", "hf-tokenizer-config") or (
        settings.hf_pretrained_model_name_or_path is not None
    ):
        raise ValueError(
            "Hugging Face tokenizers (--chat_format hf-*, --hf_pretrained_model_name_or_path) "
            "are not supported by powerinfer_py.server; the GGUF's tokenizer and chat template are used"
        )

    kwargs: Dict[str, Any] = {
        name: value
        for name, value in settings.model_dump().items()
        if name not in _NOT_LLAMA_KWARGS
    }
    if settings.kv_overrides is not None:
        kwargs["kv_overrides"] = _parse_kv_overrides(settings.kv_overrides)
    if settings.vram_budget is not None:
        kwargs["vram_budget"] = settings.vram_budget
    if settings.sparse_threshold is not None:
        kwargs["sparse_threshold"] = settings.sparse_threshold
    if settings.draft_model is not None:
        from .._llama import upstream

        kwargs["draft_model"] = upstream.llama_speculative().LlamaPromptLookupDecoding(
            num_pred_tokens=settings.draft_model_num_pred_tokens)
    if settings.model_draft is not None:
        kwargs["draft_model_path"] = settings.model_draft

    llama = Llama(model_path=settings.model, **{**kwargs, **overrides})

    if settings.chat_template_kwargs:
        _bind_chat_template_kwargs(llama, settings.chat_template_kwargs)
    if settings.cache:
        _set_cache(llama, settings)
    return llama


def _bind_chat_template_kwargs(llama, template_kwargs: Dict[str, Any]) -> None:
    """Forward extra keyword arguments to every chat-template call, as llama_cpp.server does."""
    base = getattr(llama, "chat_handler", None)
    if base is None:
        handlers = getattr(llama, "_chat_handlers", {}) or {}
        base = handlers.get(getattr(llama, "chat_format", None))
    if base is None:
        try:
            from ..llama_chat_format import get_chat_completion_handler  # type: ignore
        except ImportError as e:
            raise ValueError(f"--chat_template_kwargs needs a chat handler: {e}") from None
        base = get_chat_completion_handler(llama.chat_format)

    def chat_handler_with_kwargs(*args: Any, **kwargs: Any):
        return base(*args, **{**template_kwargs, **kwargs})

    llama.chat_handler = chat_handler_with_kwargs


def _set_cache(llama, settings: ModelSettings) -> None:
    import powerinfer_py

    name = "LlamaDiskCache" if settings.cache_type == "disk" else "LlamaRAMCache"
    cache_cls = getattr(powerinfer_py, name, None)
    if cache_cls is None:
        raise ValueError(f"--cache_type {settings.cache_type}: powerinfer_py has no {name}")
    if settings.verbose:
        print(f"Using {settings.cache_type} cache with size {settings.cache_size}", file=sys.stderr)
    llama.set_cache(cache_cls(capacity_bytes=settings.cache_size))


class ModelProxy:
    """The configured models by alias; the current one is loaded, others on demand.

    Not thread-safe: the app calls it only while holding its model lock.
    """

    def __init__(self, models: List[ModelSettings], llama: Any = None, overrides: Optional[Dict[str, Any]] = None) -> None:
        if not models:
            raise ValueError("No models provided!")
        self._settings: Dict[str, ModelSettings] = {}
        for model in models:
            if not model.model_alias:
                model.model_alias = model.model
            self._settings[model.model_alias] = model
        self.default_alias: str = models[0].model_alias  # type: ignore[assignment]
        self._current_alias: Optional[str] = self.default_alias
        self._overrides = dict(overrides or {})
        self._current = llama if llama is not None else load_llama_from_model_settings(models[0], **self._overrides)

    def resolve(self, model: Optional[str]) -> str:
        """The alias a request's `model` field selects; unknown names get the default model."""
        return model if model in self._settings else self.default_alias

    def __call__(self, model: Optional[str] = None):
        alias = self.resolve(model)
        if self._current is not None and getattr(self._current, "failed", False):
            # An RPC worker of the model stopped answering: load it again (the worker may be back).
            print(f"powerinfer_py.server: the model {self._current_alias} lost an RPC worker; loading it again",
                  file=sys.stderr)
            self._current.close()
            self._current, self._current_alias = None, None
        if alias == self._current_alias and self._current is not None:
            return self._current
        if self._current is not None:
            self._current.close()
        self._current = None
        self._current = load_llama_from_model_settings(self._settings[alias], **self._overrides)
        self._current_alias = alias
        return self._current

    @property
    def current(self):
        """The loaded model (None while a swap failed)."""
        return self._current

    @property
    def current_path(self) -> Optional[str]:
        """The file of the loaded model (None while a swap failed)."""
        return self._settings[self._current_alias].model if self._current_alias is not None else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._settings)

    def free(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None
            self._current_alias = None
