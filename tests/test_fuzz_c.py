"""A short coverage-guided fuzzing run of the C core's file readers (libFuzzer, with
AddressSanitizer and UndefinedBehaviorSanitizer): scripts/fuzz_c.sh builds
tests/fuzz/c/fuzz_gguf.c (the PWRI/GGUF header reader) and fuzz_gpuidx.c (the gpuidx
placement cache), seeds them from the tests' crafted files and runs each for
POWERINFER_FUZZ_SECONDS (default 15). Any crash, sanitizer report or broken promise of
the reader fails the test; the crashing input is kept in build-fuzz/artifacts/.

The script installs clang and libFuzzer when they are missing and it can (root with
apt-get, as in CI); elsewhere, without them, the test is skipped. The long campaign is the
same script with more time: scripts/fuzz_c.sh 900."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "fuzz_c.sh"
SECONDS = int(os.environ.get("POWERINFER_FUZZ_SECONDS", "15"))
TARGETS = ("gguf", "gpuidx")


def test_fuzz_c_readers():
    r = subprocess.run([str(SCRIPT), str(SECONDS)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode == 77:
        pytest.skip(r.stderr.strip() or "no libFuzzer here")
    report = r.stdout + r.stderr
    assert r.returncode == 0, f"fuzzing failed (exit {r.returncode}):\n{report[-6000:]}"
    for t in TARGETS:
        m = re.search(rf"^fuzz-{t}: (\d+) executions in (\d+) s, crashes: (\d+)", r.stdout, re.M)
        assert m, f"no summary for fuzz-{t}:\n{report[-3000:]}"
        execs, crashes = int(m.group(1)), int(m.group(3))
        assert crashes == 0
        assert execs > 1000, f"fuzz-{t} ran only {execs} inputs"
