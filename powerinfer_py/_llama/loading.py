"""Llama's constructor pieces: argument checks, what needs the fallback engine, the
core's model parameters, PowerInfer's activation counts for the hybrid placement, and
the verbose banner."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional

import numpy as np

from .._core import Model
from .._core.bindings import version
from ..formats import pt_io
from .constants import (ENGINE_POWERINFER, LLAMA_POOLING_TYPE_RANK, LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
                        SPARSE_MODES)

# Llama's own parameters, which llama_cpp.Llama (the fallback engine) does not take.
OWN_PARAMS = ("model_path", "vram_budget", "sparse_mode", "sparse_threshold", "fallback", "activation_dir",
              "reset_gpu_index", "emulate_device", "pack_dense")


def check_arguments(*, sparse_mode: str, sparse_threshold: Optional[float], vram_budget: Optional[float],
                    n_ctx: int, n_batch: int) -> None:
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


def upstream_params(init_params: Dict[str, Any], n_threads: int, n_threads_batch: int) -> Dict[str, Any]:
    """The constructor's arguments as llama_cpp.Llama takes them."""
    params = {k: v for k, v in init_params.items() if k not in OWN_PARAMS}
    params.update(n_threads=n_threads, n_threads_batch=n_threads_batch)
    if params.get("flash_attn") is None:
        params["flash_attn"] = False  # our auto; upstream's default
    return params


def unsupported_features(*, lora_path, kv_overrides, rope_freq_base, rope_freq_scale, rope_scaling_type, type_k,
                         type_v, embedding, pooling_type) -> List[str]:
    """Features whose effect on the output the core cannot reproduce."""
    return [
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


def model_fields(*, n_threads: int, vram_budget: Optional[float], n_gpu_layers: int, use_mmap: bool,
                 vocab_only: bool, sparse_mode: str, sparse_threshold: Optional[float], emulate_device: bool,
                 reset_gpu_index: bool, repack: bool = True, pack_dense: bool = False) -> Dict[str, Any]:
    """struct powerinfer_model_params fields for Model()."""
    fields: Dict[str, Any] = dict(
        n_threads=n_threads,
        vram_budget_gib=-1.0 if vram_budget is None else float(vram_budget),
        n_gpu_layers=0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers,
        use_mmap=use_mmap,
        vocab_only=vocab_only,
        sparse_mode=sparse_mode,
        sparse_threshold=float("nan") if sparse_threshold is None else float(sparse_threshold),
        emulate_device=bool(emulate_device),
        reset_gpu_index=bool(reset_gpu_index),
        use_repack=bool(repack),
        pack_dense=bool(pack_dense),
    )
    if vram_budget is not None and vram_budget > 0:
        fields["vram_budget_bytes"] = int(float(vram_budget) * 2**30)  # exact, not a C float
    return fields


def set_activation_counts(model: Model, model_path: str, activation_dir: Optional[str]) -> None:
    """Hands PowerInfer's activation_{i}.pt counts (activation_dir, else <model folder>/activation
    when it exists) to the core's placement. ValueError if they do not fit the model."""
    folder = activation_dir
    if folder is None:
        folder = os.path.join(os.path.dirname(os.path.abspath(model_path)), "activation")
        if not os.path.isdir(folder):
            return
    n_layer, n_ff = model.n_layer(), model.n_ff()
    try:
        counts = pt_io.read_activation_dir(folder, n_layer=n_layer)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot use the activation counts in {folder}: {e}") from e
    bad = [i for i, c in enumerate(counts) if c.shape != (n_ff,)]
    if bad:
        raise ValueError(f"{folder}: activation_{bad[0]}.pt has shape {counts[bad[0]].shape}, the model has n_ff = {n_ff}")
    model.set_act_counts(np.stack(counts).astype(np.float32), f"{folder}: activation counts rejected")


def print_banner(llama: Any, arch: str, vocab_only: bool, draft_model: Any) -> None:
    model = llama._model
    where = "vocabulary only" if vocab_only else f"n_ctx {llama._n_ctx}, threads {llama.n_threads}/{llama.n_threads_batch}"
    print(
        f"powerinfer_py: engine {ENGINE_POWERINFER} (libpowerinfer {version()}): "
        f"arch {arch}, ffn activation {llama.ffn_activation()}, sparse mode {llama.sparse_mode_in_use()}, "
        f"{model.n_params() / 1e6:.1f}M params, "
        f"{model.size() / 2**20:.1f} MiB of weights, {where}",
        file=sys.stderr,
    )
    if draft_model is not None:
        print("powerinfer_py: draft_model is ignored (no speculative decoding yet)", file=sys.stderr)
