"""The progress report of the package's long steps (profiling, predictor training,
calibration, relufy, synthetic models, model downloads), on stderr.

Standard library only and free of the C core, so the model fetcher can use it before
libpowerinfer is built.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional


class Progress:
    """A one-line bar redrawn in place:

        label [#########---------------------] 30/100 12s elapsed, ~28s left EXTRA

    (with `rate="tok"`, the speed too: "... ~28s left, 2.5 tok/s EXTRA"), or, with
    `every_pct` (for logs, which do not redraw), one line each time another `every_pct`
    percent is done:

        label: 12.0 MiB / 100.0 MiB (12%)

    `fmt` renders the counts (default: as integers). update() takes the count done so
    far, advance() what was just done; close() ends the bar's line.
    """

    def __init__(self, label: str, total: int, enabled: bool = True, *, every_pct: Optional[int] = None,
                 fmt: Callable[[int], str] = str, rate: Optional[str] = None):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.every_pct, self.fmt, self.rate = every_pct, fmt, rate
        self.done = 0
        self._next_pct = 0
        self.t0 = time.time()

    def advance(self, n: int, extra: str = "") -> None:
        self.update(self.done + n, extra)

    def update(self, done: int, extra: str = "") -> None:
        self.done = done
        if not self.enabled:
            return
        if self.every_pct is not None:
            pct = done * 100 // self.total
            if pct >= self._next_pct or done >= self.total:
                print(f"  {self.label}: {self.fmt(done)} / {self.fmt(self.total)} ({pct}%)", file=sys.stderr, flush=True)
                self._next_pct = (pct // self.every_pct + 1) * self.every_pct
            return
        el = time.time() - self.t0
        frac = min(done / self.total, 1.0)
        eta = el / frac - el if frac > 0 else 0.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        speed = f", {done / el:.1f} {self.rate}/s" if self.rate and el > 0 else ""
        print(f"\r{self.label} [{bar}] {self.fmt(done)}/{self.fmt(self.total)} {el:.0f}s elapsed, ~{eta:.0f}s left{speed} "
              f"{extra}   ", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.every_pct is None:
            print(file=sys.stderr, flush=True)
