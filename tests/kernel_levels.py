"""The kernel levels (CMakeLists.txt: PI_KERNEL_LEVELS) this machine builds and can execute,
read from the CPU's flags independently of the library's own choice (kernel_levels.c), so
that a level whose driver is missing where the CPU runs it fails the tests instead of
being skipped.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "bin"

# Each level's required /proc/cpuinfo flags, best level first.
X86_LEVELS = {
    "avx512": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"},
    "avxvnni": {"avx2", "fma", "f16c", "bmi2", "avx_vnni"},
    "avx2": {"avx2", "fma", "f16c", "bmi2"},
    "scalar": set(),
}
ARM_LEVELS = {"dotprod": {"asimddp"}, "scalar": set()}


def _cpu_flags() -> set[str]:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags.update(value.split())
    except OSError:
        pass
    return flags


def built_levels() -> dict[str, set[str]]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return X86_LEVELS
    if machine in ("aarch64", "arm64"):
        return ARM_LEVELS
    return {"scalar": set()}


def runnable_levels() -> list[str]:
    """Levels this CPU executes, best first."""
    flags = _cpu_flags()
    return [name for name, need in built_levels().items() if need <= flags]


def all_levels() -> list[str]:
    return list(built_levels())


def driver(kind: str, level: str) -> Path:
    """build/bin/<kind>-<level>, e.g. test-input-sparse-avx2."""
    return BIN / f"{kind}-{level}"


# --------------------------------------------------------------------------- driver targets
# The aarch64 levels' drivers, cross-built on x86-64 by scripts/build_aarch64.sh into
# build-aarch64/bin, run under qemu-aarch64 user emulation, each on an emulated CPU that has
# that level's features and no more (a level that used a newer instruction would crash).
AARCH64_BUILD = ROOT / "build-aarch64"
AARCH64_QEMU_CPU = {"scalar": "cortex-a72", "dotprod": "neoverse-n1"}  # armv8.0; armv8.2 + dotprod
# Under emulation the drivers run about 10 to 30 times slower: the tests' timeouts scale.
QEMU_SLOWDOWN = 20


def require_aarch64() -> bool:
    """POWERINFER_REQUIRE_AARCH64=1 (CI, .ci/run): the aarch64 levels must run."""
    return os.environ.get("POWERINFER_REQUIRE_AARCH64", "0") == "1"


@dataclass(frozen=True)
class Target:
    """One level's driver of one kind, and how to run it here."""

    kind: str  # "test-input-sparse", "test-sparse-ops"
    arch: str  # "x86_64", "aarch64", ...: the driver's architecture
    level: str
    path: Path
    runner: tuple[str, ...] = ()  # the emulator's command before the path, if any
    env: tuple[tuple[str, str], ...] = ()  # added to the environment
    timeout_factor: float = 1.0
    unrunnable: str = ""  # why this machine cannot run the level ("" when it can)
    required: bool = True  # a missing driver fails (else skips)
    must_run: bool = False  # a machine that cannot run it fails too (else skips)
    howto: str = ""  # how to build it

    @property
    def id(self) -> str:
        """The test id: the level, prefixed with the architecture when emulated."""
        return f"{self.arch}-{self.level}" if self.runner else self.level

    def require(self) -> "Target":
        """Skip where this machine cannot run the level; fail (or, where not required,
        skip) where it can and the driver is missing."""
        if self.unrunnable:
            if self.must_run:
                pytest.fail(self.unrunnable + " (POWERINFER_REQUIRE_AARCH64=1: the aarch64 levels must run)")
            pytest.skip(self.unrunnable)
        if not self.path.exists():
            msg = f"{self.path} is missing, and this machine runs the {self.id} kernels: {self.howto}"
            if self.required:
                pytest.fail(msg + " (their tests must run where they can)")
            pytest.skip(msg)
        return self

    def argv(self, *args) -> list[str]:
        return [*self.runner, str(self.path), *map(str, args)]

    def run(self, *args, timeout: float, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of the driver with args (check=True), the timeout scaled for
        emulation."""
        self.require()
        env = dict(os.environ, **dict(self.env)) if self.env else None
        return subprocess.run(self.argv(*args), check=True, timeout=timeout * self.timeout_factor, env=env, **kw)


def _host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _aarch64_ggml_libdir() -> str:
    """The cross-built ggml's lib folder, from build-aarch64's CMake cache."""
    try:
        for line in (AARCH64_BUILD / "CMakeCache.txt").read_text().splitlines():
            if line.startswith("POWERINFER_GGML_ROOT:"):
                return line.partition("=")[2] + "/lib"
    except OSError:
        pass
    return ""


def _aarch64_targets(kind: str) -> list[Target]:
    sysroot = os.environ.get("AARCH64_SYSROOT", "/usr/aarch64-linux-gnu")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    required = require_aarch64()
    unrunnable = ""
    if not qemu:
        unrunnable = "no qemu-aarch64 to run the aarch64 drivers (scripts/build_aarch64.sh installs qemu-user)"
    elif not Path(sysroot, "lib", "libc.so.6").exists():
        unrunnable = f"no aarch64 libc in {sysroot} (scripts/build_aarch64.sh installs it)"
    libdir = _aarch64_ggml_libdir()
    targets = []
    for level in ARM_LEVELS:
        runner = (qemu or "qemu-aarch64", "-L", sysroot, "-cpu", AARCH64_QEMU_CPU.get(level, "max"))
        if libdir:  # as the drivers' RPATH (explicit: the RPATH is the build's, not a promise)
            runner += ("-E", f"LD_LIBRARY_PATH={libdir}")
        targets.append(Target(kind, "aarch64", level, AARCH64_BUILD / "bin" / f"{kind}-{level}", runner,
                              (("QEMU_LD_PREFIX", sysroot),), QEMU_SLOWDOWN, unrunnable, required,
                              must_run=required, howto="run scripts/build_aarch64.sh"))
    return targets


def driver_targets(kind: str) -> list[Target]:
    """Every level's driver of `kind` ("test-input-sparse", "test-sparse-ops"), best first:
    the host's levels (build/bin/<kind>-<level>; those this CPU cannot execute are skipped,
    a missing driver of one it can fails), then, on x86-64, the aarch64 levels under qemu
    when build-aarch64/ exists (and POWERINFER_AARCH64 is not 0) or POWERINFER_REQUIRE_AARCH64=1
    (then a missing driver or emulator fails)."""
    runnable = runnable_levels()
    host = _host_arch()
    targets = [
        Target(kind, host, level, driver(kind, level),
               unrunnable="" if level in runnable else
               f"this CPU cannot execute the {level} kernels (it runs: {', '.join(runnable)})",
               howto=f"cmake --build build --target {kind}-{level}")
        for level in all_levels()
    ]
    if host == "x86_64":
        # the avxvnni kernels on an AVX-512 VNNI CPU, their vpdpbusd in its EVEX form (CMakeLists.txt)
        targets.append(Target(kind, host, "avxvnni-emu", driver(kind, "avxvnni-emu"),
                              unrunnable="" if "avx512" in runnable else
                              "the avxvnni-emu drivers need an AVX-512 VNNI CPU",
                              howto=f"cmake --build build --target {kind}-avxvnni-emu"))
    wanted = os.environ.get("POWERINFER_AARCH64", "1") != "0"  # scripts/test.sh's switch
    if host == "x86_64" and ((wanted and AARCH64_BUILD.exists()) or require_aarch64()):
        targets += _aarch64_targets(kind)
    return targets


def best_target(kind: str) -> Target:
    """The host level the library picks on this CPU (the best one it executes)."""
    return next(t for t in driver_targets(kind) if not t.runner and not t.unrunnable)
