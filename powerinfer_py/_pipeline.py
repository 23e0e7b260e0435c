"""Helpers shared by the offline pipeline (profile, train-predictor, convert, relufy)
and calibrate: GGUF reading/writing, quantization of output tensors, corpus
tokenization with the model's own tokenizer, and the activation-statistics tensors.

Statistics of ours (docs/pipeline.md): tensor `blk.N.ffn_act_count` F32[n_ff] = the
number of profiled tokens on which neuron i of layer N fired; key
`powerinfer.stats.n_tokens` (uint64) = the number of profiled tokens.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

PWRI_MAGIC = b"PWRI"
KEY_ACTIVATION = "powerinfer.ffn_activation"
KEY_THRESHOLD = "powerinfer.sparse_threshold"
KEY_THRESHOLDS = "powerinfer.sparse_thresholds"
KEY_GATE_THRESHOLDS = "powerinfer.gate_thresholds"
KEY_STATS_N_TOKENS = "powerinfer.stats.n_tokens"
STATS_TENSOR = "blk.{}.ffn_act_count"
OUTTYPES = ("f32", "f16", "q8_0", "q4_0")


class PipelineError(ValueError):
    """Bad input to a pipeline command: reported as `error: ...` with exit status 1."""


def run_cli(fn, argv) -> int:
    """Runs fn(argv) turning expected failures into a message and exit status 1."""
    try:
        return fn(argv) or 0
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def same_file(a, b) -> bool:
    return os.path.abspath(a) == os.path.abspath(b) or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


# ---------------------------------------------------------------- GGUF reading

def open_gguf(path):
    """gguf.GGUFReader for a GGUF or PWRI file (the reader refuses the PWRI magic, so a
    PWRI file is read through a copy of its header with the standard magic)."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PipelineError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        try:
            return gguf.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError/struct.error/... on bad files
            raise PipelineError(f"{path}: not a readable GGUF file ({e})") from None
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
            raise PipelineError(f"{path}: not a readable PowerInfer GGUF file ({e})") from None
        finally:
            np.memmap = orig
    raise PipelineError(f"{path}: not a GGUF file (magic {magic!r})")


def field(reader, key, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def llama_hparams(reader, path="model") -> Dict:
    """Hyper-parameters of a llama-architecture GGUF (what relufy/convert need)."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise PipelineError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    hp = {"arch": arch}
    for k, key, default in (("n_embd", "embedding_length", None), ("n_layer", "block_count", None),
                            ("n_ff", "feed_forward_length", None), ("n_head", "attention.head_count", None),
                            ("n_head_kv", "attention.head_count_kv", None), ("eps", "attention.layer_norm_rms_epsilon", 1e-5),
                            ("rope_base", "rope.freq_base", 10000.0), ("n_ctx", "context_length", 2048),
                            ("n_rot", "rope.dimension_count", None)):
        v = field(reader, f"{arch}.{key}", default)
        if v is None and k not in ("n_head_kv", "n_rot"):
            raise PipelineError(f"{path}: missing key {arch}.{key}")
        hp[k] = v
    hp["n_head_kv"] = hp["n_head_kv"] or hp["n_head"]
    if hp["n_rot"] is None:
        hp["n_rot"] = hp["n_embd"] // hp["n_head"]
    if field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise PipelineError(f"{path}: RoPE scaling is not supported by the pipeline")
    hp["activation"] = field(reader, KEY_ACTIVATION, "silu")
    return hp


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


def finish(writer, tmp: str, dst: str, pwri: bool = False, progress: bool = False) -> None:
    """Writes the GGUF to tmp, stamps the PWRI magic if asked, and renames it to dst."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        if pwri:
            with open(tmp, "r+b") as f:
                f.write(PWRI_MAGIC)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------- activation statistics

def write_stats_gguf(path: str, counts: Sequence[np.ndarray], n_tokens: int) -> None:
    """A small GGUF holding only the statistics (architecture `powerinfer.stats`)."""
    import gguf

    w = gguf.GGUFWriter(path + ".tmp", "powerinfer.stats")
    w.add_uint64(KEY_STATS_N_TOKENS, int(n_tokens))
    w.add_uint32("powerinfer.stats.n_layer", len(counts))
    for i, c in enumerate(counts):
        w.add_tensor(STATS_TENSOR.format(i), np.asarray(c, dtype=np.float32))
    finish(w, path + ".tmp", path)


def read_stats(path, n_layer: Optional[int] = None) -> Tuple[List[np.ndarray], Optional[int]]:
    """Per-layer counts and the number of profiled tokens from a stats/model GGUF, or from a
    profile output dir (stats.gguf) or a PowerInfer activation dir (activation_{i}.pt;
    n_tokens from a profile.json beside or above it if there is one, else None)."""
    import json

    from . import pt_io

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
        raise PipelineError(f"{p}: no blk.N.ffn_act_count tensors")
    n = n_layer if n_layer is not None else max(counts) + 1
    missing = [i for i in range(n) if i not in counts]
    if missing or max(counts) >= n:
        raise PipelineError(f"{p}: statistics for layers {sorted(counts)} do not match n_layer={n}")
    n_tokens = field(r, KEY_STATS_N_TOKENS)
    return [counts[i] for i in range(n)], None if n_tokens is None else int(n_tokens)


# ---------------------------------------------------------------- corpus

def read_corpus(files: Sequence[str]) -> List[str]:
    texts = []
    for f in files:
        if not os.path.isfile(f):
            raise PipelineError(f"corpus file {f}: no such file")
        texts.append(Path(f).read_text(errors="replace"))
    if not any(t.strip() for t in texts):
        raise PipelineError("the corpus is empty")
    return texts


def tokenize_texts(model_path: str, texts: Sequence[str], max_tokens: Optional[int] = None,
                   add_bos: bool = True) -> np.ndarray:
    """Token ids of the texts (each with the model's BOS if it uses one), concatenated,
    with the model's own tokenizer (libllama through the core, vocab only)."""
    from ._bindings import ffi, last_error, lib

    mp = lib.powerinfer_model_default_params()
    mp.vocab_only = True
    model = lib.powerinfer_model_load(os.fsencode(model_path), mp)
    if model == ffi.NULL:
        raise PipelineError(f"cannot load {model_path}: {last_error()}")
    try:
        out: List[int] = []
        piece = 1 << 20  # tokenize in ~1 MiB slices, cut at whitespace so words stay whole
        for text in texts:
            raw = text.encode()
            start = 0
            while start < len(raw):
                end = min(start + piece, len(raw))
                if end < len(raw):
                    cut = raw.rfind(b" ", start, end)
                    end = cut + 1 if cut > start else end
                chunk = raw[start:end]
                buf = ffi.new("int32_t[]", len(chunk) + 8)
                n = lib.powerinfer_tokenize(model, chunk, len(chunk), buf, len(chunk) + 8, add_bos and start == 0, False)
                if n < 0:
                    raise PipelineError(f"tokenization failed: {last_error()}")
                out.extend(buf[0:n])
                start = end
                if max_tokens is not None and len(out) >= max_tokens:
                    return np.array(out[:max_tokens], dtype=np.int32)
        return np.array(out, dtype=np.int32)
    finally:
        lib.powerinfer_model_free(model)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        import time

        self.label, self.total, self.enabled, self.t0 = label, max(total, 1), enabled, time.time()
        self._time = time.time

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        el = self._time() - self.t0
        frac = min(done / self.total, 1.0)
        eta = el / frac - el if frac > 0 else 0.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        print(f"\r{self.label} [{bar}] {done}/{self.total} {el:.0f}s elapsed, ~{eta:.0f}s left {extra}   ",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)
