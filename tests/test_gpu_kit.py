"""The offline GPU kit (scripts/gpu_kit.sh, scripts/kit_tools.py, scripts/gpu_check.sh
--offline): its helpers on small made-up inputs, the check's refusals, and a kit made
here when there is one (gpu-kit/ is git-ignored; building it takes a CUDA build, so CI
does not)."""

from __future__ import annotations

import importlib.util
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

_spec = importlib.util.spec_from_file_location("kit_tools", SCRIPTS / "kit_tools.py")
kit_tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kit_tools)


def _wheel(path: Path, files: dict, name="demo", requires=()) -> Path:
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{name}-1.0.dist-info/METADATA", meta)
    return path


def test_site_stores_each_library_once(tmp_path):
    lib = b"\x7fELF" + bytes(range(256)) * 40
    other = b"\x7fELF" + b"other" * 100
    whl = _wheel(tmp_path / "llama.whl", {
        "lib/libggml-base.so": lib, "lib/libggml-base.so.0": lib, "lib/libggml-base.so.0.25.3": lib,
        "llama_cpp/lib/libggml-base.so": lib, "llama_cpp/lib/libggml-base.so.0.25.3": lib,
        "lib/libllama.so.0.5.0": other, "llama_cpp/lib/libllama.so": other,
        "llama_cpp/__init__.py": b"__version__ = '1.0'\n", "include/ggml.h": b"/* h */\n"})
    dest = tmp_path / "site"
    counts = kit_tools.unpack_site(whl, dest)
    assert counts["libraries"] == 2 and counts["links"] == 5
    real = [p for p in dest.rglob("*.so*") if not p.is_symlink()]
    assert sorted(p.relative_to(dest).as_posix() for p in real) == ["lib/libggml-base.so.0.25.3", "lib/libllama.so.0.5.0"]
    # Every name still reads the same bytes, through relative links (the folder can move).
    for name in ("lib/libggml-base.so", "lib/libggml-base.so.0", "llama_cpp/lib/libggml-base.so"):
        assert (dest / name).is_symlink() and not Path((dest / name).readlink()).is_absolute()
        assert (dest / name).read_bytes() == lib
    assert (dest / "llama_cpp/lib/libllama.so").read_bytes() == other
    assert (dest / "include/ggml.h").read_bytes() == b"/* h */\n"


def test_site_refuses_a_member_outside_the_folder(tmp_path):
    whl = _wheel(tmp_path / "bad.whl", {"../escape.txt": b"x"})
    with pytest.raises(SystemExit, match="unsafe member"):
        kit_tools.unpack_site(whl, tmp_path / "site")
    assert not (tmp_path / "escape.txt").exists()


def test_closure_finds_what_neither_the_kit_nor_the_machine_has(tmp_path):
    wheels = [
        _wheel(tmp_path / "cffi.whl", {}, "cffi", ['pycparser; implementation_name != "PyPy"']),
        _wheel(tmp_path / "pycparser.whl", {}, "pycparser"),
        _wheel(tmp_path / "gguf.whl", {}, "gguf", ["numpy>=1.17", "PyYAML>=5.1", "tqdm>=4.27",
                                                    'PySide6<7,>=6.9; extra == "gui"']),
        _wheel(tmp_path / "old.whl", {}, "old", ['tomli; python_version < "3.11"', "missing_pkg>=2"]),
    ]
    missing = kit_tools.closure(wheels, ["numpy", "pyyaml", "tqdm"])
    # pycparser is in the kit, PyYAML/pyyaml name the same package, extras and markers false
    # on CPython 3.12 are not requirements.
    assert missing == ["old.whl needs missing_pkg>=2"]
    assert kit_tools.closure(wheels[:3], ["numpy", "pyyaml"]) == ["gguf.whl needs tqdm>=4.27"]


def test_manifest_catches_truncated_corrupt_missing_and_extra_files(tmp_path):
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    (kit / "a.bin").write_bytes(b"a" * 1000)
    (kit / "wheels" / "w.whl").write_bytes(b"w" * 10)
    assert "MANIFEST is missing" in kit_tools.verify(kit)[0]
    assert kit_tools.write_manifest(kit) == 2
    assert kit_tools.verify(kit) == []
    (kit / "a.bin").write_bytes(b"a" * 999)
    assert any("999 bytes" in p and "truncated" in p for p in kit_tools.verify(kit))
    (kit / "a.bin").write_bytes(b"b" + b"a" * 999)
    assert any("sha256 differs" in p for p in kit_tools.verify(kit))
    (kit / "a.bin").write_bytes(b"a" * 1000)
    (kit / "stray.txt").write_text("x")
    (kit / "wheels" / "w.whl").unlink()
    problems = kit_tools.verify(kit)
    assert any(p.startswith("stray.txt: not in the manifest") for p in problems)
    assert any(p.startswith("wheels/w.whl: missing") for p in problems)


def _gpu_check(*args, cwd=ROOT, env=None):
    return subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def test_gpu_check_offline_refuses_what_is_not_a_kit(tmp_path, monkeypatch):
    import os
    import sys

    env = {**os.environ, "OUT": str(tmp_path / "out"), "PI_KIT_PYTHON": sys.executable}
    p = _gpu_check("--offline", str(tmp_path / "nope"), env=env)
    assert p.returncode != 0 and "is not a folder" in p.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "libggml-cuda.so.xz").write_bytes(b"\xfd7zXZ")
    p = _gpu_check("--offline", str(tmp_path / "half"), env=env)
    assert p.returncode != 0 and "MANIFEST is missing" in p.stderr
    assert not (tmp_path / "out" / "build.log").exists()  # nothing was installed or built
    p = _gpu_check("--offline", env=env)
    assert p.returncode != 0 and "needs the kit folder" in p.stderr


KIT = ROOT / "gpu-kit"


@pytest.mark.skipif(not (KIT / "MANIFEST").is_file(), reason="no gpu-kit/ here (scripts/gpu_kit.sh makes it)")
def test_the_kit_made_here_is_whole_and_fits():
    assert kit_tools.verify(KIT) == []
    assert kit_tools.kit_size(KIT) <= 60 * 2**20
    assert kit_tools.closure(sorted((KIT / "wheels").glob("*.whl")),
                             ["numpy", "pyyaml", "requests", "tqdm", "jinja2", "markupsafe", "typing-extensions"]) == []
    names = {p.name for p in KIT.iterdir()}
    assert {"libggml-cuda.so.xz", "llama-cpp-python-site.tar.xz", "ggml-backend-impl.h", "info.txt"} <= names
