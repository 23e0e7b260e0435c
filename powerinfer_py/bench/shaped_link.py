"""A real network link on one machine: a network namespace joined to this one by a veth
pair, shaped with tc, for RPC workers that talk over it (`bench rpc`, tests/test_rpc.py).

The rate is shaped on both ends (tbf); a delay is added with netem where the kernel has it
(some sandboxed kernels have no sch_netem: then the link has the rate only, and `shaping`
says so). Needs root and iproute2; `available()` says why not otherwise.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from typing import List, Optional, Sequence, Tuple

_COUNTER = itertools.count()


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def available() -> Tuple[bool, str]:
    """(True, "") when namespaces and veth pairs can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return False, "iproute2 (ip, tc) is not installed"
    name = f"pi-probe-{os.getpid()}"
    r = _run(["ip", "netns", "add", name])
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    _run(["ip", "netns", "del", name])
    return True, ""


class ShapedLink:
    """`with ShapedLink("1gbit", 0.2) as link:` a namespace reachable at link.peer_ip (this
    side is link.local_ip); link.popen(cmd) runs a command inside it."""

    def __init__(self, rate: str = "1gbit", delay_ms: float = 0.0):
        self.rate, self.delay_ms = rate, delay_ms
        i = next(_COUNTER) % 200
        self.ns = f"pi-link-{os.getpid()}-{i}"
        self.dev_local, self.dev_peer = f"pil{os.getpid() % 10000}x{i}", f"pip{os.getpid() % 10000}x{i}"
        subnet = 10 + (os.getpid() + i) % 200
        self.local_ip, self.peer_ip = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
        self.shaping = ""  # what tc applied, in words

    def _must(self, *cmd: str) -> None:
        r = _run(cmd)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")

    def _shape(self, prefix: List[str], dev: str) -> str:
        # A delay and a rate in one netem qdisc where the kernel has netem; else the rate alone.
        if self.delay_ms > 0:
            r = _run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{self.delay_ms}ms",
                      "rate", self.rate])
            if r.returncode == 0:
                return f"netem rate {self.rate} delay {self.delay_ms} ms"
        # tbf's bucket must hold a few ms of the rate, or a fast rate is not reached.
        bits = float(self.rate.rstrip("bit").rstrip("gGmMkK") or 0) * {"g": 1e9, "m": 1e6, "k": 1e3}.get(
            self.rate.rstrip("bit")[-1:].lower(), 1.0)
        burst = max(256 << 10, int(bits / 8 * 0.004))
        self._must(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", str(burst),
                   "latency", "50ms")
        return f"tbf rate {self.rate}" + (" (no netem in this kernel: no delay)" if self.delay_ms > 0 else "")

    def __enter__(self) -> "ShapedLink":
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        try:
            self._must("ip", "netns", "add", self.ns)
            self._must("ip", "link", "add", self.dev_local, "type", "veth", "peer", "name", self.dev_peer)
            self._must("ip", "link", "set", self.dev_peer, "netns", self.ns)
            self._must("ip", "addr", "add", f"{self.local_ip}/24", "dev", self.dev_local)
            self._must("ip", "link", "set", self.dev_local, "up")
            inside = ["ip", "netns", "exec", self.ns]
            self._must(*inside, "ip", "addr", "add", f"{self.peer_ip}/24", "dev", self.dev_peer)
            self._must(*inside, "ip", "link", "set", self.dev_peer, "up")
            self._must(*inside, "ip", "link", "set", "lo", "up")
            self.shaping = self._shape([], self.dev_local)
            self._shape(inside, self.dev_peer)
        except BaseException:
            self.__exit__()
            raise
        return self

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kwargs)

    def bytes_sent_received(self) -> int:
        """Bytes that crossed the link so far (both directions, this side's counters)."""
        base = f"/sys/class/net/{self.dev_local}/statistics"
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()) + int(rx.read())

    def __exit__(self, *exc: Optional[BaseException]) -> None:
        _run(["ip", "link", "del", self.dev_local])
        _run(["ip", "netns", "del", self.ns])
