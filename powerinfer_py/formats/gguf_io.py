"""GGUF files as the engine and the pipeline use them, with the gguf package: reading
standard and PowerInfer (`PWRI` magic) files, our keys, float tensors in and out
(quantized to the output type), and the one finisher every GGUF writer of this
package ends with (written to a new temporary file beside the output, PWRI magic stamped
if asked, renamed).

Statistics of ours (docs/pipeline.md): tensor `blk.N.ffn_act_count` F32[n_ff] = the
number of profiled tokens on which neuron i of layer N fired; key
`powerinfer.stats.n_tokens` (uint64) = the number of profiled tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from . import pt_io

PWRI_MAGIC = b"PWRI"
KEY_ACTIVATION = "powerinfer.ffn_activation"
KEY_THRESHOLD = "powerinfer.sparse_threshold"
KEY_THRESHOLDS = "powerinfer.sparse_thresholds"
KEY_GATE_THRESHOLDS = "powerinfer.gate_thresholds"
KEY_STATS_N_TOKENS = "powerinfer.stats.n_tokens"
STATS_TENSOR = "blk.{}.ffn_act_count"
OUTTYPES = ("f32", "f16", "q8_0", "q4_0")


class FormatError(ValueError):
    """A file that is missing or not the format it should be."""


# ---------------------------------------------------------------- GGUF reading

def open_gguf(path):
    """gguf.GGUFReader for a GGUF or PWRI file (the reader refuses the PWRI magic, so a
    PWRI file is read through a copy of its header with the standard magic)."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FormatError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        try:
            return gguf.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError/struct.error/... on bad files
            raise FormatError(f"{path}: not a readable GGUF file ({e})") from None
    if magic == PWRI_MAGIC:
        # GGUFReader maps the file itself and checks the magic at once: hand it a
        # copy-on-write mapping whose first bytes read GGUF (the file is not modified).
        orig = np.memmap

        def _memmap(filename, mode="r", *a, **k):
            m = orig(filename, mode="c", *a, **k)
            m[0:4] = np.frombuffer(b"GGUF", dtype=np.uint8)
            return m

        np.memmap = _memmap
        try:
            return gguf.GGUFReader(path)
        except Exception as e:
            raise FormatError(f"{path}: not a readable PowerInfer GGUF file ({e})") from None
        finally:
            np.memmap = orig
    raise FormatError(f"{path}: not a GGUF file (magic {magic!r})")


def field(reader, key, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def tensor_f32(t) -> np.ndarray:
    """A GGUFReader tensor dequantized to float32, numpy (row-major) shape."""
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def copy_kv(reader, writer, skip: Iterable[str] = ()) -> None:
    """Copies every key of reader into writer except general.architecture and `skip`."""
    import gguf

    skip = set(skip) | {"general.architecture"}
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)


# ---------------------------------------------------------------- GGUF writing

def add_weight(writer, name: str, arr: np.ndarray, outtype: str) -> None:
    """Adds a float tensor: 1-D tensors stay F32; 2-D ones go to outtype (f32/f16/q8_0/q4_0),
    falling back to F16 when rows do not fill whole 32-value quantization blocks."""
    import gguf

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or outtype == "f32":
        writer.add_tensor(name, arr)
        return
    if outtype == "f16" or arr.shape[-1] % 32:
        writer.add_tensor(name, arr.astype(np.float16))
        return
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[outtype]
    q = gguf.quants.quantize(arr, qt)
    writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)


def file_type(outtype: str):
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype]


def new_writer(dst: str, arch: str):
    """A gguf.GGUFWriter for `dst`, on no file until finish() writes it."""
    import gguf

    return gguf.GGUFWriter(None, arch)


def finish(writer, dst: str, pwri: bool = False, progress: bool = False, inputs: Sequence[str] = ()) -> None:
    """Writes the GGUF of new_writer(dst, ...) to a new temporary file beside dst, stamps the
    PWRI magic if asked, and renames it to dst (_files.replacing: on failure dst is as it
    was and no temporary is left; a full disk says so). `inputs`: the files the writer's
    tensors were read from (memory maps), which dst must not be."""
    from pathlib import Path

    from .._files import replacing

    dst = os.fspath(dst)
    for src in inputs:
        if os.path.exists(src) and os.path.exists(dst) and os.path.samefile(src, dst):
            raise FormatError(f"{dst}: the output must not be the input {src}")
    with replacing(dst) as tmp:
        try:
            writer.write_header_to_file(Path(tmp))
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file(progress=progress)
            writer.close()
        except BaseException:
            for f in writer.fout or ():
                with contextlib.suppress(OSError):
                    f.close()
            raise
        if pwri:
            with open(tmp, "r+b") as f:
                f.write(PWRI_MAGIC)


# ---------------------------------------------------------------- activation statistics

def write_stats_gguf(path: str, counts: Sequence[np.ndarray], n_tokens: int) -> None:
    """A small GGUF holding only the statistics (architecture `powerinfer.stats`)."""
    w = new_writer(path, "powerinfer.stats")
    w.add_uint64(KEY_STATS_N_TOKENS, int(n_tokens))
    w.add_uint32("powerinfer.stats.n_layer", len(counts))
    for i, c in enumerate(counts):
        w.add_tensor(STATS_TENSOR.format(i), np.asarray(c, dtype=np.float32))
    finish(w, path)


def read_stats(path, n_layer: Optional[int] = None) -> Tuple[List[np.ndarray], Optional[int]]:
    """Per-layer counts and the number of profiled tokens from a stats/model GGUF, or from a
    profile output dir (stats.gguf) or a PowerInfer activation dir (activation_{i}.pt;
    n_tokens from a profile.json beside or above it if there is one, else None)."""
    p = Path(path)
    if p.is_dir():
        if (p / "stats.gguf").is_file():
            return read_stats(p / "stats.gguf", n_layer)
        act = p / "activation" if (p / "activation").is_dir() else p
        counts = pt_io.read_activation_dir(act, n_layer)
        n_tokens = None
        for meta in (act / "profile.json", act.parent / "profile.json"):
            if meta.is_file():
                n_tokens = int(json.loads(meta.read_text())["n_tokens"])
                break
        return [c.astype(np.float32) for c in counts], n_tokens
    r = open_gguf(p)
    counts = {}
    for t in r.tensors:
        if t.name.startswith("blk.") and t.name.endswith(".ffn_act_count"):
            counts[int(t.name.split(".")[1])] = np.array(t.data, dtype=np.float32)
    if not counts:
        raise FormatError(f"{p}: no blk.N.ffn_act_count tensors")
    n = n_layer if n_layer is not None else max(counts) + 1
    missing = [i for i in range(n) if i not in counts]
    if missing or max(counts) >= n:
        raise FormatError(f"{p}: statistics for layers {sorted(counts)} do not match n_layer={n}")
    n_tokens = field(r, KEY_STATS_N_TOKENS)
    return [counts[i] for i in range(n)], None if n_tokens is None else int(n_tokens)
