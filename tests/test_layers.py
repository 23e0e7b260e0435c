"""The package's layer rules hold: import-linter's contracts in pyproject.toml
([tool.importlinter]: the layers, the C boundary of powerinfer_py._core, the tools
above the engine, no cycles) are checked by `lint-imports` from the test extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.is_file(), f"{exe} is missing: install the test extra (pip install 'powerinfer-py[test]')"
    r = subprocess.run([str(exe), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "broken" in r.stdout and " 0 broken" in r.stdout, r.stdout
