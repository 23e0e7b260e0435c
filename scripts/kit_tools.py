#!/usr/bin/env python3
"""Helpers of the offline GPU kit (scripts/gpu_kit.sh builds it here, scripts/gpu_check.sh
--offline uses it on a GPU machine with no network). Standard library only: it runs under
this machine's Python and under the GPU machine's bare Python 3.12 alike.

    kit_tools.py site WHEEL DEST         unpack a llama-cpp-python wheel as a site-packages
                                         folder, its shared libraries stored once
    kit_tools.py closure KIT PRESENT...  check that every wheel's run-time requirements are
                                         met by the kit's wheels or by PRESENT (names of
                                         packages the GPU machine already has)
    kit_tools.py manifest KIT            write KIT/MANIFEST (sha256 and size of every file)
    kit_tools.py verify KIT              check the files against KIT/MANIFEST
    kit_tools.py size KIT                print the kit's size in bytes and MiB
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

MANIFEST = "MANIFEST"


def _norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------- site
_SO_VERSION = re.compile(r"^(?P<stem>.+?\.so)(?P<ver>(\.\d+)*)$")


def unpack_site(wheel: Path, dest: Path) -> Dict[str, int]:
    """Unpack WHEEL under DEST. A wheel cannot hold symbolic links, so llama-cpp-python's
    stores each library three times (libX.so, libX.so.0, libX.so.0.25.3) in two folders
    (lib/ and llama_cpp/lib/): six copies of the same bytes. Keep the longest-versioned file
    of each library in lib/ and make every other name a relative link to it. Returns counts."""
    dest.mkdir(parents=True, exist_ok=True)
    libs: Dict[str, List[str]] = {}  # content sha256 -> names (paths inside the wheel)
    n_files = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            name = info.filename
            if ".." in Path(name).parts or name.startswith("/"):
                raise SystemExit(f"error: {wheel}: unsafe member name {name!r}")
            data = z.read(info)
            base = os.path.basename(name)
            if _SO_VERSION.match(base) and ".so" in base and (name.startswith("lib/") or "/lib/" in name):
                libs.setdefault(hashlib.sha256(data).hexdigest(), []).append(name)
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                out.chmod(mode)
            n_files += 1
    n_links = 0
    for names in libs.values():
        # The real file: in lib/ (where the CMake configs point), the longest name.
        names.sort(key=lambda n: (not n.startswith("lib/"), -len(n)))
        keep = dest / names[0]
        for other in names[1:]:
            path = dest / other
            path.unlink()
            path.symlink_to(os.path.relpath(keep, path.parent))
            n_links += 1
    return {"files": n_files, "links": n_links, "libraries": len(libs)}


# ---------------------------------------------------------------------------- closure
def _wheel_metadata(wheel: Path) -> Tuple[str, List[str]]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    return _norm(msg["Name"]), msg.get_all("Requires-Dist") or []


def _requirement(req: str):
    """A parsed Requires-Dist line (packaging's parser: the one pip uses, vendored in pip)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare interpreter: pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(req)


# The GPU machine's interpreter (docs/hybrid.md, "CUDA: the offline kit").
TARGET_ENV = {"implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "os_name": "posix", "platform_system": "Linux",
              "platform_machine": "x86_64", "python_version": "3.12", "python_full_version": "3.12.3",
              "extra": ""}


def closure(kit_wheels: Iterable[Path], present: Iterable[str]) -> List[str]:
    """Run-time requirements (no extras) of the kit's wheels, on CPython 3.12 for Linux,
    met neither by another kit wheel nor by PRESENT."""
    wheels = list(kit_wheels)
    meta = [_wheel_metadata(w) for w in wheels]
    have: Set[str] = {_norm(p) for p in present} | {name for name, _ in meta}
    missing = []
    for (name, reqs), w in zip(meta, wheels):
        for line in reqs:
            req = _requirement(line)
            if (req.marker is None or req.marker.evaluate(TARGET_ENV)) and _norm(req.name) not in have:
                missing.append(f"{w.name} needs {line.strip()}")
    return missing


# ---------------------------------------------------------------------------- manifest
def _files(kit: Path) -> List[Path]:
    return sorted(p for p in kit.rglob("*") if p.is_file() and p.name != MANIFEST)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(kit: Path) -> int:
    lines = [f"{_sha256(p)}  {p.stat().st_size:>10}  {p.relative_to(kit).as_posix()}" for p in _files(kit)]
    tmp = kit / (MANIFEST + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(kit / MANIFEST)
    return len(lines)


def verify(kit: Path) -> List[str]:
    """Problems with KIT against its MANIFEST (empty: the kit is whole)."""
    man = kit / MANIFEST
    if not man.is_file():
        return [f"{man} is missing: not a kit made by scripts/gpu_kit.sh (or an unfinished one)"]
    problems, listed = [], set()
    for n, line in enumerate(man.read_text().splitlines(), 1):
        parts = line.split(None, 2)
        if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]) or not parts[1].isdigit():
            problems.append(f"{man}:{n}: malformed line {line!r}")
            continue
        digest, size, rel = parts[0], int(parts[1]), parts[2]
        listed.add(rel)
        path = kit / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel}: {path.stat().st_size} bytes, the manifest says {size} (truncated copy?)")
        elif _sha256(path) != digest:
            problems.append(f"{rel}: sha256 differs from the manifest (corrupt copy?)")
    for p in _files(kit):
        if p.relative_to(kit).as_posix() not in listed:
            problems.append(f"{p.relative_to(kit).as_posix()}: not in the manifest")
    return problems


def kit_size(kit: Path) -> int:
    return sum(p.stat().st_size for p in kit.rglob("*") if p.is_file() and not p.is_symlink())


# ---------------------------------------------------------------------------- cli
def main(argv: List[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("site", "closure", "manifest", "verify", "size"):
        print(__doc__, file=sys.stderr)
        return 2
    cmd, kit = argv[0], Path(argv[1])
    if cmd == "site":
        if len(argv) != 3:
            print("usage: kit_tools.py site WHEEL DEST", file=sys.stderr)
            return 2
        counts = unpack_site(kit, Path(argv[2]))
        print(f"{counts['files']} files, {counts['libraries']} libraries stored once ({counts['links']} links)")
        return 0
    if not kit.is_dir():
        print(f"error: {kit} is not a folder", file=sys.stderr)
        return 1
    if cmd == "closure":
        missing = closure(sorted((kit / "wheels").glob("*.whl")), argv[2:])
        for m in missing:
            print(f"error: {m}", file=sys.stderr)
        return 1 if missing else 0
    if cmd == "manifest":
        print(f"{write_manifest(kit)} files in {kit / MANIFEST}")
        return 0
    if cmd == "verify":
        problems = verify(kit)
        for p in problems:
            print(f"error: {kit}: {p}", file=sys.stderr)
        return 1 if problems else 0
    size = kit_size(kit)
    print(f"{size} bytes ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
