"""PyTorch `.pt` files without torch, and without ever running pickle code.

PowerInfer keeps two kinds of sidecar files as `torch.save` archives:
`activation/activation_{i}.pt` (a 1-D tensor of per-neuron activation counts of
layer i) and the predictor directory's `model_{i}.pt` (a state dict with
`fc1.weight` [r, n_embd] and `fc2.weight` [n_ff, r]). This module reads and writes
both with numpy only.

A `.pt` file (torch >= 1.6) is a zip archive whose entries sit under one top folder
`<name>/`: `data.pkl` (a pickle describing the object), `data/<key>` (the raw bytes of
each storage), `version`, `byteorder`. The pickle is read by a restricted unpickler:
only the globals a tensor or state dict needs are resolved, each to a function of
this module (`torch._utils._rebuild_tensor_v2`, `torch._utils._rebuild_parameter`,
`torch.<Dtype>Storage`, `collections.OrderedDict`); any other global (e.g. `os.system`
in a crafted file) raises ValueError before anything is called. Persistent ids
(`('storage', type, key, location, numel)`) are answered with the bytes of
`data/<key>`, bounds-checked against every tensor view.

Stable API (used by the profiler, the predictor trainer, convert and placement):

    load(path)                     -> object: np.ndarray for a tensor; dict for a
                                      (ordered) dict; lists/tuples/scalars as is
    load_tensor(path)              -> np.ndarray (the file must hold one tensor)
    load_state_dict(path)          -> Dict[str, np.ndarray]
    save(obj, path)                -> writes an np.ndarray or a dict of them, readable
                                      by torch.load(path, weights_only=True); atomic
    read_activation_dir(dir, n_layer=None) -> List[np.ndarray], one per layer
    write_activation_dir(dir, counts)      -> writes activation_{i}.pt (int64)
    read_predictor_dir(dir, n_layer=None)  -> List[(fc1 [r, n_embd], fc2 [n_ff, r])]
    write_predictor_dir(dir, layers, sparse_threshold=None)

`read_activation_dir` orders files by the numeric layer index (PowerInfer issue #247
sorted them as strings, so with more than 10 layers counts were paired with the wrong
layers), and rejects gaps and length mismatches.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["load", "load_tensor", "load_state_dict", "save", "read_activation_dir", "write_activation_dir",
           "read_predictor_dir", "write_predictor_dir"]

# torch storage class name <-> numpy dtype
_STORAGE_DTYPES = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype("<u2"),  # converted to float32 after reading
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}
_DTYPE_STORAGE = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float64): "DoubleStorage",
                  np.dtype(np.float16): "HalfStorage", np.dtype(np.int64): "LongStorage",
                  np.dtype(np.int32): "IntStorage", np.dtype(np.int16): "ShortStorage",
                  np.dtype(np.int8): "CharStorage", np.dtype(np.uint8): "ByteStorage",
                  np.dtype(np.bool_): "BoolStorage"}


class _StorageType:
    """Stands for a `torch.<X>Storage` class inside the pickle."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args):
        raise ValueError(f"refusing to construct torch.{self.name} from pickle arguments")


class _Storage:
    """Bytes of one `data/<key>` record viewed as a 1-D array of the storage's dtype."""

    def __init__(self, name: str, array: np.ndarray):
        self.name = name
        self.array = array


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise ValueError("malformed .pt file: a tensor is not backed by a storage record")
    if not (isinstance(storage_offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(isinstance(v, int) for v in size + stride)):
        raise ValueError("malformed .pt file: bad tensor offset, size or stride")
    if storage_offset < 0 or any(v < 0 for v in size + stride):
        raise ValueError("malformed .pt file: negative tensor offset, size or stride")
    base = storage.array
    n = int(np.prod(size)) if size else 1
    if n:
        last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride))
        if last >= base.size:
            raise ValueError(f"malformed .pt file: tensor view of {size} at offset {storage_offset} runs past its "
                             f"storage of {base.size} elements")
    item = base.itemsize
    view = np.lib.stride_tricks.as_strided(base[storage_offset:] if n else base[:0], shape=size,
                                           strides=tuple(st * item for st in stride), writeable=False)
    out = np.array(view)  # own the data, C order
    if storage.name == "BFloat16Storage":
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    if not isinstance(data, np.ndarray):
        raise ValueError("malformed .pt file: a parameter does not hold a tensor")
    return data


def _ordered_dict(*args):
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, dict))):
        raise ValueError("malformed .pt file: bad OrderedDict arguments")
    return OrderedDict(*args)


_ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
}
_ALLOWED_GLOBALS.update({("torch", name): _StorageType(name) for name in _STORAGE_DTYPES})


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, zf: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(io.BytesIO(data))
        self._zf, self._prefix, self._path = zf, prefix, path
        self._storages: Dict[str, _Storage] = {}

    def find_class(self, module, name):
        fn = _ALLOWED_GLOBALS.get((module, name))
        if fn is None:
            raise ValueError(f"{self._path}: refusing to load pickle global {module}.{name} "
                             "(only tensors and dicts of tensors are read)")
        return fn

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise ValueError(f"{self._path}: unsupported persistent id {pid!r}")
        stype, key, numel = pid[1], pid[2], pid[4]
        if key in self._storages:
            return self._storages[key]
        if not re.fullmatch(r"[0-9A-Za-z_]+", key):
            raise ValueError(f"{self._path}: bad storage key {key!r}")
        try:
            raw = self._zf.read(f"{self._prefix}data/{key}")
        except KeyError:
            raise ValueError(f"{self._path}: storage record data/{key} is missing") from None
        dtype = _STORAGE_DTYPES[stype.name]
        if len(raw) < numel * dtype.itemsize:
            raise ValueError(f"{self._path}: storage data/{key} has {len(raw)} bytes, needs {numel * dtype.itemsize}")
        arr = np.frombuffer(raw, dtype=dtype, count=numel)
        if self._big_endian and dtype.itemsize > 1:
            arr = arr.byteswap()
        st = _Storage(stype.name, arr)
        self._storages[key] = st
        return st

    _big_endian = False


def load(path: Union[str, os.PathLike]) -> Any:
    """Reads a torch.save archive; tensors become numpy arrays. Never executes pickle code."""
    path = os.fspath(path)
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            head = f.read(2)
        if head[:1] == b"\x80":
            raise ValueError(f"{path}: legacy (pre-1.6, non-zip) torch.save format is not supported; "
                             "re-save it with a current torch") from None
        raise ValueError(f"{path}: not a PyTorch .pt file (not a zip archive)") from None
    with zf:
        pkls = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
        if len(pkls) != 1:
            raise ValueError(f"{path}: not a PyTorch .pt file (expected one <name>/data.pkl, found {len(pkls)})")
        prefix = pkls[0][: -len("data.pkl")]
        up = _RestrictedUnpickler(zf.read(pkls[0]), zf, prefix, path)
        if f"{prefix}byteorder" in zf.namelist():
            order = zf.read(f"{prefix}byteorder").decode(errors="replace").strip()
            if order not in ("little", "big"):
                raise ValueError(f"{path}: bad byteorder record {order!r}")
            up._big_endian = order == "big"
        try:
            return up.load()
        except ValueError:
            raise
        except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError, KeyError) as e:
            raise ValueError(f"{path}: malformed pickle in .pt file: {e}") from None


def load_tensor(path) -> np.ndarray:
    obj = load(path)
    if not isinstance(obj, np.ndarray):
        raise ValueError(f"{os.fspath(path)}: expected one tensor, found {type(obj).__name__}")
    return obj


def load_state_dict(path) -> Dict[str, np.ndarray]:
    obj = load(path)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()):
        raise ValueError(f"{os.fspath(path)}: expected a state dict (str -> tensor)")
    return dict(obj)


# ---------------------------------------------------------------- writer (protocol-2 pickle by hand)

class _PickleWriter:
    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.storages: List[np.ndarray] = []

    def _str(self, s: str):
        b = s.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE

    def _int(self, v: int):
        if 0 <= v < 256:
            self.out += b"K" + bytes([v])
        elif 0 <= v < 65536:
            self.out += b"M" + struct.pack("<H", v)
        elif -2**31 <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(b)]) + b  # LONG1

    def _global(self, module: str, name: str):
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def _tuple_of_ints(self, vals):
        self.out += b"("
        for v in vals:
            self._int(int(v))
        self.out += b"t"

    def tensor(self, arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _DTYPE_STORAGE:
            raise ValueError(f"cannot save dtype {arr.dtype} as a torch tensor")
        key = str(len(self.storages))
        self.storages.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out += b"("  # MARK for the args tuple
        self.out += b"("  # MARK for the persistent id
        self._str("storage")
        self._global("torch", _DTYPE_STORAGE[arr.dtype])
        self._str(key)
        self._str("cpu")
        self._int(arr.size)
        self.out += b"tQ"  # TUPLE, BINPERSID
        self._int(0)
        self._tuple_of_ints(arr.shape)
        strides, acc = [], 1
        for d in reversed(arr.shape):
            strides.append(acc)
            acc *= d
        self._tuple_of_ints(reversed(strides))
        self.out += b"\x89"  # NEWFALSE (requires_grad)
        self._global("collections", "OrderedDict")
        self.out += b")R"  # EMPTY_TUPLE, REDUCE -> backward hooks
        self.out += b"tR"  # TUPLE, REDUCE

    def obj(self, obj):
        if isinstance(obj, np.ndarray):
            self.tensor(obj)
        elif isinstance(obj, dict):
            self._global("collections", "OrderedDict")
            self.out += b")R("
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise ValueError("state dict keys must be strings")
                self._str(k)
                self.obj(v)
            self.out += b"u"  # SETITEMS
        else:
            raise ValueError(f"cannot save {type(obj).__name__}: only arrays and dicts of arrays")

    def finish(self) -> bytes:
        return bytes(self.out + b".")


def save(obj: Union[np.ndarray, Dict[str, np.ndarray]], path: Union[str, os.PathLike]) -> None:
    """Writes obj like torch.save (zip archive, 64-byte aligned records); atomic."""
    path = os.fspath(path)
    pw = _PickleWriter()
    pw.obj(obj)
    pkl = pw.finish()
    name = re.sub(r"[^0-9A-Za-z_]", "_", Path(path).name.split(".")[0]) or "archive"
    records = [("data.pkl", pkl), ("byteorder", b"little")]
    records += [(f"data/{i}", a.tobytes()) for i, a in enumerate(pw.storages)]
    records += [("version", b"3\n"), (".data/serialization_id", b"0" * 40)]
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            for rec, data in records:
                zi = zipfile.ZipInfo(f"{name}/{rec}", date_time=(1980, 1, 1, 0, 0, 0))
                zi.compress_type = zipfile.ZIP_STORED
                # Pad the local header's extra field so the data starts on 64 bytes, as torch does.
                start = f.tell() + 30 + len(zi.filename.encode())
                pad = (-(start + 4)) % 64
                zi.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
                zf.writestr(zi, data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------- PowerInfer sidecar directories

def _numbered(directory, pattern: str, what: str, n_layer: Optional[int]) -> List[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory")
    rx = re.compile(pattern)
    found = {}
    for p in d.iterdir():
        m = rx.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise ValueError(f"{d}: no {what} files")
    n = max(found) + 1 if n_layer is None else n_layer
    missing = [i for i in range(n) if i not in found]
    extra = [i for i in found if i >= n]
    if missing:
        raise ValueError(f"{d}: missing {what} for layer(s) {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
    if extra:
        raise ValueError(f"{d}: {what} for layer(s) {sorted(extra)[:10]} beyond n_layer={n}")
    return [found[i] for i in range(n)]  # numeric order, not string order (PowerInfer #247)


def read_activation_dir(directory, n_layer: Optional[int] = None) -> List[np.ndarray]:
    """Per-layer activation counts from activation_{i}.pt, ordered by the number i."""
    counts = []
    for p in _numbered(directory, r"activation_(\d+)\.pt", "activation_{i}.pt", n_layer):
        a = load_tensor(p)
        if a.ndim != 1:
            raise ValueError(f"{p}: expected a 1-D tensor of per-neuron counts, got shape {a.shape}")
        if counts and a.shape != counts[0].shape:
            raise ValueError(f"{p}: {a.shape[0]} neurons, but layer 0 has {counts[0].shape[0]}")
        counts.append(a)
    return counts


def write_activation_dir(directory, counts: Sequence[np.ndarray]) -> List[str]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, c in enumerate(counts):
        p = d / f"activation_{i}.pt"
        save(np.asarray(c).astype(np.int64), p)
        paths.append(str(p))
    return paths


def read_predictor_dir(directory, n_layer: Optional[int] = None) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(fc1 [r, n_embd], fc2 [n_ff, r]) per layer from model_{i}.pt state dicts."""
    out = []
    for p in _numbered(directory, r"model_(\d+)\.pt", "model_{i}.pt", n_layer):
        sd = load_state_dict(p)
        try:
            fc1, fc2 = sd["fc1.weight"], sd["fc2.weight"]
        except KeyError as e:
            raise ValueError(f"{p}: state dict lacks {e.args[0]} (has {sorted(sd)})") from None
        if fc1.ndim != 2 or fc2.ndim != 2 or fc2.shape[1] != fc1.shape[0]:
            raise ValueError(f"{p}: fc1 {fc1.shape} and fc2 {fc2.shape} do not chain (want [r, n_embd], [n_ff, r])")
        if out and (fc1.shape[1] != out[0][0].shape[1] or fc2.shape[0] != out[0][1].shape[0]):
            raise ValueError(f"{p}: shapes differ from layer 0's in n_embd or n_ff")
        out.append((fc1.astype(np.float32), fc2.astype(np.float32)))
    return out


def write_predictor_dir(directory, layers: Sequence[Tuple[np.ndarray, np.ndarray]],
                        sparse_threshold: Optional[float] = None) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for i, (fc1, fc2) in enumerate(layers):
        save({"fc1.weight": np.asarray(fc1, dtype=np.float32), "fc2.weight": np.asarray(fc2, dtype=np.float32)},
             d / f"model_{i}.pt")
    if sparse_threshold is not None:  # PowerInfer's convert.py reads this key from the predictor dir
        cfg = d / "config.json"
        old = json.loads(cfg.read_text()) if cfg.is_file() else {}
        old["sparse_threshold"] = float(sparse_threshold)
        cfg.write_text(json.dumps(old, indent=1))


if __name__ == "__main__":  # python -m powerinfer_py.formats.pt_io FILE.pt: print what a file holds
    for arg in sys.argv[1:]:
        obj = load(arg)
        items = obj.items() if isinstance(obj, dict) else [("", obj)]
        for k, v in items:
            desc = f"{v.dtype} {list(v.shape)}" if isinstance(v, np.ndarray) else repr(v)
            print(f"{arg} {k} {desc}")
