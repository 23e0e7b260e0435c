"""PyTorch `.pt` files without torch, and without ever running pickle code.

PowerInfer keeps two kinds of sidecar files as `torch.save` archives:
`activation/activation_{i}.pt` (a 1-D tensor of per-neuron activation counts of
layer i) and the predictor directory's `model_{i}.pt` (a state dict with
`fc1.weight` [r, n_embd] and `fc2.weight` [n_ff, r]). This module reads and writes
both with numpy only.

A `.pt` file (torch >= 1.6) is a zip archive whose entries sit under one top folder
`<name>/`: `data.pkl` (a pickle describing the object), `data/<key>` (the raw bytes of
each storage), `version`, `byteorder`. The pickle is read by a restricted unpickler:
only the globals a tensor or state dict needs are resolved (`torch._utils._rebuild_tensor_v2`,
`torch._utils._rebuild_parameter`, `torch.<Dtype>Storage`, `collections.OrderedDict`);
any other global (e.g. `os.system` in a crafted file) raises before anything is called.
Each load makes its own objects for those names, which refuse a pickle BUILD, so no
file can change how a later one is read. Persistent ids (`('storage', type, key,
location, numel)`) are answered with the bytes of `data/<key>`. Every tensor view is
checked in full: offset, every size and stride non-negative and bounded, the furthest
element inside the storage, and no more elements than the storage holds (stride 0 or
overlapping views, which would multiply a small file into a huge array, are refused).

Size caps: a load reads at most `max_bytes` (default DEFAULT_MAX_BYTES, 4 GiB) out of the
archive, checked against each record's declared size before reading it, makes at most
as many bytes of arrays again, and reads a `data.pkl` of at most MAX_PICKLE_BYTES (8 MiB).
Every malformed, refused or oversized file raises PtFormatError (a ValueError) with the
file and the reason; a path that cannot be opened raises OSError.

Stable API (used by the profiler, the predictor trainer, convert and placement):

    load(path_or_file, max_bytes=None) -> object: np.ndarray for a tensor; dict for a
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
import lzma
import math
import os
import pickle
import pickletools
import re
import struct
import sys
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["load", "load_tensor", "load_state_dict", "save", "read_activation_dir", "write_activation_dir",
           "read_predictor_dir", "write_predictor_dir", "PtFormatError", "DEFAULT_MAX_BYTES", "MAX_PICKLE_BYTES"]

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


# ---------------------------------------------------------------- reader (restricted unpickler)

DEFAULT_MAX_BYTES = 4 << 30
"""Default cap of one load: bytes read out of the archive, and again bytes of the arrays
made from them (a PowerInfer predictor file of a 70B model is ~150 MB)."""
MAX_PICKLE_BYTES = 8 << 20
"""Cap of the `data.pkl` record (a state dict of thousands of tensors is ~1 MB of pickle;
unpickling can grow memory ~100-fold from opcodes that each push a new object)."""
_MAX_NDIM = 64  # numpy's limit
_MAX_DIM = 1 << 48  # any size, stride or offset above this cannot index a real storage


class PtFormatError(ValueError):
    """A `.pt` file that is malformed, uses what this reader refuses (a global outside the
    allow-list, a view larger than its storage), or goes over the load's size cap."""


class _Frozen:
    """Base of every object the pickle can reach by name: no instance dict, and a pickle
    BUILD (which would set attributes) is refused."""

    __slots__ = ()

    def __setstate__(self, state):
        raise _Malformed(f"malformed .pt file: refusing to set state on {self!r} (pickle BUILD)")

    def __setattr__(self, name, value):  # only __init__ sets fields, through object.__setattr__
        raise AttributeError(f"{type(self).__name__} is read-only")


class _StorageType(_Frozen):
    """Stands for a `torch.<X>Storage` class inside the pickle. A fresh one per load."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __call__(self, *args, **kwargs):
        raise _Malformed(f"malformed .pt file: refusing to construct torch.{self.name} from pickle arguments")

    def __repr__(self):
        return f"torch.{self.name}"


class _Storage(_Frozen):
    """Bytes of one `data/<key>` record viewed as a 1-D array of the storage's dtype."""

    __slots__ = ("name", "array")

    def __init__(self, name: str, array: np.ndarray):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "array", array)

    def __repr__(self):
        return f"<storage {self.name} of {self.array.size} elements>"


class _Global(_Frozen):
    """An allow-listed global (a function of one load), fresh per load."""

    __slots__ = ("qualname", "fn")

    def __init__(self, qualname: str, fn: Callable[..., Any]):
        object.__setattr__(self, "qualname", qualname)
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self):
        return self.qualname


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _clip(text: str) -> str:
    """A pickle-given name for a message: escaped, at most 80 characters."""
    text = ascii(str(text))[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


class _Malformed(Exception):
    """Raised by the pickle-reachable objects, which do not know the file; load() turns it
    into a PtFormatError naming the file."""


def _describe(obj) -> str:
    """A short description of a pickle-made object for an error message (never a full
    repr: a crafted object can be deeply nested or huge)."""
    if isinstance(obj, (str, bytes)) or _is_int(obj):
        text = repr(obj)
        return text if len(text) <= 80 else text[:77] + "..."
    if isinstance(obj, tuple) and len(obj) <= 8:
        return "(" + ", ".join(_describe(v) if isinstance(v, (str, bytes, int, _Frozen)) else type(v).__name__
                               for v in obj) + ")"
    if isinstance(obj, _Frozen):
        return repr(obj)
    return f"a {type(obj).__name__}"


class _Load:
    """One load: the archive, its size budget, its storages and its own allow-listed
    globals. Nothing here outlives the load, so no file can change how the next is read."""

    def __init__(self, zf: zipfile.ZipFile, prefix: str, where: str, max_bytes: int):
        self.zf, self.prefix, self.where = zf, prefix, where
        self.read_budget = max_bytes  # bytes still allowed out of the archive
        self.array_budget = max_bytes  # bytes still allowed in arrays made from them
        self.max_bytes = max_bytes
        self.big_endian = False
        self.storages: Dict[str, _Storage] = {}
        self.storage_types = {name: _StorageType(name) for name in _STORAGE_DTYPES}
        self.globals: Dict[Tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): _Global("torch._utils._rebuild_tensor_v2", self.rebuild_tensor),
            ("torch._utils", "_rebuild_parameter"): _Global("torch._utils._rebuild_parameter", _rebuild_parameter),
            ("collections", "OrderedDict"): _Global("collections.OrderedDict", _ordered_dict),
        }
        self.globals.update({("torch", name): st for name, st in self.storage_types.items()})

    def fail(self, message: str) -> PtFormatError:
        return PtFormatError(f"{self.where}: {message}")

    def read(self, name: str, limit: Optional[int] = None) -> bytes:
        """One archive record, after checking its declared size against the budget."""
        try:
            info = self.zf.getinfo(name)
        except KeyError:
            raise self.fail(f"record {name} is missing") from None
        cap = self.read_budget if limit is None else min(limit, self.read_budget)
        if info.file_size > cap:
            raise self.fail(f"record {name} holds {info.file_size} bytes, over the cap of {cap} "
                            f"(load(..., max_bytes=N) raises the cap of {self.max_bytes})")
        try:
            data = self.zf.read(info)
        except PtFormatError:
            raise
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, RuntimeError, NotImplementedError,
                OverflowError, struct.error, zlib.error, lzma.LZMAError) as e:
            raise self.fail(f"cannot read record {name}: {type(e).__name__}: {e}") from None
        if len(data) > cap:  # zipfile stops at the declared size; this only guards that
            raise self.fail(f"record {name} is larger than it declares")
        self.read_budget -= len(data)
        return data

    def storage(self, pid) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise self.fail(f"unsupported persistent id {_describe(pid)}")
        stype, key, numel = pid[1], pid[2], pid[4]
        if not (isinstance(stype, _StorageType) and self.storage_types.get(stype.name) is stype):
            raise self.fail(f"persistent id names {_describe(stype)}, not a torch storage class")
        if not isinstance(key, str) or not re.fullmatch(r"[0-9A-Za-z_]{1,64}", key):
            raise self.fail(f"bad storage key {_describe(key)}")
        if not _is_int(numel) or not 0 <= numel <= _MAX_DIM:
            raise self.fail(f"bad element count {_describe(numel)} of storage data/{key}")
        dtype = _STORAGE_DTYPES[stype.name]
        cached = self.storages.get(key)
        if cached is not None:
            if cached.name != stype.name or cached.array.size != numel:
                raise self.fail(f"storage data/{key} is named twice with different types or sizes")
            return cached
        name = f"{self.prefix}data/{key}"
        try:
            declared = self.zf.getinfo(name).file_size
        except KeyError:
            raise self.fail(f"storage record data/{key} is missing") from None
        if declared < numel * dtype.itemsize:
            raise self.fail(f"storage data/{key} has {declared} bytes, needs {numel * dtype.itemsize}")
        raw = self.read(name)
        if len(raw) < numel * dtype.itemsize:
            raise self.fail(f"storage data/{key} has {len(raw)} bytes, needs {numel * dtype.itemsize}")
        arr = np.frombuffer(raw, dtype=dtype, count=numel)
        if self.big_endian and dtype.itemsize > 1:
            arr = arr.byteswap()
        st = _Storage(stype.name, arr)
        self.storages[key] = st
        return st

    def rebuild_tensor(self, storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
        """torch._utils._rebuild_tensor_v2: a view of a storage, checked in full and copied."""
        if not isinstance(storage, _Storage):
            raise self.fail("malformed .pt file: a tensor is not backed by a storage record")
        if not (_is_int(storage_offset) and isinstance(size, tuple) and isinstance(stride, tuple)):
            raise self.fail("malformed .pt file: bad tensor offset, size or stride")
        if len(size) != len(stride) or len(size) > _MAX_NDIM:
            raise self.fail(f"malformed .pt file: a tensor has {len(size)} sizes and {len(stride)} strides "
                            f"(at most {_MAX_NDIM} dimensions)")
        if not all(_is_int(v) and 0 <= v <= _MAX_DIM for v in size + stride + (storage_offset,)):
            raise self.fail("malformed .pt file: tensor offset, sizes and strides must be integers in "
                            f"[0, 2^48]; got offset {_describe(storage_offset)}, size {_describe(size)}, "
                            f"stride {_describe(stride)}")
        base = storage.array
        numel = math.prod(size)
        if storage_offset > base.size:
            raise self.fail(f"malformed .pt file: tensor offset {storage_offset} is past its storage of "
                            f"{base.size} elements")
        if numel:
            # Every dimension at its largest index: the furthest element the view reads.
            last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride))
            if last >= base.size:
                raise self.fail(f"malformed .pt file: tensor view of {list(size)} with strides {list(stride)} at "
                                f"offset {storage_offset} runs past its storage of {base.size} elements")
            if numel > base.size:
                raise self.fail(f"tensor view of {list(size)} with strides {list(stride)} has {numel} elements, "
                                f"more than its storage's {base.size} (stride 0 or overlapping strides: "
                                "expanded tensors are not read; save tensor.contiguous())")
        nbytes = numel * base.itemsize * (2 if storage.name == "BFloat16Storage" else 1)
        if nbytes > self.array_budget:
            raise self.fail(f"tensors of this file exceed the cap of {self.max_bytes} bytes "
                            "(load(..., max_bytes=N) raises it)")
        self.array_budget -= nbytes
        if numel == 0:
            out = np.zeros(size, dtype=base.dtype)
        else:
            item = base.itemsize
            view = np.lib.stride_tricks.as_strided(base[storage_offset:], shape=size,
                                                   strides=tuple(st * item for st in stride), writeable=False)
            out = np.array(view)  # own the data, C order
        if storage.name == "BFloat16Storage":
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return out


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    if not isinstance(data, np.ndarray):
        raise _Malformed("malformed .pt file: a parameter does not hold a tensor")
    return data


def _ordered_dict(*args):
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, dict))):
        raise _Malformed("malformed .pt file: bad OrderedDict arguments")
    return OrderedDict(*args)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the load's own allow-listed globals; persistent ids become storages."""

    def __init__(self, data: bytes, state: _Load):
        super().__init__(io.BytesIO(data))
        self._state = state

    def find_class(self, module, name):
        fn = self._state.globals.get((module, name))
        if fn is None:
            raise self._state.fail(f"refusing to load pickle global {_clip(module)}.{_clip(name)} "
                                   "(only tensors and dicts of tensors are read)")
        return fn

    def persistent_load(self, pid):
        return self._state.storage(pid)


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_opcodes(data: bytes, state: _Load) -> None:
    """Walks the pickle's opcodes (pickletools, which never reads past the record or makes
    an object) before the C unpickler runs them, for what that unpickler would allocate
    from a number in the file without looking at the file's size: its memo table grows to
    twice the largest PUT index (an 11-byte LONG_BINPUT 10^8 filled 1.5 GB; 2*10^9 raised
    MemoryError), and a BINBYTES8 / BYTEARRAY8 is allocated at its declared length before
    it is read (2^40: MemoryError). Here a memo index must be at most the number of memo
    writes before it (a pickler numbers them 0, 1, 2, ...), every length must fit in the
    record (pickletools checks that as it reads), and so must a FRAME."""
    n_memo = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name in _MEMO_PUTS:
                if not 0 <= arg <= n_memo:
                    raise state.fail(f"malformed pickle in .pt file: memo index {_describe(arg)} at byte {pos} "
                                     f"after {n_memo} memo entries")
                n_memo += 1
            elif name == "MEMOIZE":
                n_memo += 1
            elif name == "FRAME" and arg > len(data) - pos - 9:
                raise state.fail(f"malformed pickle in .pt file: a frame of {arg} bytes at byte {pos} runs past "
                                 f"the {len(data)}-byte record")
    except PtFormatError:
        raise
    except (ValueError, TypeError, OverflowError, struct.error, UnicodeError) as e:
        raise state.fail(f"malformed pickle in .pt file: {type(e).__name__}: {str(e)[:200]}") from None


def load(source: Union[str, os.PathLike, BinaryIO], *, max_bytes: Optional[int] = None) -> Any:
    """Reads a torch.save archive (a path or a binary file object); tensors become numpy
    arrays. Never executes pickle code. At most `max_bytes` (default DEFAULT_MAX_BYTES)
    are read out of the archive, and at most as many again in the arrays made; the pickle
    record is at most MAX_PICKLE_BYTES. Raises PtFormatError (a ValueError) for anything
    malformed, refused or over the cap; OSError when the path cannot be read."""
    cap = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
    if cap < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if isinstance(source, (str, bytes, os.PathLike)):
        where = os.fsdecode(source)
        with open(source, "rb") as f:
            return _load_file(f, where, cap)
    return _load_file(source, getattr(source, "name", None) or "<stream>", cap)


def _load_file(f: BinaryIO, where: str, cap: int) -> Any:
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, OverflowError,
            struct.error, NotImplementedError, UnicodeError) as e:
        try:
            f.seek(0)
            head = f.read(1)
        except (OSError, ValueError):
            head = b""
        if head == b"\x80":
            raise PtFormatError(f"{where}: legacy (pre-1.6, non-zip) torch.save format is not supported; "
                                "re-save it with a current torch") from None
        raise PtFormatError(f"{where}: not a PyTorch .pt file (not a readable zip archive: {e})") from None
    with zf:
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("data.pkl") and n.count("/") <= 1]
        if len(pkls) != 1:
            raise PtFormatError(f"{where}: not a PyTorch .pt file (expected one <name>/data.pkl, found {len(pkls)})")
        prefix = pkls[0][: -len("data.pkl")]
        state = _Load(zf, prefix, where, cap)
        data = state.read(pkls[0], limit=MAX_PICKLE_BYTES)
        if f"{prefix}byteorder" in names:
            order = state.read(f"{prefix}byteorder", limit=64).decode(errors="replace").strip()
            if order not in ("little", "big"):
                raise state.fail(f"bad byteorder record {_describe(order)}")
            state.big_endian = order == "big"
        _check_opcodes(data, state)
        try:
            return _RestrictedUnpickler(data, state).load()
        except PtFormatError:
            raise
        except _Malformed as e:
            raise state.fail(str(e)) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
                OverflowError, struct.error, UnicodeError, RecursionError) as e:
            raise state.fail(f"malformed pickle in .pt file: {type(e).__name__}: {str(e)[:200]}") from None


def load_tensor(path, *, max_bytes: Optional[int] = None) -> np.ndarray:
    obj = load(path, max_bytes=max_bytes)
    if not isinstance(obj, np.ndarray):
        raise PtFormatError(f"{_where(path)}: expected one tensor, found {type(obj).__name__}")
    return obj


def load_state_dict(path, *, max_bytes: Optional[int] = None) -> Dict[str, np.ndarray]:
    obj = load(path, max_bytes=max_bytes)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()):
        raise PtFormatError(f"{_where(path)}: expected a state dict (str -> tensor)")
    return dict(obj)


def _where(source) -> str:
    if isinstance(source, (str, bytes, os.PathLike)):
        return os.fsdecode(source)
    return getattr(source, "name", None) or "<stream>"


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
