"""`python -m powerinfer_py.bench [dense|sparse|accel|hybrid|parallel|stall|rpc|speculative] [options]`; no word runs `dense`.
`--child SPEC` is the benchmarks' own child process (bench.common.spawn)."""

from __future__ import annotations

import sys
from typing import List, Optional

from . import accel, dense, hybrid, parallel, rpc, sparse, speculative, stall
from .common import child_main

BENCHMARKS = {"accel": accel.main, "dense": dense.main, "sparse": sparse.main, "hybrid": hybrid.main, "parallel": parallel.main,
              "stall": stall.main, "rpc": rpc.main, "speculative": speculative.main}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"] and len(argv) == 2:
        return child_main(argv[1])
    if argv and argv[0] in BENCHMARKS:
        return BENCHMARKS[argv[0]](argv[1:])
    return dense.main(argv)


if __name__ == "__main__":
    sys.exit(main())
