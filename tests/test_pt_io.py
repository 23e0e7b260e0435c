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
