"""Files the core reads are untrusted, and PowerInfer's own files interoperate (issue 12).

Crafted files are packed byte by byte here (the `gguf` package cannot write the PWRI
magic, PowerInfer's old type codes or wrapped offsets):

- the gpuidx placement cache (`<model>.generated.gpuidx`, read automatically from beside
  the model): offsets that wrap around 2^64 (defect 1), PowerInfer's I32 type code 18 on
  read and on write (defect 9), empty `gpu_bucket` tensors (defect 10), buckets that
  disagree with gpu_idx, files for another model shape;
- PWRI model headers: counts checked against the bytes present before anything is
  allocated, a linear duplicate-name check, tensor offsets that wrap (defect 3);
- the pre-tokenizer of PowerInfer's Falcon files, which carry no tokenizer.ggml.pre
  (defect 12), against llama.cpp's own tokenizer fixture.

A bad cache is never an error: the core solves the placement again. A bad model file is
a ValueError with the reason, never a crash.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest

from powerinfer_py import Llama
from powerinfer_py.assets.synthetic import PRESETS, generate

GGUF_U32, GGUF_STRING, GGUF_U64 = 4, 8, 10
I32_POWERINFER, I32_GGML = 18, 26  # PowerInfer's ggml (late 2023) numbers I32 18; ggml today 26
ALIGN = 32
BUDGET_GIB = 1.0  # with the device emulated, the tiny model's every neuron fits


# ---- packing and unpacking GGUF-layout bytes -------------------------------------------


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, kind: int, value) -> bytes:
    if kind == GGUF_STRING:
        return _s(key) + struct.pack("<I", kind) + _s(value)
    return _s(key) + struct.pack("<I", kind) + struct.pack("<I" if kind == GGUF_U32 else "<Q", value)


def _pad(n: int) -> int:
    return -n % ALIGN


def pack_gguf(kvs: Sequence[bytes], tensors: Sequence[Tuple[str, int, Sequence[int], bytes]],
              offsets: Optional[Sequence[int]] = None, magic: bytes = b"PWRI", alignment: int = ALIGN) -> bytes:
    """GGUF v3 as PowerInfer's gguf-py writes it: header, key/value pairs, tensor infos
    (name, dims fastest first, type code, offset), padding, each tensor's data padded to
    `alignment` (a general.alignment key, when not 32, is the caller's). `offsets`
    overrides the infos' offsets (crafted files)."""
    head = magic + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    infos, data, off = b"", b"", 0
    for i, (name, code, dims, payload) in enumerate(tensors):
        o = off if offsets is None else offsets[i]
        infos += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", code, o)
        data += payload + b"\0" * (-len(payload) % alignment)
        off += len(payload) + (-len(payload) % alignment)
    body = head + b"".join(kvs) + infos
    return body + b"\0" * (-len(body) % alignment) + data


def read_gguf(blob: bytes):
    """(key/values, [(name, type code, dims, offset)], data offset) of a GGUF-layout file
    holding u32, u64 and string values only (what gpuidx files hold)."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", blob, 8)

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, blob, pos)
        pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def take_s():
        nonlocal pos
        n = take("<Q")
        pos += n
        return blob[pos - n : pos].decode()

    kvs = {}
    for _ in range(n_kv):
        key, kind = take_s(), take("<I")
        kvs[key] = take_s() if kind == GGUF_STRING else take({GGUF_U32: "<I", GGUF_U64: "<Q"}[kind])
    infos = []
    for _ in range(n_tensors):
        name, n_dims = take_s(), take("<I")
        dims = [take("<Q") for _ in range(n_dims)]
        infos.append((name, take("<I"), dims, take("<Q")))
    return kvs, infos, pos + _pad(pos)


def powerinfer_gpuidx(hot: Sequence[np.ndarray], n_ff: int, capacity: int, code: int = I32_POWERINFER,
                      extra_kvs: Sequence[bytes] = ()) -> bytes:
    """A gpuidx file laid out as PowerInfer's export_split.py writes it (checked once, byte
    for byte, against its gguf-py): general.architecture, block_count, split.vram_capacity;
    blk.N.gpu_idx (I32[n_ff]) and blk.N.gpu_bucket (I32[k], ascending; ne = [0] when empty)."""
    tensors = []
    for il, ids in enumerate(hot):
        idx = np.zeros(n_ff, dtype="<i4")
        idx[np.asarray(ids, dtype=int)] = 1
        bucket = np.sort(np.asarray(ids, dtype="<i4"))
        tensors += [(f"blk.{il}.gpu_idx", code, [n_ff], idx.tobytes()),
                    (f"blk.{il}.gpu_bucket", code, [len(bucket)], bucket.tobytes())]
    kvs = [_kv("general.architecture", GGUF_STRING, "generic.gpu_index"),
           _kv("generic.gpu_index.block_count", GGUF_U32, len(hot)),
           _kv("split.vram_capacity", GGUF_U64, capacity), *extra_kvs]
    return pack_gguf(kvs, tensors)


# ---- the model and its placement ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("untrusted")
    path = Path(generate(PRESETS["tiny"], out, progress=False)["powerinfer"])
    spec = PRESETS["tiny"]
    return {"path": path, "n_layer": spec.n_layer, "n_ff": spec.n_ff}


def _load(path, **kw):
    return Llama(model_path=str(path), n_ctx=256, n_batch=32, n_threads=2, sparse_mode="predictor",
                 vram_budget=BUDGET_GIB, emulate_device=True, verbose=False, **kw)


def _placed(path, **kw) -> Tuple[bool, List[np.ndarray]]:
    """(sets came from the cache, hot neurons per layer) after loading `path`."""
    llm = _load(path, **kw)
    try:
        p = llm.placement()
        assert p["active"]
        n_layer = int(llm.metadata[f"{llm.metadata['general.architecture']}.block_count"])
        return p["from_cache"], [np.asarray(llm.hot_neurons(il)) for il in range(n_layer)]
    finally:
        llm.close()


@pytest.fixture()
def model_copy(tiny, tmp_path):
    """A copy of the tiny model and the capacity the core computes for BUDGET_GIB (read
    from the cache it writes): a crafted cache with that capacity is reused."""
    path = tmp_path / "m.powerinfer.gguf"
    path.write_bytes(tiny["path"].read_bytes())
    cached, _ = _placed(path, reset_gpu_index=True)
    assert not cached
    idx = Path(str(path) + ".generated.gpuidx")
    kvs, _, _ = read_gguf(idx.read_bytes())
    return path, idx, kvs["split.vram_capacity"]


def _some_sets(n_layer, n_ff, empty_layer: Optional[int] = None) -> List[np.ndarray]:
    rng = np.random.default_rng(5)
    sets = [np.sort(rng.choice(n_ff, size=n_ff // 3, replace=False)) for _ in range(n_layer)]
    if empty_layer is not None:
        sets[empty_layer] = np.array([], dtype=int)
    return sets


# ---- gpuidx: PowerInfer's files and ours (defects 9, 10) ------------------------------


@pytest.mark.parametrize("code,empty", [(I32_POWERINFER, False), (I32_POWERINFER, True), (I32_GGML, True), (I32_GGML, False)],
                         ids=["powerinfer-i32", "powerinfer-i32-empty-bucket", "ggml-i32-empty-bucket", "ggml-i32"])
def test_powerinfer_gpuidx_is_reused(tiny, model_copy, code, empty):
    """A file in PowerInfer's layout is reused as is: its I32 as code 18 (PowerInfer) or 26
    (ggml today), and a layer without device neurons as an empty bucket, ne = [0]."""
    path, idx, capacity = model_copy
    sets = _some_sets(tiny["n_layer"], tiny["n_ff"], empty_layer=0 if empty else None)
    idx.write_bytes(powerinfer_gpuidx(sets, tiny["n_ff"], capacity, code=code))
    cached, hot = _placed(path)
    assert cached, "the PowerInfer-layout cache was not reused"
    for il, want in enumerate(sets):
        np.testing.assert_array_equal(hot[il], want)


def test_our_gpuidx_is_powerinfer_layout(tiny, model_copy):
    """The file we write is, byte for byte, what PowerInfer's exporter writes for the same
    sets and capacity (I32 as code 18, empty buckets ne = [0], tensors 2N and 2N + 1),
    plus our three keys naming the model file."""
    path, idx, capacity = model_copy
    sets = _some_sets(tiny["n_layer"], tiny["n_ff"], empty_layer=1)
    idx.write_bytes(powerinfer_gpuidx(sets, tiny["n_ff"], capacity))
    # Solved again and rewritten by the core.
    cached, hot = _placed(path, reset_gpu_index=True)
    assert not cached
    blob = idx.read_bytes()
    kvs, infos, _ = read_gguf(blob)
    assert blob[:8] == b"PWRI" + struct.pack("<I", 3)
    assert [i[0] for i in infos] == [f"blk.{il}.{t}" for il in range(tiny["n_layer"]) for t in ("gpu_idx", "gpu_bucket")]
    assert {i[1] for i in infos} == {I32_POWERINFER}
    st = path.stat()
    ours = [_kv("powerinfer.gpuidx.model_size", GGUF_U64, st.st_size),
            _kv("powerinfer.gpuidx.model_mtime_ns", GGUF_U64, st.st_mtime_ns),
            _kv("powerinfer.gpuidx.n_ff", GGUF_U32, tiny["n_ff"])]
    assert blob == powerinfer_gpuidx(hot, tiny["n_ff"], kvs["split.vram_capacity"], extra_kvs=ours)
    # and an empty layer is written as PowerInfer does
    sets = [np.array([], dtype=int)] + hot[1:]
    idx.write_bytes(powerinfer_gpuidx(sets, tiny["n_ff"], capacity))
    cached, hot2 = _placed(path)
    assert cached and len(hot2[0]) == 0


def test_gpuidx_wrapped_offset_is_rejected_without_crashing(tiny, model_copy):
    """Defect 1: gpu_idx's offset chosen so that data_offset + offset + nbytes wraps past
    2^64 to a small number. The old bounds check passed and the read started ~n_ff * 2^42
    bytes before the buffer (a segfault); now the file is refused and the placement solved."""
    path, idx, capacity = model_copy
    n_ff, n_layer = tiny["n_ff"], tiny["n_layer"]
    sets = _some_sets(n_layer, n_ff)
    # blk.0.gpu_idx as I32[n_ff, 1, 1, 2^40]: nbytes = n_ff * 4 * 2^40, and offset = -(data_offset + nbytes).
    nbytes = n_ff * 4 * (1 << 40)
    tensors = []
    for il, ids in enumerate(sets):
        gpu_idx = np.zeros(n_ff, dtype="<i4")
        gpu_idx[ids] = 1
        dims = [n_ff, 1, 1, 1 << 40] if il == 0 else [n_ff]
        tensors += [(f"blk.{il}.gpu_idx", I32_GGML, dims, gpu_idx.tobytes()),
                    (f"blk.{il}.gpu_bucket", I32_GGML, [len(ids)], np.asarray(ids, dtype="<i4").tobytes())]
    kvs = [_kv("general.architecture", GGUF_STRING, "generic.gpu_index"),
           _kv("generic.gpu_index.block_count", GGUF_U32, n_layer),
           _kv("split.vram_capacity", GGUF_U64, capacity)]
    offsets = []
    off = 0
    for _, _, _, payload in tensors:
        offsets.append(off)
        off += len(payload) + _pad(len(payload))
    _, _, data_offset = read_gguf(pack_gguf(kvs, tensors, offsets=offsets))  # the offsets' values do not move it
    offsets[0] = (-(data_offset + nbytes)) % (1 << 64)
    assert offsets[0] % ALIGN == 0
    crafted = pack_gguf(kvs, tensors, offsets=offsets)
    idx.write_bytes(crafted)
    # In a child process: the old reader died of SIGSEGV here.
    code = textwrap.dedent(f"""
        from powerinfer_py import Llama
        llm = Llama(model_path={str(path)!r}, n_ctx=256, n_batch=32, n_threads=2, sparse_mode="predictor",
                    vram_budget={BUDGET_GIB}, emulate_device=True, verbose=False)
        print("from_cache", llm.placement()["from_cache"])
        llm.close()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    assert "from_cache False" in r.stdout


@pytest.mark.parametrize("case", ["bucket names other neurons", "bucket too short", "another layer count",
                                  "another n_ff", "gpu_idx not 0/1", "truncated"])
def test_inconsistent_gpuidx_is_not_reused(tiny, model_copy, case):
    path, idx, capacity = model_copy
    n_ff, n_layer = tiny["n_ff"], tiny["n_layer"]
    sets = _some_sets(n_layer, n_ff)
    blob = bytearray(powerinfer_gpuidx(sets, n_ff, capacity, code=I32_GGML))
    _, infos, data_offset = read_gguf(bytes(blob))
    off = {name: data_offset + o for name, _, _, o in infos}
    if case == "bucket names other neurons":
        struct.pack_into("<i", blob, off["blk.1.gpu_bucket"], int(np.setdiff1d(np.arange(n_ff), sets[1])[0]))
    elif case == "bucket too short":
        blob = bytearray(powerinfer_gpuidx(sets[:1] + [sets[1][:-1]] + sets[2:], n_ff, capacity, code=I32_GGML))
        _, infos, data_offset = read_gguf(bytes(blob))
        struct.pack_into("<i", blob, data_offset + dict((n, o) for n, _, _, o in infos)["blk.1.gpu_idx"] + 4 * int(sets[1][-1]), 1)
    elif case == "another layer count":
        blob = bytearray(powerinfer_gpuidx(sets + [sets[0]], n_ff, capacity, code=I32_GGML))
    elif case == "another n_ff":
        blob = bytearray(powerinfer_gpuidx(sets, n_ff, capacity, code=I32_GGML,
                                           extra_kvs=[_kv("powerinfer.gpuidx.n_ff", GGUF_U32, n_ff * 2)]))
    elif case == "gpu_idx not 0/1":
        struct.pack_into("<i", blob, off["blk.0.gpu_idx"], 7)
    elif case == "truncated":
        blob = blob[: off["blk.1.gpu_idx"] + 8]
    idx.write_bytes(bytes(blob))
    cached, _ = _placed(path)
    assert not cached


# ---- PWRI model headers (defect 3) -------------------------------------------------------


ARCH = _kv("general.architecture", GGUF_STRING, "llama")


def _expect_refused(tmp_path, blob: bytes, pattern: str, name="bad.powerinfer.gguf"):
    path = tmp_path / name
    path.write_bytes(blob)
    with pytest.raises(ValueError, match=pattern):
        Llama(model_path=str(path), vocab_only=True, fallback=False, verbose=False)


def test_counts_are_checked_against_the_file_before_allocating(tmp_path):
    """A 100-byte file announcing 60000 tensors: refused from the count, before the tensor
    list is allocated (the old reader allocated 60000 infos first, then found the end)."""
    head = b"PWRI" + struct.pack("<IQQ", 3, 60000, 1) + ARCH
    _expect_refused(tmp_path, head + b"\0" * 40, r"header announces .*60000 tensors")
    head = b"PWRI" + struct.pack("<IQQ", 3, 0, 16000) + ARCH
    _expect_refused(tmp_path, head + b"\0" * 40, r"header announces 16000 key/value pairs")


def test_duplicate_names_are_found_in_linear_time(tmp_path):
    """65536 tensors (the cap) with distinct names, all pointing at the same 32 bytes: the
    old pairwise check made ~2*10^9 name comparisons (5.7 s here on one core); a hash set
    takes ~0.03 s."""
    n = 65536
    infos = b"".join(_s(f"blk.{i}.x") + struct.pack("<IQIQ", 1, 32, 0, 0) for i in range(n))  # F32[32] at 0
    body = b"PWRI" + struct.pack("<IQQ", 3, n, 1) + ARCH + infos
    blob = body + b"\0" * _pad(len(body)) + b"\0" * 128
    t0 = time.perf_counter()
    # The header reads; the model then lacks its hyper-parameters.
    path = tmp_path / "many.powerinfer.gguf"
    path.write_bytes(blob)
    with pytest.raises(ValueError):
        Llama(model_path=str(path), fallback=False, verbose=False)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.5, f"{elapsed:.2f} s to read {n} tensor names"
    # and a duplicate among them is still found
    dup = infos + _s("blk.777.x") + struct.pack("<IQIQ", 1, 32, 0, 0)
    body = b"PWRI" + struct.pack("<IQQ", 3, n + 1, 1) + ARCH + dup
    _expect_refused(tmp_path, body + b"\0" * _pad(len(body)) + b"\0" * 128, "implausible")
    dup = b"".join(_s(f"blk.{i}.x") + struct.pack("<IQIQ", 1, 32, 0, 0) for i in (1, 2, 3, 2))
    body = b"PWRI" + struct.pack("<IQQ", 3, 4, 1) + ARCH + dup
    _expect_refused(tmp_path, body + b"\0" * _pad(len(body)) + b"\0" * 128, "'blk.2.x' appears twice")


def test_wrapping_tensor_offset_is_refused(tmp_path):
    """A tensor whose offset wraps data_offset + offset around 2^64: its data is outside the
    file, whatever the sum says (the old loader placed it over the header's bytes)."""
    body = b"PWRI" + struct.pack("<IQQ", 3, 1, 1) + ARCH
    info = _s("t") + struct.pack("<IQ", 1, 8) + struct.pack("<IQ", 0, 0)
    data_offset = len(body) + len(info) + _pad(len(body) + len(info))
    info = _s("t") + struct.pack("<IQ", 1, 8) + struct.pack("<IQ", 0, (1 << 64) - data_offset)
    blob = body + info + b"\0" * _pad(len(body) + len(info)) + b"\0" * 64
    _expect_refused(tmp_path, blob, "truncated")


# ---- Falcon's pre-tokenizer (defect 12) -----------------------------------------------


def _vocab_fixture(name: str) -> Path:
    from powerinfer_py.assets.models import llama_cpp_sdist_dir

    p = Path(llama_cpp_sdist_dir()) / f"ggml-vocab-{name}.gguf"
    if not (p.is_file() and p.with_name(p.name + ".inp").is_file()):
        pytest.skip(f"llama.cpp's tokenizer fixture {p.name} is not available")
    return p


def _read_cases(vocab: Path) -> List[Tuple[str, List[int]]]:
    """The fixture's (text, expected ids) pairs, split as llama.cpp's test-tokenizer-0 does."""
    sep = "\n__ggml_vocab_test__\n"
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(sep)
    if texts and texts[-1] == "" and raw.endswith(sep):
        texts.pop()
    lines = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines)
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def test_powerinfer_falcon_file_tokenizes_like_falcon(tmp_path):
    """PowerInfer's converter writes no tokenizer.ggml.pre; a PWRI Falcon file must still
    split text with Falcon's pre-tokenizer: llama.cpp's falcon fixture, key removed."""
    import gguf

    src = _vocab_fixture("falcon")
    reader = gguf.GGUFReader(str(src))
    assert reader.fields["general.architecture"].contents() == "falcon"
    out = tmp_path / "falcon-vocab.powerinfer.gguf"
    writer = gguf.GGUFWriter(str(out), "falcon")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "tokenizer.ggml.pre"):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(f.name, f.contents())
        else:
            writer.add_key_value(f.name, f.contents(), vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blob = bytearray(out.read_bytes())
    blob[:4] = b"PWRI"
    out.write_bytes(bytes(blob))

    llm = Llama(model_path=str(out), vocab_only=True, fallback=False, verbose=False)
    try:
        assert "tokenizer.ggml.pre" not in llm.metadata
        cases = _read_cases(src)
        bad = [(t, llm.tokenize(t.encode(), add_bos=False, special=False), want) for t, want in cases
               if llm.tokenize(t.encode(), add_bos=False, special=False) != want]
        assert not bad, f"{len(bad)}/{len(cases)} differ, e.g. " + "; ".join(f"{t!r}: {g} != {w}" for t, g, w in bad[:3])
        # the example, against llama-cpp-python on the fixture (which names falcon)
        import llama_cpp

        ref = llama_cpp.Llama(model_path=str(src), vocab_only=True, verbose=False)
        try:
            for text in (b" 1234", b"3333333", b"Hello 1234 world 12"):
                assert llm.tokenize(text, add_bos=False) == ref.tokenize(text, add_bos=False), text
        finally:
            ref.close()
    finally:
        llm.close()
