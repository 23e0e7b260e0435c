"""cffi (ABI mode) bindings to libpowerinfer, generated from the public header.

The declarations are read at import time from the block of powerinfer.h between
``// POWERINFER_CDEF_BEGIN`` and ``// POWERINFER_CDEF_END``, so this module never
drifts from the C contract. ``lib`` exposes every declared function one to one;
the helpers below only convert C strings and status codes.

This is the bottom of powerinfer_py._core, the one layer that calls ``lib``: the rest
of the package goes through the owned handles (Model, Context, Sampler) and errors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional

import cffi

__all__ = [
    "ffi",
    "lib",
    "header_path",
    "library_path",
    "last_error",
    "last_status",
    "version",
    "system_info",
    "kernel_level",
    "kernel_levels",
    "set_kernel_level",
    "string",
    "set_log_level",
]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # powerinfer_py/
_REPO_DIR = _PACKAGE_DIR.parent

_CDEF_BEGIN = "// POWERINFER_CDEF_BEGIN"
_CDEF_END = "// POWERINFER_CDEF_END"

_BUILD_HINT = (
    "Build it with `pip install --no-build-isolation -e .` from the repository root "
    "(or `cmake -S . -B build && cmake --build build`), or point the "
    "POWERINFER_LIB environment variable at libpowerinfer.so."
)


def _first_existing(candidates: List[Path]) -> Optional[Path]:
    for path in candidates:
        if path.is_file():
            return path
    return None


def header_path() -> Path:
    """Location of powerinfer.h: installed next to the package, else the source tree."""
    candidates = [
        _PACKAGE_DIR / "include" / "powerinfer.h",
        _REPO_DIR / "src" / "powerinfer_c" / "include" / "powerinfer.h",
    ]
    found = _first_existing(candidates)
    if found is None:
        raise ImportError(
            "powerinfer.h not found; looked in: "
            + ", ".join(str(p) for p in candidates)
            + ". "
            + _BUILD_HINT
        )
    return found


def library_path() -> Path:
    """Location of libpowerinfer: $POWERINFER_LIB, next to the package, else build/lib."""
    env = os.environ.get("POWERINFER_LIB")
    if env:
        path = Path(env)
        if not path.is_file():
            raise ImportError(f"POWERINFER_LIB={env!r} does not name a file. " + _BUILD_HINT)
        return path
    candidates = [
        _PACKAGE_DIR / "lib" / "libpowerinfer.so",
        _REPO_DIR / "build" / "lib" / "libpowerinfer.so",
    ]
    found = _first_existing(candidates)
    if found is None:
        raise ImportError(
            "libpowerinfer.so not found; looked in: "
            + ", ".join(str(p) for p in candidates)
            + ". "
            + _BUILD_HINT
        )
    return found


def _cdef_source(header_text: str) -> str:
    """The cffi-parsable part of the header: the marked block, without the export
    macro and `//` comments (cffi's parser accepts neither)."""
    try:
        start = header_text.index(_CDEF_BEGIN) + len(_CDEF_BEGIN)
        end = header_text.index(_CDEF_END, start)
    except ValueError:
        raise ImportError(
            f"powerinfer.h lacks the {_CDEF_BEGIN} / {_CDEF_END} markers"
        ) from None
    block = header_text[start:end]
    block = block.replace("POWERINFER_API ", "")
    block = re.sub(r"//[^\n]*", "", block)
    return block


ffi = cffi.FFI()
ffi.cdef(_cdef_source(header_path().read_text(encoding="utf-8")))

try:
    lib = ffi.dlopen(str(library_path()))
except OSError as e:  # found but not loadable (missing libggml/libllama, wrong arch, ...)
    raise ImportError(f"cannot load libpowerinfer: {e}. " + _BUILD_HINT) from e


def string(ptr) -> str:
    """A `const char *` returned by the core as str ("" for NULL)."""
    if ptr == ffi.NULL:
        return ""
    return ffi.string(ptr).decode("utf-8", errors="replace")


def last_error() -> str:
    """Message of the last failed core call on this thread ("" if none)."""
    return string(lib.powerinfer_last_error())


def last_status() -> int:
    """Status (POWERINFER_ERR_*) of the last failed call on this thread, 0 if none."""
    return int(lib.powerinfer_last_status())


def version() -> str:
    return string(lib.powerinfer_version())


def system_info() -> str:
    return string(lib.powerinfer_system_info())


def kernel_level() -> str:
    """The ISA level the sparse kernels run at here: "avx512", "avxvnni", "avx2", "dotprod"
    or "scalar" (chosen from the CPU's features, or by POWERINFER_KERNELS)."""
    return string(lib.powerinfer_kernel_level())


def kernel_levels() -> list:
    """The levels this library has and this CPU runs, best first."""
    return [s for s in string(lib.powerinfer_kernel_levels()).split(",") if s]


def set_kernel_level(level: str) -> None:
    """Runs the kernels at `level` from now on (models loaded afterwards); ValueError when this
    CPU cannot run it or the library lacks it."""
    if not lib.powerinfer_set_kernel_level(level.encode()):
        raise ValueError(f"kernel level {level!r} is not available here (this CPU runs: {', '.join(kernel_levels())})")


def set_log_level(verbose: bool) -> None:
    """Messages of the core, ggml and libllama on stderr: INFO and above, or none."""
    lib.powerinfer_log_set_level(lib.POWERINFER_LOG_INFO if verbose else lib.POWERINFER_LOG_NONE)
