"""llama.cpp's tensor placement overrides on libllama's engine: `override_tensor`
(`-ot PATTERN=BUFFER_TYPE,...`), `cpu_moe` (`--cpu-moe`) and `n_cpu_moe` (`--n-cpu-moe N`),
with llama.cpp's meanings (common/arg.cpp, common/common.h of the pinned llama.cpp):

- a pattern is an ECMAScript regular expression searched in each weight's name; the first
  override that matches a weight picks its buffer type;
- a buffer type is a device's ggml name ("CPU", "Vulkan0", "CUDA0", ...); "CPU" lets libllama
  still choose the CPU's extra buffer types (repacked weights, and PowerInfer-Py's module,
  which so runs the sparse weights a model keeps on the CPU);
- `cpu_moe` keeps every expert stack on the CPU, `n_cpu_moe=N` those of the first N layers
  (`blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps`), after the explicit overrides.

llama-cpp-python 0.3.36 has no parameter for them (its llama_model_params declares the
field as a bare pointer): `installed()` fills the field for the loads of the calling thread.
"""

from __future__ import annotations

import ctypes
import re
import threading
from contextlib import contextmanager
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from .._core import devices
from . import upstream

# llama.cpp's LLM_FFN_EXPS_REGEX, and llm_ffn_block_regex's layer prefix.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"

OverrideSpec = Union[None, str, Mapping[str, str], Sequence[Tuple[str, str]]]


class _Override(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def parse(override_tensor: OverrideSpec = None, *, cpu_moe: bool = False,
          n_cpu_moe: int = 0) -> List[Tuple[str, str]]:
    """(pattern, buffer type name) pairs in llama.cpp's order. ValueError names what is wrong:
    a missing '=', an empty or invalid pattern, an unknown buffer type (with the list), a
    negative n_cpu_moe."""
    pairs: List[Tuple[str, str]] = []
    if override_tensor is None or override_tensor == "":
        items: List[Tuple[str, str]] = []
    elif isinstance(override_tensor, str):
        items = []
        for part in override_tensor.split(","):
            if "=" not in part:
                raise ValueError(f"override_tensor: '{part}' is not PATTERN=BUFFER_TYPE "
                                 "(llama.cpp's -ot syntax: PATTERN=BUFFER_TYPE,...)")
            pattern, buft = part.split("=", 1)
            items.append((pattern, buft))
    elif isinstance(override_tensor, Mapping):
        items = [(str(k), str(v)) for k, v in override_tensor.items()]
    else:
        items = []
        for item in override_tensor:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"override_tensor: {item!r} is not a (pattern, buffer type) pair")
            items.append((str(item[0]), str(item[1])))
    known: Optional[List[str]] = None
    for pattern, buft in items:
        if not pattern:
            raise ValueError(f"override_tensor: an empty pattern (for buffer type '{buft}')")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"override_tensor: '{pattern}' is not a regular expression: {e}") from None
        if known is None:
            known = devices.buffer_type_names()
        if buft not in known:
            raise ValueError(f"override_tensor: unknown buffer type '{buft}'; available: {', '.join(known)}")
        pairs.append((pattern, buft))
    if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
        raise ValueError(f"n_cpu_moe must be an integer >= 0, not {n_cpu_moe!r}")
    if cpu_moe:
        pairs.append((FFN_EXPS_REGEX, "CPU"))
    pairs.extend((rf"blk\.{i}{FFN_EXPS_REGEX}", "CPU") for i in range(n_cpu_moe))
    return pairs


def to_llama_cpp(pairs: Sequence[Tuple[str, str]]) -> List[str]:
    """The same overrides as llama.cpp's command line spells them."""
    return [f"{p}={b}" for p, b in pairs]


class Overrides:
    """A NULL-terminated llama_model_tensor_buft_override array; keep it alive while the
    model it was given to lives (libllama keeps the pointer in the model's params)."""

    def __init__(self, pairs: Sequence[Tuple[str, str]]):
        self.pairs = list(pairs)
        self._patterns = [p.encode() for p, _ in self.pairs]
        self.array = (_Override * (len(self.pairs) + 1))()
        for i, ((_, name), pat) in enumerate(zip(self.pairs, self._patterns)):
            buft = devices.buffer_type_address(name)
            if not buft:
                raise ValueError(f"override_tensor: unknown buffer type '{name}'; "
                                 f"available: {', '.join(devices.buffer_type_names())}")
            self.array[i].pattern = pat
            self.array[i].buft = buft
        self.array[len(self.pairs)].pattern = None
        self.array[len(self.pairs)].buft = None

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


_local = threading.local()


def _load_with_overrides(load: Any, path_model: Any, params: Any):
    pending: Optional[Overrides] = getattr(_local, "pending", None)
    if pending is not None and pending.pairs:
        params.tensor_buft_overrides = pending.address
    for name, value in (getattr(_local, "fields", None) or {}).items():
        setattr(params, name, value)
    return load(path_model, params)


def _install_hook() -> None:
    """Wraps llama-cpp-python's model loader once: a load on a thread inside installed()
    gets that thread's overrides and fields (the others load as before)."""
    upstream.wrap_model_loader("overrides", _load_with_overrides)


@contextmanager
def installed(overrides: Optional[Overrides], **fields: Any) -> Iterator[None]:
    """Within the block, llama-cpp-python's model loads on this thread use `overrides`, and
    `fields` of llama_model_params that its Llama has no argument for (use_extra_bufts:
    llama.cpp's --no-repack is use_extra_bufts=False)."""
    if (overrides is None or not overrides.pairs) and not fields:
        yield
        return
    _install_hook()
    _local.pending, _local.fields = overrides, fields
    try:
        yield
    finally:
        _local.pending, _local.fields = None, None
