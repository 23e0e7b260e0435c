"""A short coverage-guided fuzzing run of the Python package's untrusted-input entry points
(atheris): scripts/fuzz_py.sh runs tests/fuzz/py/fuzz_pt_io.py (pt_io.load on .pt
archives and on pickles inside a valid archive) and fuzz_tokenizer.py (Llama.tokenize,
detokenize, token_to_piece and the chat template on SmolLM2's vocabulary), seeded from
tests/fuzz/py/make_seeds.py, each for POWERINFER_FUZZ_SECONDS (default 15). An exception
the target does not allow, a native crash, a hang or a memory blow-up fails the test; the
input is kept in build-fuzz/py/artifacts/.

Skipped where atheris cannot be imported (the script exits 77). The long campaign is the
same script with more time: scripts/fuzz_py.sh 450."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "fuzz_py.sh"
SECONDS = int(os.environ.get("POWERINFER_FUZZ_SECONDS", "15"))
MIN_EXECUTIONS = {"pt_io": 1000, "tokenizer": 1000}


@pytest.mark.parametrize("target", sorted(MIN_EXECUTIONS))
def test_fuzz_py(target, request):
    env = dict(os.environ, FUZZ_PY_TARGETS=target)
    if target == "tokenizer":
        # the model as the other tests get it (fetched once, verified); the target then
        # does not fetch anything itself
        env["POWERINFER_FUZZ_MODEL"] = request.getfixturevalue("smollm2_path")
    r = subprocess.run([str(SCRIPT), str(SECONDS)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=SECONDS + 600)
    if r.returncode == 77:
        pytest.skip(r.stderr.strip() or "atheris is not available")
    report = r.stdout + r.stderr
    assert r.returncode == 0, f"fuzzing failed (exit {r.returncode}):\n{report[-6000:]}"
    m = re.search(rf"^fuzz-{target}: (\d+) executions in (\d+) s, crashes: (\d+)", r.stdout, re.M)
    assert m, f"no summary for fuzz-{target}:\n{report[-3000:]}"
    execs, crashes = int(m.group(1)), int(m.group(3))
    assert crashes == 0
    assert execs > MIN_EXECUTIONS[target], f"fuzz-{target} ran only {execs} inputs in {m.group(2)} s"
