"""atheris target: powerinfer_py.formats.pt_io.load on untrusted bytes.

Promise under test (pt_io's docstring): any input either loads or raises PtFormatError
(a ValueError); never another exception, a hang, or arrays beyond the load's max_bytes.
Also checked after every input: a known-good file still reads the same, so no input can
change how a later file is read (the per-load globals of pt_io).

Input layout: tests/fuzz/py/common.py (the first byte picks a whole archive or a data.pkl
inside a fixed valid archive, the cap, byte order and compression). pt_io, zipfile and
pickletools (pt_io's opcode check) are instrumented for coverage; the C unpickler
(_pickle) is not, so the envelope mode and the dictionary (tests/fuzz/py/pt_io.dict) do
the work for pickle opcodes.

Run through scripts/fuzz_py.sh; by hand:
    .venv/bin/python tests/fuzz/py/fuzz_pt_io.py -max_total_time=60 build-fuzz/py/corpus/pt_io
"""

from __future__ import annotations

import io
import pickletools
import sys
import tempfile
import zipfile
from pathlib import Path

import atheris
import numpy as np

import common  # puts the repository on sys.path

from powerinfer_py.formats import pt_io  # noqa: E402

common.instrument_modules(pt_io, zipfile, pickletools)

_GOOD_VALUE = {"w": np.array([1.5, -2.0, 3.25], np.float32), "n": np.arange(5, dtype=np.int64)}


def _good_archive() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "good.pt"
        pt_io.save(_GOOD_VALUE, p)
        return p.read_bytes()


GOOD = _good_archive()

_ALLOWED_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray)


def _check_result(obj, cap: int) -> None:
    """What a load returned: arrays within the cap, nothing stranger than pickle builtins
    and pt_io's own frozen objects; walked without recursion (a pickle can nest deeply)."""
    seen = set()
    stack = [obj]
    array_bytes = 0
    visited = 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        visited += 1
        if isinstance(o, np.ndarray):
            if o.dtype.hasobject:
                raise AssertionError(f"pt_io.load returned an object array {o.dtype}")
            array_bytes += o.nbytes
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, pt_io._Frozen) or isinstance(o, _ALLOWED_LEAVES):
            pass
        else:
            raise AssertionError(f"pt_io.load returned an unexpected {type(o).__module__}.{type(o).__qualname__}")
    if array_bytes > cap:
        raise AssertionError(f"pt_io.load made {array_bytes} bytes of arrays under max_bytes={cap}")


def _check_good_file() -> None:
    got = pt_io.load(io.BytesIO(GOOD))
    if (set(got) != set(_GOOD_VALUE) or any(got[k].dtype != v.dtype or got[k].tolist() != v.tolist()
                                            for k, v in _GOOD_VALUE.items())):
        raise AssertionError(f"a known-good file reads differently after the last input: {got!r}")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    flags, payload = data[0], data[1:]
    archive = common.pt_envelope(payload, flags) if flags & common.PT_ENVELOPE else payload
    cap = common.pt_cap(flags)
    reader = pt_io.load_state_dict if flags & common.PT_STATE_DICT else pt_io.load
    try:
        obj = reader(io.BytesIO(archive), max_bytes=cap)
    except pt_io.PtFormatError:
        pass
    else:
        _check_result(obj, cap)
    _check_good_file()


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
