"""`powerinfer rpc-server`: serve this host's CPU to PowerInfer-Py and llama.cpp clients over
ggml-rpc (`Llama(rpc_servers="host:port")`, `main --rpc host:port`, llama.cpp's `--rpc`).

    powerinfer rpc-server [--host 127.0.0.1] [--port 50052] [--mem MIB] [--threads N]

--mem caps what clients may allocate here (an allocation past it fails with a message, and
the worker reports the cap as its memory, so clients place within it). The protocol has no
authentication and no encryption, and ggml-rpc servers have had remotely exploitable bugs:
serve loopback (the default) or a network you trust, never the internet (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import signal
import socket
import sys
from typing import List, Optional

from .common import PipelineError, run_cli

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def mem_cap_bytes(mem_mib: float) -> int:
    """--mem in bytes (0: no cap), or PipelineError for a value that is no cap the worker can
    impose: negative, not a number, infinite, beyond what a 64-bit size holds, or a positive
    value below one byte (it would have served uncapped while saying "capped")."""
    if not math.isfinite(mem_mib) or mem_mib < 0:
        raise PipelineError(f"--mem {mem_mib}: give a number of MiB >= 0 (0: no cap)")
    mem_bytes = int(mem_mib * 2**20)
    if mem_mib > 0 and mem_bytes < 1:
        raise PipelineError(f"--mem {mem_mib:g} MiB is less than one byte; give the cap in MiB (0: no cap)")
    if mem_bytes >= 2**63:
        raise PipelineError(f"--mem {mem_mib:g} MiB is more than a 64-bit size holds; give the cap in MiB (0: no cap)")
    return mem_bytes


def serve(host: str, port: int, mem_mib: float, threads: int, verbose: bool = False) -> None:
    from .._core import rpc
    from .._core.bindings import lib

    # ggml's messages (a refused request, a client's malformed command) at warning level, or
    # everything with --verbose.
    lib.powerinfer_log_set_level(lib.POWERINFER_LOG_INFO if verbose else lib.POWERINFER_LOG_WARN)

    if not 0 < port < 65536:
        raise PipelineError(f"--port {port} is not a TCP port")
    mem_bytes = mem_cap_bytes(mem_mib)
    if threads < 1:
        raise PipelineError(f"--threads {threads} must be >= 1")
    if mem_bytes > 0 and not rpc.can_cap_memory():
        raise PipelineError("--mem: this build of libpowerinfer cannot cap the worker's memory (it was built without "
                            "ggml-backend-impl.h of the llama-cpp-python sdist; run scripts/setup.sh)")
    if not _is_loopback(host):
        print(f"powerinfer rpc-server: WARNING: serving on {host}, not loopback. The RPC protocol has no "
              "authentication or encryption, and ggml-rpc servers have had remotely exploitable bugs: anyone who "
              "can reach this port can run code here. Never expose it to an untrusted network.", file=sys.stderr)
    print(f"powerinfer rpc-server: {host}:{port}, {threads} threads, memory "
          f"{f'capped at {mem_mib:g} MiB' if mem_bytes > 0 else 'not capped'} (pid {os.getpid()})", flush=True)
    # ggml's server loop never returns to Python: let SIGINT and SIGTERM end the process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.serve(host, port, mem_bytes, threads)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="powerinfer rpc-server", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    ap.add_argument("--mem", type=float, default=0.0, help="MiB clients may allocate here (default 0: no cap)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1), help="CPU threads (default: all cores)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log what ggml says, debug messages included")
    return run_cli(lambda a: serve(a.host, a.port, a.mem, a.threads, a.verbose), ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
