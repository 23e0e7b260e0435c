"""Seed corpora for the Python fuzzers (tests/fuzz/py), made at run time: scripts/fuzz_py.sh
runs `python tests/fuzz/py/make_seeds.py OUT_DIR` and gets OUT_DIR/pt_io and
OUT_DIR/tokenizer. Nothing binary is kept in the repository. Layouts: common.py.

- pt_io: archives written by pt_io.save (tensors of every dtype it writes, state dicts, an
  empty and a 0-d tensor); tests/test_pt_io.py's crafted files (strided views, bf16,
  views past their storage, stride 0, a pickle calling os.system, BUILD on an allow-listed
  name); broken archives (a flipped CRC, an unknown compression method, a bare end
  record, a legacy pickle, deflate/bzip2/lzma/zip64 records); and the same pickles again
  as envelope-mode inputs that fit common.ENVELOPE_STORAGES.
- tokenizer: texts (ASCII, multilingual, emoji, chat markup with special tokens, invalid
  UTF-8) for tokenize, id lists in every id mode for detokenize and token_to_piece, chat
  conversations.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import sys
import tempfile
import zipfile
from pathlib import Path

import common  # noqa: F401  (puts the repository and tests/ on sys.path)

import numpy as np  # noqa: E402

from powerinfer_py.formats import pt_io  # noqa: E402


def _saved(obj) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "seed.pt"
        pt_io.save(obj, p)
        return p.read_bytes()


def _zip(records, method=zipfile.ZIP_STORED, zip64=False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for name, data in records.items():
            if zip64:
                with zf.open(name, "w", force_zip64=True) as f:
                    f.write(data)
            else:
                zf.writestr(name, data)
    return buf.getvalue()


def _crafted_pickles():
    """(pickle, storages) pairs: test_pt_io.py's crafted tensors and attacks."""
    import test_pt_io as tp  # its pickle helpers (_tensor_pickle, _pstr)

    data = np.arange(6, dtype=np.float32).tobytes()
    yield tp._tensor_pickle(numel=6, size=(2, 3), stride=(3, 1)), {"0": data}
    yield tp._tensor_pickle(numel=6, offset=1, size=(2, 2), stride=(1, 2)), {"0": data}
    yield tp._tensor_pickle(numel=4, size=(2, 2), stride=(5, 1)), {"0": data}  # runs past
    yield tp._tensor_pickle(numel=4, size=(1 << 25,), stride=(0,)), {"0": data}  # stride 0
    yield tp._tensor_pickle(numel=4, size=(0, 1 << 40), stride=(1, 1)), {"0": data}  # empty
    yield tp._tensor_pickle(storage="BFloat16Storage", numel=3, size=(3,)), {"0": data}
    yield tp._tensor_pickle(storage="BoolStorage", numel=6, size=(6,)), {"0": bytes([0, 1, 2, 0, 1, 255])}
    yield tp._tensor_pickle(numel=1 << 40, size=(4,)), {"0": data}
    three = b"\x80\x02(" + tp._tensor_pickle(numel=4, size=(4,))[2:-1] * 3 + b"l."
    yield three, {"0": data}
    yield pickle.dumps({"fc1.weight": tp._Evil("/nonexistent/pwned")}, protocol=2), {}
    yield pickle.dumps(tp._Evil("/nonexistent/pwned"), protocol=4), {}
    yield b"\x80\x02ctorch\nFloatStorage\n}" + tp._pstr("name") + tp._pstr("IntStorage") + b"sb.", {}
    yield b"\x80\x02ccollections\nOrderedDict\n}" + tp._pstr("x") + b"K\x01sb.", {}
    yield b"\x80\x02(" + b"(" * 200 + b"t" * 200 + b"l.", {}
    yield pickle.dumps([1, 2.5, "x", b"y", None, True, {"a": (1, 2)}], protocol=2), {}
    yield pickle.dumps({"a": [1, 2]}, protocol=5), {}


def pt_io_seeds():
    rng = np.random.default_rng(7)
    objs = [np.arange(24, dtype=np.int64), np.zeros(0, np.float32), np.array(3.5, np.float64),
            {"fc1.weight": rng.standard_normal((3, 8)).astype(np.float32), "fc2.weight": np.ones((5, 3), np.float16)},
            {f"k{i}": (np.arange(i + 1) % 3).astype(dt) for i, dt in enumerate(
                (np.float32, np.float64, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_))}]
    for obj in objs:
        yield bytes([0]) + _saved(obj)
    for pkl, storages in _crafted_pickles():
        records = {"archive/data.pkl": pkl, "archive/byteorder": b"little"}
        records.update({f"archive/data/{k}": v for k, v in storages.items()})
        yield bytes([0]) + _zip(records)
    # broken and unusual archives
    good = bytearray(_saved(np.arange(64, dtype=np.float32)))
    i = good.index(np.arange(64, dtype=np.float32).tobytes()) + 10
    good[i] ^= 0xFF
    yield bytes([0]) + bytes(good)  # CRC mismatch
    odd = bytearray(_zip({"archive/data.pkl": b"\x80\x02N.", "archive/data/0": bytes(16)}))
    for sig, off in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        pos = odd.rindex(sig)
        odd[pos + off:pos + off + 2] = (99).to_bytes(2, "little")
    yield bytes([0]) + bytes(odd)  # unknown compression method
    yield bytes([0]) + b"PK\x05\x06" + bytes(18)
    yield bytes([0]) + pickle.dumps([1, 2])  # legacy format
    yield bytes([0]) + b"not a zip at all"
    tensor = {"archive/data.pkl": _crafted_tensor(), "archive/data/0": np.arange(4, dtype=np.float32).tobytes(),
              "archive/byteorder": b"big"}
    for method in (zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        yield bytes([0]) + _zip(tensor, method)
    yield bytes([0]) + _zip(tensor, zip64=True)
    # envelope mode: pickles naming the envelope's storages
    import test_pt_io as tp

    for flags in (0x01, 0x09, 0x21, 0x41, 0x13, 0x81):
        yield bytes([flags]) + tp._tensor_pickle(numel=16, size=(4, 4), stride=(4, 1))
    yield bytes([0x01]) + tp._tensor_pickle(storage="LongStorage", key="0", numel=8, size=(2, 4), stride=(1, 2))
    yield bytes([0x01]) + tp._tensor_pickle(storage="HalfStorage", key="1", numel=8, offset=2, size=(3,), stride=(2,))
    yield bytes([0x01]) + tp._tensor_pickle(storage="ByteStorage", key="2", numel=1, size=(1,), stride=(1,))
    yield bytes([0x01]) + tp._tensor_pickle(storage="BoolStorage", key="3", numel=0, size=(0,), stride=(1,))
    yield bytes([0x05]) + tp._tensor_pickle(storage="DoubleStorage", key="4", numel=512, size=(512,), stride=(1,))
    yield bytes([0x01]) + tp._tensor_pickle(storage="BFloat16Storage", key="1", numel=8, size=(2, 4), stride=(4, 1))
    sd = (b"\x80\x02ccollections\nOrderedDict\n)R(" + tp._pstr("fc1.weight")
          + tp._tensor_pickle(storage="IntStorage", key="0", numel=16, size=(4, 4), stride=(4, 1))[2:-1]
          + tp._pstr("fc2.weight")
          + tp._tensor_pickle(storage="ShortStorage", key="1", numel=8, size=(8,), stride=(1,))[2:-1] + b"u.")
    yield bytes([0x81]) + sd
    yield bytes([0x01]) + b"\x80\x02" + b"(" + tp._tensor_pickle(key="0", numel=16, size=(16,))[2:-1] * 2 + b"l."
    for pkl, _ in _crafted_pickles():
        yield bytes([0x01]) + pkl


def _crafted_tensor() -> bytes:
    import test_pt_io as tp

    return tp._tensor_pickle(numel=4, size=(2, 2), stride=(2, 1))


def tokenizer_seeds():
    texts = [b"", b"Hello world", b"  leading spaces and\ttabs\n\nnewlines", "naïve café – “quotes” 日本語 한국어 עברית".encode(),
             "emoji 🦙🔥 and ZWJ 👩‍💻".encode(), b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
             b"<|endoftext|>text<|endoftext|>", b"\xff\xfe\x80abc", b"\xe2\x80", b"\xf0\x9f\xa6", b"\xed\xa0\x80",
             b"\xc0\x80", b"x" * 300, b"1234567890 3.14159 0xdeadbeef", b"def f(x):\n    return x**2\n",
             "\u0000\u0001\u007f\u00ad\u200b\ufeff".encode()]
    for text in texts:
        for flags in (0x00, 0x04, 0x08, 0x0C, 0x18, 0x28, 0x3C):
            yield bytes([flags]) + text
    ids = [0, 1, 2, 17, 198, 4093, 6004, 49151]
    for mode in range(4):
        base = 0x10 * mode
        if mode == 2:
            payload = struct.pack(f"<{len(ids) + 3}i", *ids, -1, 49152, -(2**31))
        else:
            payload = struct.pack(f"<{len(ids)}H", *ids)
        for op in (1, 2):
            yield bytes([op | base]) + payload
            yield bytes([op | base | 0x04 | 0x40]) + payload
    chats = [b"\x00You are terse.\x00\x01Hello!\x00\x02Hi.\x00\x01Bye <|im_end|>",
             b"\x01What is 2+2?", "\x01日本語で\x00\x02はい".encode(), b"\x02starts with the assistant"]
    for c in chats:
        yield bytes([0x03]) + c


def write(folder: Path, blobs) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for blob in blobs:
        (folder / hashlib.sha1(blob).hexdigest()).write_bytes(blob)
        n += 1
    return n


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: make_seeds.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    os.makedirs(out, exist_ok=True)
    print(f"make_seeds (py): {write(out / 'pt_io', pt_io_seeds())} pt_io seeds, "
          f"{write(out / 'tokenizer', tokenizer_seeds())} tokenizer seeds in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
