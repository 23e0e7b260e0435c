"""pytest plugin for scripts/sanitize.sh (loaded with `-p sanitize_plugin`, never collected):
the tests run the C programs of build/bin (the CLI `main`, `simple`, the test-sparse-ops
drivers); this sends every such call to the same program in $POWERINFER_SANITIZE_BIN, the
AddressSanitizer/UndefinedBehaviorSanitizer build. The tests themselves are unchanged."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_BIN = Path(os.environ["POWERINFER_SANITIZE_BIN"]).resolve()
_BUILD_BIN = (Path(__file__).resolve().parent.parent / "build" / "bin").resolve()
_real_popen_init = subprocess.Popen.__init__
redirected = set()


def _redirect(args):
    if isinstance(args, (list, tuple)) and args:
        try:
            p = Path(os.fspath(args[0])).resolve()
        except TypeError:
            return args
        if p.parent == _BUILD_BIN and (_BIN / p.name).is_file():
            redirected.add(p.name)
            return [str(_BIN / p.name), *args[1:]]
    return args


def _popen_init(self, args, *a, **kw):
    _real_popen_init(self, _redirect(args), *a, **kw)


subprocess.Popen.__init__ = _popen_init  # subprocess.run and check_output go through Popen


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"sanitize_plugin: ran the sanitized {', '.join(sorted(redirected)) or 'nothing'} "
                                f"from {_BIN}")
