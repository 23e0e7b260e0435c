"""The machine a measurement ran on: its CPU and its read bandwidth (printed with every
speed figure, since ratios between engines are what carry across machines)."""

from __future__ import annotations

import os
import platform
import time
from typing import Callable, List, Sequence

import numpy as np

__all__ = ["best_alternating", "cpu_model", "measure_bandwidth", "timed"]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo) and its number of cores."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def measure_bandwidth(threads: int, n_bytes: int = 1 << 30) -> float:
    """Read bandwidth with `threads` threads, in bytes/s: best of 3 passes in which each
    thread sums its share of a 1 GiB array (numpy releases the GIL in the sum)."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(n_bytes // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, n_bytes / (time.perf_counter() - t))
    return best


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_alternating(runs: Sequence[Callable[[], float]], reps: int) -> List[float]:
    """Each run (returning the seconds it measured) called in turn, `reps` rounds: the best
    time of each. Alternating keeps engines under the same bandwidth, which drifts."""
    best = [float("inf")] * len(runs)
    for _ in range(reps):
        for i, run in enumerate(runs):
            best[i] = min(best[i], run())
    return best
