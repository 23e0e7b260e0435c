"""Seed corpora for the C fuzzers (tests/fuzz/c), generated at run time from the tests'
own crafted files: scripts/fuzz_c.sh runs `python tests/fuzz/make_seeds.py OUT_DIR` and
gets OUT_DIR/gguf and OUT_DIR/gpuidx. Nothing binary is kept in the repository.

- gguf: small well-formed PWRI files (every key/value type, several tensor types,
  alignments 32 and 64) and the malformed headers of tests/test_sparse_engine.py and
  tests/test_untrusted_files.py;
- gpuidx: PowerInfer-layout placement files (tests/test_untrusted_files.py's packer, byte
  for byte what PowerInfer's exporter writes) for 1-4 layers, I32 as code 18 and 26, empty
  buckets, our extra keys; each prefixed with the two bytes fuzz_gpuidx.c reads the model
  shape from.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import test_untrusted_files as tu  # noqa: E402  (the packers of the crafted test files)


def _kv_any(key: str, vtype: int, payload: bytes) -> bytes:
    return tu._s(key) + struct.pack("<I", vtype) + payload


def well_formed(alignment: int = 32) -> bytes:
    """A PWRI file with one key/value of every type and tensors of several types."""
    kvs = [
        tu._kv("general.architecture", tu.GGUF_STRING, "llama"),
        _kv_any("t.u8", 0, b"\x07"), _kv_any("t.i8", 1, b"\xf9"), _kv_any("t.u16", 2, struct.pack("<H", 700)),
        _kv_any("t.i16", 3, struct.pack("<h", -700)), tu._kv("llama.block_count", tu.GGUF_U32, 2),
        _kv_any("t.i32", 5, struct.pack("<i", -5)), _kv_any("powerinfer.sparse_threshold", 6, struct.pack("<f", 0.5)),
        _kv_any("t.bool", 7, b"\x01"), tu._kv("split.vram_capacity", tu.GGUF_U64, 1 << 33),
        _kv_any("t.i64", 11, struct.pack("<q", -1)), _kv_any("t.f64", 12, struct.pack("<d", 2.5)),
        _kv_any("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + tu._s("a") + tu._s("b") + tu._s("<s>")),
        _kv_any("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, -1, -2)),
        _kv_any("powerinfer.gate_thresholds", 9, struct.pack("<IQ", 6, 2) + struct.pack("<2f", 0.1, 0.2)),
    ]
    if alignment != 32:
        kvs.append(tu._kv("general.alignment", tu.GGUF_U32, alignment))
    rng = np.random.default_rng(alignment)
    tensors = [
        ("token_embd.weight", 0, [4, 3], rng.standard_normal(12).astype("<f4").tobytes()),
        ("blk.0.ffn_down_t.weight", 1, [8], rng.standard_normal(8).astype("<f2").tobytes()),
        ("blk.0.fc1.weight", 8, [32, 2], bytes(rng.integers(0, 255, 68, dtype=np.uint8))),  # Q8_0: 34 bytes a block
        ("blk.0.ffn_act_count", 26, [5], np.arange(5, dtype="<i4").tobytes()),
    ]
    return tu.pack_gguf(kvs, tensors, alignment=alignment)


def gguf_seeds():
    yield well_formed(32)
    yield well_formed(64)
    yield tu.pack_gguf([tu._kv("general.architecture", tu.GGUF_STRING, "falcon"),
                        tu._kv("tokenizer.ggml.model", tu.GGUF_STRING, "gpt2")], [])
    try:
        import test_sparse_engine as tse  # its MALFORMED table of crafted headers

        for blob, _ in tse.MALFORMED.values():
            yield blob
    except Exception as e:  # the seeds are a help, not a requirement
        print(f"make_seeds: no seeds from test_sparse_engine.py ({e})", file=sys.stderr)
    # test_untrusted_files.py's crafted headers
    arch = tu._kv("general.architecture", tu.GGUF_STRING, "llama")
    yield b"PWRI" + struct.pack("<IQQ", 3, 60000, 1) + arch + b"\0" * 40
    names = b"".join(tu._s(f"blk.{i}.x") + struct.pack("<IQIQ", 1, 32, 0, 0) for i in (1, 2, 3, 2))
    body = b"PWRI" + struct.pack("<IQQ", 3, 4, 1) + arch + names
    yield body + b"\0" * tu._pad(len(body)) + b"\0" * 128


def gpuidx_seeds():
    rng = np.random.default_rng(12)
    for n_layer in (1, 2, 3, 4):
        for n_ff in (16, 64, 256):
            for code in (tu.I32_POWERINFER, tu.I32_GGML):
                sets = [np.sort(rng.choice(n_ff, size=int(rng.integers(0, n_ff + 1)), replace=False))
                        for _ in range(n_layer)]
                sets[0] = np.array([], dtype=int)
                with_id = n_ff == 64
                extra = [tu._kv("powerinfer.gpuidx.model_size", tu.GGUF_U64, 123456),
                         tu._kv("powerinfer.gpuidx.model_mtime_ns", tu.GGUF_U64, 789),
                         tu._kv("powerinfer.gpuidx.n_ff", tu.GGUF_U32, n_ff)] if with_id else []
                blob = tu.powerinfer_gpuidx(sets, n_ff, 1 << 30, code=code, extra_kvs=extra)
                yield bytes([(n_layer - 1) | (4 if with_id else 0), n_ff - 1]) + blob


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
    print(f"make_seeds: {write(out / 'gguf', gguf_seeds())} gguf seeds, "
          f"{write(out / 'gpuidx', gpuidx_seeds())} gpuidx seeds in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
