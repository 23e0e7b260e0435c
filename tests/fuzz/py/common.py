"""What the Python fuzz targets (tests/fuzz/py/fuzz_*.py) and their seed maker share.

The targets run under atheris (libFuzzer for Python): scripts/fuzz_py.sh starts each as
`python tests/fuzz/py/fuzz_<target>.py [libFuzzer flags] CORPUS SEEDS`. This module needs
neither atheris nor numpy (so the seed maker and the tests can import it anywhere) and
imports zipfile only when used (fuzz_pt_io instruments zipfile as it first imports it).

Input layouts (the first byte selects the mode, the rest is the payload):

fuzz_pt_io (powerinfer_py.formats.pt_io.load):
    bit 0     0: the payload is a whole archive; 1: the payload is the data.pkl record of
              a fixed, valid archive (ENVELOPE_STORAGES as data/<key>), so mutations
              reach the restricted unpickler instead of dying in zipfile
    bits 1-2  the load's max_bytes: PT_CAPS[i]
    bit 3     (envelope) byteorder record "big"
    bit 4     (envelope) no byteorder record
    bit 5     (envelope) records deflated instead of stored
    bit 6     (envelope) records at the top level instead of under archive/
    bit 7     load_state_dict() instead of load()

fuzz_tokenizer (Llama.tokenize / detokenize / token_to_piece, the chat template):
    bits 0-1  TOK_OPS[i]
    bit 2     add_bos (tokenize) or special (detokenize, token_to_piece)
    bit 3     special, i.e. parse special tokens (tokenize; the chat prompt is always
              tokenized with special=True)
    bits 4-5  detokenize / token_to_piece: how the payload becomes ids, ID_MODES[i];
              tokenize: 0 the payload alone, else the payload inside CARRIERS[i - 1]
              (the C++ tokenizer is not instrumented, so libFuzzer would keep only the
              shortest texts; a carrier puts every mutation amid realistic text)
    bit 6     append an id outside int32 (2^31 + n, or -2^31 - 1 - n)
"""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"
for _p in (ROOT, TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# ---------------------------------------------------------------- instrumentation

def instrument_modules(*modules) -> int:
    """Adds atheris coverage to every function and method defined in `modules`, after they
    are imported. atheris.instrument_imports() alone does not do it for powerinfer_py: the
    editable install imports it through its own loader, whose modules atheris reports as
    instrumented but leaves as they were (cov: 2 on the tokenizer target). Returns how
    many functions were instrumented."""
    import types

    import atheris

    done = set()

    def add(fn) -> None:
        while isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if isinstance(fn, property):
            for part in (fn.fget, fn.fset, fn.fdel):
                add(part)
            return
        if isinstance(fn, types.FunctionType) and id(fn) not in done:
            done.add(id(fn))
            atheris.instrument_func(fn)
            add(getattr(fn, "__wrapped__", None))  # the function under a functools.wraps decorator

    for mod in modules:
        for obj in list(vars(mod).values()):
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            if isinstance(obj, type):
                for attr in list(vars(obj).values()):
                    add(attr)
            else:
                add(obj)
    return len(done)


# ---------------------------------------------------------------- pt_io

PT_ENVELOPE = 0x01
PT_BIG_ENDIAN = 0x08
PT_NO_BYTEORDER = 0x10
PT_DEFLATE = 0x20
PT_TOP_LEVEL = 0x40
PT_STATE_DICT = 0x80
PT_CAPS = (16 << 20, 1 << 16, 1024, 0)
"""max_bytes of a load, by bits 1-2. Small caps reach the budget checks; the largest keeps
a load's arrays well under the fuzzer's RSS limit."""

ENVELOPE_STORAGES: Dict[str, bytes] = {
    "0": bytes(range(64)),  # 16 float32 / 8 int64 / 64 uint8 ...
    "1": bytes(range(100, 116)),
    "2": b"\x07",
    "3": b"",
    "4": bytes((i * 37) & 0xFF for i in range(4096)),
}
"""The data/<key> records of the envelope (fuzz_pt_io mode 1): storages of several sizes
for the pickle's persistent ids to name."""


def pt_cap(flags: int) -> int:
    return PT_CAPS[(flags >> 1) & 3]


def pt_envelope(pkl: bytes, flags: int) -> bytes:
    """A torch.save-shaped zip archive holding `pkl` as its data.pkl and ENVELOPE_STORAGES."""
    import zipfile

    prefix = "" if flags & PT_TOP_LEVEL else "archive/"
    method = zipfile.ZIP_DEFLATED if flags & PT_DEFLATE else zipfile.ZIP_STORED
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        zf.writestr(prefix + "data.pkl", pkl)
        if not flags & PT_NO_BYTEORDER:
            zf.writestr(prefix + "byteorder", b"big" if flags & PT_BIG_ENDIAN else b"little")
        for key, data in ENVELOPE_STORAGES.items():
            zf.writestr(f"{prefix}data/{key}", data)
        zf.writestr(prefix + "version", b"3\n")
    return buf.getvalue()


# ---------------------------------------------------------------- tokenizer

TOK_OPS = ("tokenize", "detokenize", "token_to_piece", "chat")
TOK_ADD_BOS = 0x04  # also `special` of detokenize / token_to_piece
TOK_SPECIAL = 0x08
TOK_HUGE_ID = 0x40
ID_MODES = ("u16", "i16", "i32", "near_vocab_end")
"""u16: little-endian uint16 ids (3/4 of them inside a 49152-token vocabulary); i16: signed,
so half are negative; i32: any int32; near_vocab_end: uint16 - 32768 + n_vocab, half on
each side of the end of the vocabulary."""
MAX_IDS = 512
CARRIERS = (
    "Once upon a time, naïve café owners in 東京 wrote “smart quotes” — and emoji 🦙🔥👩‍💻.\n\n".encode(),
    b"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n",
    b"def f(x):\n\treturn x ** 2  # 0x1F, 3.14159, 1,000,000\r\n\n    if a != b: pass\n",
)


def tokenize_text(flags: int, payload: bytes) -> bytes:
    """The text a tokenize input stands for: the payload, or the payload in a carrier."""
    i = (flags >> 4) & 3
    if not i:
        return payload
    carrier = CARRIERS[i - 1]
    cut = len(carrier) // 2
    return carrier[:cut] + payload + carrier[cut:]


def token_ids(flags: int, payload: bytes, n_vocab: int) -> List[int]:
    """The ids a detokenize / token_to_piece input stands for (ID_MODES)."""
    mode = ID_MODES[(flags >> 4) & 3]
    if mode == "i32":
        n = min(len(payload) // 4, MAX_IDS)
        ids = list(struct.unpack(f"<{n}i", payload[: 4 * n]))
    else:
        n = min(len(payload) // 2, MAX_IDS)
        ids = list(struct.unpack(f"<{n}{'h' if mode == 'i16' else 'H'}", payload[: 2 * n]))
        if mode == "near_vocab_end":
            ids = [v - 32768 + n_vocab for v in ids]
    if flags & TOK_HUGE_ID:
        extra = payload[-1] if payload else 0
        ids.append(2**31 + extra if extra & 1 else -(2**31) - 1 - extra)
    return ids


def chat_messages(payload: bytes) -> List[dict]:
    """Messages for a chat template: NUL-separated parts, each a role byte then the content
    (utf-8, invalid bytes replaced, as a JSON request's strings would be)."""
    roles = ("system", "user", "assistant", "user")
    msgs = []
    for part in payload.split(b"\0")[:16]:
        role = roles[part[0] & 3] if part else "user"
        msgs.append({"role": role, "content": part[1:].decode("utf-8", errors="replace")})
    return msgs
