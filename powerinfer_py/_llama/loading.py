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
from . import speculative
from .._core.bindings import set_log_level, version
from ..formats import pt_io
from .constants import (ENGINE_POWERINFER, LLAMA_POOLING_TYPE_RANK, LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
                        LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_ROW, SPARSE_MODES)

# Llama's own parameters, which llama_cpp.Llama (the fallback engine) does not take.
OWN_PARAMS = ("model_path", "vram_budget", "sparse_mode", "sparse_threshold", "fallback", "activation_dir",
              "reset_gpu_index", "emulate_device", "pack_dense", "batch_invariant", "draft_model_path", "draft_max",
              "draft_min", "draft_p_min", "override_tensor", "cpu_moe", "n_cpu_moe")


def _budgets(vram_budget: Any) -> Optional[List[float]]:
    """vram_budget as a list of per-device GiB (None: automatic)."""
    if vram_budget is None:
        return None
    if isinstance(vram_budget, str):
        vram_budget = [v for v in vram_budget.split(",") if v.strip()]
    values = list(vram_budget) if isinstance(vram_budget, (list, tuple)) else [vram_budget]
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"vram_budget must be GiB (a number, or one per device), not {vram_budget!r}") from None
    if not out or not all(v >= 0.0 and math.isfinite(v) for v in out):
        raise ValueError(f"vram_budget must be >= 0 GiB (or None for automatic), not {vram_budget!r}")
    return out


# split_mode: llama-cpp-python's numbers (LLAMA_SPLIT_MODE_*) or our names.
_SPLIT_MODES = {LLAMA_SPLIT_MODE_NONE: "none", LLAMA_SPLIT_MODE_LAYER: "auto", "auto": "auto", "hybrid": "hybrid",
                "layer": "layer", "none": "none"}


def split_mode_name(split_mode: Any) -> str:
    """llama-cpp-python's LLAMA_SPLIT_MODE_LAYER (its default) is our "auto": llama.cpp's layer
    split for a dense model given n_gpu_layers, else PowerInfer's hybrid placement."""
    if split_mode == LLAMA_SPLIT_MODE_ROW:
        raise ValueError("split_mode=LLAMA_SPLIT_MODE_ROW (tensor parallelism) is not supported; use "
                         "LLAMA_SPLIT_MODE_LAYER, 'layer' or 'hybrid'")
    try:
        return _SPLIT_MODES[split_mode]
    except (KeyError, TypeError):
        raise ValueError(f"split_mode must be one of 'auto', 'hybrid', 'layer', 'none' or a LLAMA_SPLIT_MODE_*, "
                         f"not {split_mode!r}") from None


def check_arguments(*, sparse_mode: str, sparse_threshold: Optional[float], vram_budget: Any,
                    n_ctx: int, n_batch: int, split_mode: Any = LLAMA_SPLIT_MODE_LAYER,
                    tensor_split: Optional[List[float]] = None, rpc_servers: Optional[str] = None) -> None:
    if sparse_mode not in SPARSE_MODES:
        raise ValueError(f"sparse_mode must be one of {', '.join(map(repr, SPARSE_MODES))}, not {sparse_mode!r}")
    if sparse_threshold is not None and not math.isfinite(float(sparse_threshold)):
        raise ValueError(f"sparse_threshold must be a finite number, not {sparse_threshold!r}")
    _budgets(vram_budget)
    split_mode_name(split_mode)
    if tensor_split is not None and not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                            for v in tensor_split):
        raise ValueError(f"tensor_split must be shares >= 0, one per device, not {tensor_split!r}")
    if rpc_servers is not None and not isinstance(rpc_servers, str):
        raise ValueError(f"rpc_servers must be a string 'host:port,host:port', not {rpc_servers!r}")
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
                         type_v, embedding, pooling_type, override_tensor=None) -> List[str]:
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
            # libllama places the weights (docs/accel.md#placement); cpu_moe and n_cpu_moe
            # alone change nothing on the core, whose architectures have no experts
            ("tensor overrides (override_tensor)", bool(override_tensor)),
        )
        if wanted
    ]


def model_fields(*, n_threads: int, vram_budget: Any, n_gpu_layers: int, use_mmap: bool,
                 vocab_only: bool, sparse_mode: str, sparse_threshold: Optional[float], emulate_device: bool,
                 reset_gpu_index: bool, repack: bool = True, pack_dense: bool = False,
                 split_mode: Any = LLAMA_SPLIT_MODE_LAYER, tensor_split: Optional[List[float]] = None,
                 rpc_servers: Optional[str] = None) -> Dict[str, Any]:
    """struct powerinfer_model_params fields for Model(). vram_budget: GiB for every device,
    or one per device (GPUs, then the RPC workers' devices, in order)."""
    budgets = _budgets(vram_budget)
    fields: Dict[str, Any] = dict(
        n_threads=n_threads,
        vram_budget_gib=-1.0 if budgets is None else budgets[0],
        split_mode=split_mode_name(split_mode),
        rpc_servers=rpc_servers or None,
        tensor_split=[float(v) for v in tensor_split] if tensor_split else None,
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
    if budgets is not None and len(budgets) == 1 and budgets[0] > 0:
        fields["vram_budget_bytes"] = int(budgets[0] * 2**30)  # exact, not a C float
    elif budgets is not None and len(budgets) > 1:
        fields["device_budgets"] = [int(b * 2**30) for b in budgets]
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


def draft_params(draft_model: Any, draft_model_path: Optional[str], draft_max: Optional[int],
                 draft_min: Optional[int], draft_p_min: Optional[float]) -> Optional[speculative.DraftParams]:
    """The drafting parameters (llama.cpp's defaults for those not given), or None without a
    draft. ValueError for a bad value, or two drafts."""
    params = speculative.DraftParams(
        n_max=speculative.DEFAULT_DRAFT_MAX if draft_max is None else draft_max,
        n_min=speculative.DEFAULT_DRAFT_MIN if draft_min is None else draft_min,
        p_min=speculative.DEFAULT_DRAFT_P_MIN if draft_p_min is None else draft_p_min,
    )
    if draft_model is not None and not callable(draft_model):
        raise ValueError(f"draft_model must be a LlamaDraftModel (a callable from token ids to drafted ids), "
                         f"not {type(draft_model).__name__}; a GGUF draft goes in draft_model_path")
    if draft_model is not None and draft_model_path is not None:
        raise ValueError("give draft_model or draft_model_path, not both")
    if draft_model_path is not None and not isinstance(draft_model_path, (str, os.PathLike)):
        raise ValueError(f"draft_model_path must be a path, not {draft_model_path!r}")
    return params if draft_model is not None or draft_model_path is not None else None


def make_drafter(llama: Any, draft_model: Any, draft_model_path: Optional[str],
                 params: speculative.DraftParams) -> speculative.Drafter:
    """The Llama's drafter: draft_model's proposals, or a draft model loaded from
    draft_model_path (ValueError if it does not share the target's vocabulary)."""
    if draft_model is not None:
        return speculative.CallableDrafter(draft_model, params)
    path = os.fspath(draft_model_path)
    if not os.path.exists(path):
        raise ValueError(f"Draft model path does not exist: {path}")
    set_log_level(llama.verbose)  # as for the target's load: quiet unless verbose
    model = Model(path, n_threads=llama.n_threads)
    try:
        speculative.check_vocabularies(llama._model, model, llama.model_path, path)
        return speculative.ModelDrafter(model, params, n_ctx=llama._n_ctx, n_batch=llama.n_batch,
                                        n_threads=llama.n_threads, n_threads_batch=llama.n_threads_batch)
    except BaseException:
        model.close()
        raise


def print_banner(llama: Any, arch: str, vocab_only: bool, drafter: Any) -> None:
    model = llama._model
    where = "vocabulary only" if vocab_only else f"n_ctx {llama._n_ctx}, threads {llama.n_threads}/{llama.n_threads_batch}"
    print(
        f"powerinfer_py: engine {ENGINE_POWERINFER} (libpowerinfer {version()}): "
        f"arch {arch}, ffn activation {llama.ffn_activation()}, sparse mode {llama.sparse_mode_in_use()}, "
        f"{model.n_params() / 1e6:.1f}M params, "
        f"{model.size() / 2**20:.1f} MiB of weights, {where}",
        file=sys.stderr,
    )
    if drafter is not None:
        p = drafter.params
        what = "a draft model" if isinstance(drafter, speculative.ModelDrafter) else type(drafter.source).__name__
        print(f"powerinfer_py: speculative decoding with {what} (draft_max {p.n_max}, draft_min {p.n_min}, "
              f"draft_p_min {p.p_min}), batch-invariant kernels", file=sys.stderr)
