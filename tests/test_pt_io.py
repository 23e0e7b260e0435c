"""powerinfer_py.formats.pt_io: .pt archives read and written without torch and without running pickle code."""

import io
import os
import pickle
import zipfile

import numpy as np
import pytest

from powerinfer_py.formats import pt_io


def test_round_trip_tensor_and_state_dict(tmp_path):
    a = np.arange(24, dtype=np.int64)
    pt_io.save(a, tmp_path / "a.pt")
    np.testing.assert_array_equal(pt_io.load_tensor(tmp_path / "a.pt"), a)
    sd = {"fc1.weight": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32),
          "fc2.weight": np.ones((5, 3), np.float16)}
    pt_io.save(sd, tmp_path / "m.pt")
    back = pt_io.load_state_dict(tmp_path / "m.pt")
    assert list(back) == ["fc1.weight", "fc2.weight"]
    for k in sd:
        assert back[k].dtype == sd[k].dtype
        np.testing.assert_array_equal(back[k], sd[k])
    with zipfile.ZipFile(tmp_path / "m.pt") as zf:  # records start on 64-byte boundaries, as torch writes them
        for info in zf.infolist():
            assert (info.header_offset + 30 + len(info.filename) + len(info.extra)) % 64 == 0


def test_torch_reads_our_files_and_we_read_torch_files(tmp_path):
    torch = pytest.importorskip("torch")
    pt_io.save(np.array([3, 1, 2], dtype=np.int64), tmp_path / "c.pt")
    t = torch.load(tmp_path / "c.pt", weights_only=True)
    assert t.tolist() == [3, 1, 2] and t.dtype == torch.int64
    sd = {"fc1.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "fc2.weight": np.ones((4, 2), np.float32)}
    pt_io.save(sd, tmp_path / "model_0.pt")
    back = torch.load(tmp_path / "model_0.pt", weights_only=True)
    assert back["fc1.weight"].tolist() == sd["fc1.weight"].tolist() and back["fc2.weight"].shape == (4, 2)
    # torch's own files: a transposed (strided) view, bf16, a Linear state dict
    torch.save({"w": torch.arange(10.0).reshape(2, 5).t(), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
                "s": torch.arange(10, dtype=torch.int32)[2:5]}, tmp_path / "t.pt")
    got = pt_io.load(tmp_path / "t.pt")
    np.testing.assert_array_equal(got["w"], np.arange(10.0).reshape(2, 5).T)
    np.testing.assert_array_equal(got["b"], [1.5, -2.0])
    np.testing.assert_array_equal(got["s"], [2, 3, 4])


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pt_with_pickle(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")


def test_pickle_payload_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    _pt_with_pickle(path, pickle.dumps({"fc1.weight": _Evil(marker)}, protocol=2))
    with pytest.raises(ValueError, match="refusing to load pickle global (posix|os).system"):
        pt_io.load(path)
    assert not marker.exists()
    # protocol 4 (STACK_GLOBAL) and a builtin eval payload go through the same gate
    _pt_with_pickle(path, pickle.dumps(_Evil(marker), protocol=4))
    with pytest.raises(ValueError, match="refusing"):
        pt_io.load(path)
    assert not marker.exists()


def test_malformed_files(tmp_path):
    p = tmp_path / "x.pt"
    p.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="not a PyTorch"):
        pt_io.load(p)
    p.write_bytes(pickle.dumps([1, 2]))  # legacy format starts with a pickle
    with pytest.raises(ValueError, match="legacy"):
        pt_io.load(p)
    # a view running past its storage
    pt_io.save(np.arange(4, dtype=np.float32), p)
    with zipfile.ZipFile(p) as zf:
        pkl = zf.read("x/data.pkl")
    bad = pkl.replace(b"K\x04\x85", b"K\x09\x85") if b"K\x04\x85" in pkl else pkl.replace(b"(K\x04t", b"(K\x09t")
    assert bad != pkl
    _pt_with_pickle(p, bad)
    with pytest.raises(ValueError):
        pt_io.load(p)


def test_activation_dir_numeric_order_and_checks(tmp_path):
    counts = [np.full(8, i, dtype=np.int64) for i in range(12)]
    pt_io.write_activation_dir(tmp_path, counts)
    got = pt_io.read_activation_dir(tmp_path)
    assert [int(c[0]) for c in got] == list(range(12))  # activation_10 after activation_9, not after activation_1
    assert len(pt_io.read_activation_dir(tmp_path, n_layer=12)) == 12
    with pytest.raises(ValueError, match="beyond"):
        pt_io.read_activation_dir(tmp_path, n_layer=11)
    with pytest.raises(ValueError, match=r"missing .* layer\(s\) \[12"):
        pt_io.read_activation_dir(tmp_path, n_layer=13)
    os.remove(tmp_path / "activation_5.pt")
    with pytest.raises(ValueError, match=r"missing .* \[5\]"):
        pt_io.read_activation_dir(tmp_path)
    pt_io.save(np.zeros(9, np.int64), tmp_path / "activation_5.pt")
    with pytest.raises(ValueError, match="9 neurons"):
        pt_io.read_activation_dir(tmp_path)


def test_predictor_dir(tmp_path):
    rng = np.random.default_rng(1)
    layers = [(rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((10, 4)).astype(np.float32)),
              (rng.standard_normal((2, 6)).astype(np.float32), rng.standard_normal((10, 2)).astype(np.float32))]
    pt_io.write_predictor_dir(tmp_path, layers, sparse_threshold=-0.5)
    back = pt_io.read_predictor_dir(tmp_path, n_layer=2)
    for (a, b), (c, d) in zip(layers, back):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    pt_io.save({"fc1.weight": layers[0][0]}, tmp_path / "model_1.pt")
    with pytest.raises(ValueError, match="lacks fc2.weight"):
        pt_io.read_predictor_dir(tmp_path)


# ---------------------------------------------------------------- crafted files (issue 12, item 4)
# Small pickle writer for crafted tensors: the opcodes torch.save emits, with any offset,
# size, stride and element count.

def _pstr(s: str) -> bytes:
    b = s.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


def _pint(v: int) -> bytes:
    b = v.to_bytes((v.bit_length() + 8) // 8 or 1, "little", signed=True)
    return b"\x8a" + bytes([len(b)]) + b  # LONG1: any size


def _ptuple(vals) -> bytes:
    return b"(" + b"".join(_pint(v) for v in vals) + b"t"


def _tensor_pickle(storage="FloatStorage", key="0", numel=4, offset=0, size=(4,), stride=(1,)) -> bytes:
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + b"(" + _pstr("storage") + b"ctorch\n"
            + storage.encode() + b"\n" + _pstr(key) + _pstr("cpu") + _pint(numel) + b"tQ" + _pint(offset)
            + _ptuple(size) + _ptuple(stride) + b"\x89" + b"ccollections\nOrderedDict\n)R" + b"tR.")


def _pt(path, pkl: bytes, records=None, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compress) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        for key, data in (records or {}).items():
            zf.writestr(f"archive/data/{key}", data)
    return path


def test_tensor_pickle_helper_reads_back(tmp_path):
    data = np.arange(6, dtype=np.float32)
    p = _pt(tmp_path / "ok.pt", _tensor_pickle(numel=6, size=(2, 3), stride=(3, 1)), {"0": data.tobytes()})
    np.testing.assert_array_equal(pt_io.load(p), data.reshape(2, 3))
    p = _pt(tmp_path / "t.pt", _tensor_pickle(numel=6, offset=1, size=(2, 2), stride=(1, 2)), {"0": data.tobytes()})
    np.testing.assert_array_equal(pt_io.load(p), [[1, 3], [2, 4]])  # a transposed view at an offset


def test_build_cannot_poison_later_loads(tmp_path):
    """A pickle BUILD on an allow-listed name is refused, and cannot change how the next file
    is read (a 168-byte file used to rename FloatStorage to IntStorage for the whole process)."""
    good = tmp_path / "good.pt"
    pt_io.save(np.array([1.5, -2.0, 3.25], np.float32), good)
    rename = b"\x80\x02ctorch\nFloatStorage\n}" + _pstr("name") + _pstr("IntStorage") + b"sb."
    slot_state = b"\x80\x02ctorch\nFloatStorage\nN}" + _pstr("name") + _pstr("IntStorage") + b"s\x86b."
    defaults = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}" + _pstr("__defaults__") + b"(\x88t" + b"s\x86b.")
    od = b"\x80\x02ccollections\nOrderedDict\n}" + _pstr("x") + b"K\x01sb."
    for i, pkl in enumerate([rename, slot_state, defaults, od]):
        p = _pt(tmp_path / f"evil{i}.pt", pkl)
        with pytest.raises(pt_io.PtFormatError, match=r"evil\d\.pt: .*refusing to set state"):
            pt_io.load(p)
        got = pt_io.load(good)
        assert got.dtype == np.float32 and got.tolist() == [1.5, -2.0, 3.25]


def test_each_load_has_its_own_globals(tmp_path):
    """What find_class hands out is made per load: no object a pickle can name outlives it."""
    seen = []
    orig = pt_io._RestrictedUnpickler.find_class

    def spy(self, module, name):
        obj = orig(self, module, name)
        seen.append(obj)
        return obj

    p = tmp_path / "a.pt"
    pt_io.save({"w": np.ones(2, np.float32)}, p)
    pt_io._RestrictedUnpickler.find_class = spy
    try:
        pt_io.load(p)
        first = list(seen)
        seen.clear()
        pt_io.load(p)
    finally:
        pt_io._RestrictedUnpickler.find_class = orig
    assert first and seen and not {id(o) for o in first} & {id(o) for o in seen}
    for obj in first:
        with pytest.raises(AttributeError):
            obj.name = "IntStorage"
        assert not hasattr(obj, "__dict__")


@pytest.mark.parametrize("offset,size,stride,why", [
    (0, (1 << 25,), (0,), "more than its storage"),  # stride 0: one float -> 128 MiB
    (0, (1 << 20, 1 << 20), (0, 0), "more than its storage"),  # 4 TiB
    (0, (2, 3), (1, 1), "more than its storage"),  # overlapping rows
    (0, (1 << 62, 4), (1, 1), "integers in"),  # sizes whose int64 product wraps to 0
    (0, (1 << 31, 1 << 31, 4), (0, 0, 0), "more than its storage"),  # product 2^64 wraps to 0 in numpy
    (0, (2, 2), (5, 1), "runs past"),  # the first dimension's last row is past the end
    (3, (2,), (1,), "runs past"),
    (9, (0,), (1,), "offset 9 is past"),
    (-1, (1,), (1,), "integers in"),
    (0, (-2,), (1,), "integers in"),
    (0, (2,), (-1,), "integers in"),
    (0, (1,) * 65, (1,) * 65, "at most 64 dimensions"),
])
def test_views_checked_in_full(tmp_path, offset, size, stride, why):
    p = _pt(tmp_path / "v.pt", _tensor_pickle(numel=4, offset=offset, size=size, stride=stride),
            {"0": np.arange(4, dtype=np.float32).tobytes()})
    with pytest.raises(pt_io.PtFormatError, match=why):
        pt_io.load(p)


def test_storage_numel_checked_against_the_record(tmp_path):
    p = _pt(tmp_path / "n.pt", _tensor_pickle(numel=1 << 40, size=(4,)), {"0": b"\0" * 16})
    with pytest.raises(pt_io.PtFormatError, match="has 16 bytes, needs"):
        pt_io.load(p)
    p = _pt(tmp_path / "n.pt", _tensor_pickle(numel=1 << 60, size=(4,)), {"0": b"\0" * 16})
    with pytest.raises(pt_io.PtFormatError, match="bad element count"):
        pt_io.load(p)


def test_size_caps(tmp_path):
    # A deflated record: 16 MiB of zeros in a ~16 KiB file. Refused from its declared
    # size before anything is decompressed; read with a cap that allows it.
    n = 4 << 20
    p = _pt(tmp_path / "bomb.pt", _tensor_pickle(numel=n, size=(n,)), {"0": bytes(4 * n)}, zipfile.ZIP_DEFLATED)
    assert p.stat().st_size < 64 << 10
    with pytest.raises(pt_io.PtFormatError, match=r"data/0 holds 16777216 bytes, over the cap"):
        pt_io.load(p, max_bytes=1 << 20)
    assert pt_io.load(p, max_bytes=64 << 20).shape == (n,)
    # The arrays made count too: the same 4 MiB storage viewed by 3 tensors.
    n = 1 << 20
    three = (b"\x80\x02(" + _tensor_pickle(numel=n, size=(n,))[2:-1] * 3 + b"l.")
    p = _pt(tmp_path / "three.pt", three, {"0": bytes(4 * n)})
    assert len(pt_io.load(p, max_bytes=16 << 20)) == 3
    with pytest.raises(pt_io.PtFormatError, match="tensors of this file exceed the cap"):
        pt_io.load(p, max_bytes=10 << 20)
    # The pickle record has its own cap.
    big = _pt(tmp_path / "pkl.pt", b"\x80\x02N" + b"0N" * (pt_io.MAX_PICKLE_BYTES // 2) + b".", None,
              zipfile.ZIP_DEFLATED)
    with pytest.raises(pt_io.PtFormatError, match="data.pkl holds .* over the cap"):
        pt_io.load(big)


def test_broken_archives_raise_pt_format_error(tmp_path):
    good = tmp_path / "g.pt"
    pt_io.save(np.arange(64, dtype=np.float32), good)
    raw = bytearray(good.read_bytes())
    # a flipped data byte: the CRC check fails inside zipfile (BadZipFile, not a ValueError)
    idx = raw.index(np.arange(64, dtype=np.float32).tobytes()) + 10
    raw[idx] ^= 0xFF
    (tmp_path / "crc.pt").write_bytes(bytes(raw))
    with pytest.raises(pt_io.PtFormatError, match="cannot read record"):
        pt_io.load(tmp_path / "crc.pt")
    # an unknown compression method on the data record (NotImplementedError inside zipfile)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", _tensor_pickle())
        zf.writestr("archive/data/0", bytes(16))
    raw = bytearray(buf.getvalue())
    for sig, off in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):  # the method field of the last local/central header
        pos = raw.rindex(sig)
        raw[pos + off:pos + off + 2] = (99).to_bytes(2, "little")
    with pytest.raises(pt_io.PtFormatError):
        pt_io.load(io.BytesIO(bytes(raw)))
    # a file object works like a path
    assert pt_io.load(io.BytesIO(good.read_bytes())).shape == (64,)
    with pytest.raises(pt_io.PtFormatError, match="not a PyTorch"):
        pt_io.load(io.BytesIO(b"PK\x05\x06" + bytes(18)))


# ---------------------------------------------------------------- found by tests/fuzz/py/fuzz_pt_io.py
# CPython's C unpickler allocates from numbers in the pickle before it reads the data they
# describe: pt_io now walks the opcodes first (pickletools), so these raise PtFormatError
# at once instead of a MemoryError or gigabytes of memory.

@pytest.mark.parametrize("pkl,why", [
    (b"\x80\x02Nr\x00\xe1\xf5\x05.", "memo index 100000000"),  # LONG_BINPUT 10^8: 1.5 GB, 2.5 s, then None
    (b"\x80\x02Nr\x00\x00\x00\x70.", "memo index 1879048192"),  # LONG_BINPUT ~2^31: MemoryError
    (b"\x80\x02Np99999999999\n.", "memo index 99999999999"),  # text PUT
    (b"\x80\x02Nq\x00q\x02.", r"memo index 2 at byte 5 after 1"),  # skips an index no pickler skips
    (b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b".", "bytes8"),  # BINBYTES8 2^40: MemoryError
    (b"\x80\x05\x96" + (12 << 30).to_bytes(8, "little") + b".", "bytearray8"),  # BYTEARRAY8 12 GiB
    (b"\x80\x04\x95" + (255).to_bytes(8, "little") + b"N.", "a frame of 255 bytes"),
    (b"\x80\x02\xff.", "malformed pickle"),  # an opcode pickletools does not know
])
def test_pickle_numbers_checked_before_unpickling(tmp_path, pkl, why):
    p = _pt(tmp_path / "m.pt", pkl)
    with pytest.raises(pt_io.PtFormatError, match=why):
        pt_io.load(p)


def test_memo_as_picklers_write_it_still_reads(tmp_path):
    """Memo writes numbered 0, 1, 2, ... (BINPUT, LONG_BINPUT, MEMOIZE) and reads of them load."""
    a = np.arange(4, dtype=np.float32)
    for protocol in (2, 4):
        shared = [1, 2]
        pkl = pickle.dumps({"x": shared, "y": shared, "z": [shared] * 3}, protocol=protocol)
        got = pt_io.load(_pt(tmp_path / f"p{protocol}.pt", pkl))
        assert got == {"x": [1, 2], "y": [1, 2], "z": [[1, 2]] * 3} and got["x"] is got["y"]
    big = b"\x80\x02" + b"N0" * 300 + b"Nr\x00\x00\x00\x00r\x01\x00\x00\x00q\x02h\x01."  # LONG_BINPUT 0, 1
    assert pt_io.load(_pt(tmp_path / "long.pt", big)) is None
    pt_io.save({"w": a, "v": a[::-1].copy()}, tmp_path / "s.pt")
    np.testing.assert_array_equal(pt_io.load_state_dict(tmp_path / "s.pt")["v"], a[::-1])
