"""One model across RPC workers: `python -m powerinfer_py.bench rpc`.

Loads the model (default SmolLM2-135M) locally and split by layers over RPC workers (every
layer on the workers, as llama.cpp's `-ngl 99 --rpc`): one and two `powerinfer rpc-server`
workers on loopback; llama.cpp's own rpc-server as the anchor (built from the installed
llama-cpp-python's sources when g++ and the cached sdist are there); and, where network
namespaces are allowed, one worker behind a veth link shaped to 10 and 1 Gbit/s (with a
0.2 ms delay where the kernel has netem). llama-cpp-python runs the model locally in the same
run (its rpc_servers is broken upstream). Every configuration is loaded once and measured
in interleaved rounds; per configuration: prompt and decode tokens/s (the median round) and
the bytes that crossed to and from the workers per decoded token and per prompt graph (the
loopback interface's counters, or the shaped link's).

The workers share this machine's cores with the client: on one host the split can only
cost; what the numbers show is what crosses the wire and what it costs per token.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from contextlib import ExitStack
from typing import Any, Callable, List, Optional

from .._machine import measure_bandwidth
from ..assets.models import cache_dir, llama_cpp_sdist_tarball, model_path as named_model_path
from .common import print_table
from .shaped_link import ShapedLink, available

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type with an oil-based ink and a screw press. ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(host: str, port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {host}:{port}")
            time.sleep(0.1)


def _loopback_bytes() -> int:
    """Bytes sent over loopback so far (the machine's: other traffic counts too, a little)."""
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def llama_cpp_rpc_server() -> Optional[str]:
    """llama.cpp's tools/rpc/rpc-server built from the cached llama-cpp-python sdist against
    the installed ggml (about 5 s with g++), or None when that cannot be done here."""
    import llama_cpp

    out = cache_dir() / "llama-cpp-rpc-server"
    if out.is_file():
        return str(out)
    gxx = shutil.which("g++")
    tarball = llama_cpp_sdist_tarball()
    if not gxx or tarball is None:
        return None
    site = os.path.dirname(os.path.dirname(llama_cpp.__file__))
    with tarfile.open(tarball) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("vendor/llama.cpp/tools/rpc/rpc-server.cpp")), None)
        if member is None:
            return None
        src = cache_dir() / "llama-cpp-rpc-server.cpp"
        src.write_bytes(tar.extractfile(member).read())
    r = subprocess.run([gxx, "-O2", "-std=c++17", str(src), f"-I{site}/include", f"-L{site}/lib", "-lggml", "-lggml-base",
                        "-lggml-rpc", f"-Wl,-rpath,{site}/lib", "-o", str(out)], capture_output=True, text=True)
    return str(out) if r.returncode == 0 else None


class _Config:
    """One way to run the model: a name, a Llama (or llama_cpp.Llama), and a byte counter."""

    def __init__(self, name: str, llm: Any, counter: Optional[Callable[[], int]] = None, note: str = ""):
        self.name, self.llm, self.counter, self.note = name, llm, counter, note
        self.prompt_tps: List[float] = []
        self.decode_tps: List[float] = []
        self.bytes_token: List[float] = []
        self.bytes_prompt: List[float] = []


def _argmax_last(llm: Any) -> int:
    import numpy as np

    if hasattr(llm, "_last_logits_view"):  # ours
        return int(np.argmax(llm._last_logits_view()))
    import llama_cpp

    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(row.argmax())


def _measure(cfg: _Config, prompt_tokens: List[int], n_gen: int, n_batch: int) -> None:
    llm = cfg.llm
    count = cfg.counter or (lambda: 0)
    llm.reset()
    b0, t0 = count(), time.perf_counter()
    llm.eval(prompt_tokens)
    t1, b1 = time.perf_counter(), count()
    for _ in range(n_gen):
        llm.eval([_argmax_last(llm)])
    t2, b2 = time.perf_counter(), count()
    cfg.prompt_tps.append(len(prompt_tokens) / (t1 - t0))
    cfg.decode_tps.append(n_gen / (t2 - t1))
    if cfg.counter:
        cfg.bytes_prompt.append((b1 - b0) / -(-len(prompt_tokens) // n_batch))
        cfg.bytes_token.append((b2 - b1) / n_gen)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer_py.bench rpc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF path or a model name of powerinfer_py.assets.models")
    ap.add_argument("--threads", type=int, default=2, help="the client's threads (and each worker's)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-shaped", action="store_true", help="skip the shaped links")
    args = ap.parse_args(argv)
    model = args.model if args.model.endswith(".gguf") else named_model_path(args.model)

    import llama_cpp

    from .. import Llama

    print(f"memory bandwidth ~{measure_bandwidth(args.threads) / 1e9:.1f} GB/s; {args.threads} threads")
    kw = dict(n_ctx=512, n_batch=512, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    worker_cmd = [sys.executable, "-m", "powerinfer_py.pipeline.rpc_server", "--threads", str(args.threads)]
    configs: List[_Config] = []
    with ExitStack() as stack:
        def worker(cmd: List[str], host: str, port: int, what: str, link: Optional[ShapedLink] = None) -> subprocess.Popen:
            proc = (link.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if link else
                    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            stack.callback(proc.kill)
            _wait_port(host, port, proc, what)
            return proc

        ref = llama_cpp.Llama(model_path=model, **kw)
        stack.callback(ref.close)
        configs.append(_Config("llama-cpp-python, local", ref))
        local = Llama(model_path=model, **kw)
        stack.callback(local.close)
        configs.append(_Config("powerinfer-py, local", local))
        for n in (1, 2):
            ports = [_free_port() for _ in range(n)]
            for p in ports:
                worker([*worker_cmd, "--port", str(p)], "127.0.0.1", p, "powerinfer rpc-server")
            llm = Llama(model_path=model, rpc_servers=",".join(f"127.0.0.1:{p}" for p in ports), n_gpu_layers=-1, **kw)
            stack.callback(llm.close)
            configs.append(_Config(f"powerinfer-py, {n} loopback worker{'s' if n > 1 else ''}", llm,
                                   _loopback_bytes))
        anchor = llama_cpp_rpc_server()
        if anchor:
            port = _free_port()
            worker([anchor, "-p", str(port), "-t", str(args.threads)], "127.0.0.1", port, "llama.cpp rpc-server")
            llm = Llama(model_path=model, rpc_servers=f"127.0.0.1:{port}", n_gpu_layers=-1, **kw)
            stack.callback(llm.close)
            configs.append(_Config("powerinfer-py, llama.cpp's rpc-server", llm, _loopback_bytes))
        else:
            print("llama.cpp's rpc-server: cannot be built here (needs g++ and the cached llama-cpp-python sdist)")
        ok, why = available()
        if not args.no_shaped and not ok:
            print(f"shaped links: skipped ({why})")
        for rate in ([] if args.no_shaped or not ok else ["10gbit", "1gbit"]):
            link = stack.enter_context(ShapedLink(rate, 0.2))
            port = _free_port()
            worker([*worker_cmd, "--host", link.peer_ip, "--port", str(port)], link.peer_ip, port,
                   "powerinfer rpc-server", link)
            llm = Llama(model_path=model, rpc_servers=f"{link.peer_ip}:{port}", n_gpu_layers=-1, **kw)
            stack.callback(llm.close)
            configs.append(_Config(f"powerinfer-py, 1 worker over {rate}", llm, link.bytes_sent_received, link.shaping))
        tokens = local.tokenize(PROMPT.encode() * 8)[: args.prompt_tokens]
        for _ in range(args.rounds):
            for cfg in configs:
                _measure(cfg, tokens, args.n_gen, kw["n_batch"])
    base = statistics.median(configs[0].decode_tps)
    base_prompt = statistics.median(configs[0].prompt_tps)
    rows = []
    for cfg in configs:
        d, p = statistics.median(cfg.decode_tps), statistics.median(cfg.prompt_tps)
        kb_tok = f"{statistics.median(cfg.bytes_token) / 1024:.1f}" if cfg.bytes_token else "-"
        kb_pr = f"{statistics.median(cfg.bytes_prompt) / 1024:.0f}" if cfg.bytes_prompt else "-"
        rows.append([cfg.name + (f" ({cfg.note})" if cfg.note else ""), f"{p:.1f}", f"{p / base_prompt:.2f}x",
                     f"{d:.1f}", f"{d / base:.2f}x", kb_tok, kb_pr])
    print_table(f"{os.path.basename(model)}: every layer on the workers (layer split), {args.prompt_tokens}-token prompt, "
                f"{args.n_gen} generated, median of {args.rounds} interleaved rounds",
                ["configuration", "prompt tok/s", "vs llama-cpp-python", "decode tok/s", "vs llama-cpp-python",
                 "KiB to/from workers per token", "KiB per prompt graph"], rows)
    return 0
