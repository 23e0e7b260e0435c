"""What a long prompt and a metrics scrape cost the streams already running:
`python -m powerinfer_py.bench stall`.

Starts `python -m powerinfer_py.server --n_parallel N` (and, for the same measurement,
llama-cpp-python's own server, which serves one request at a time) and runs `--streams`
streamed completions of `--max-tokens` tokens each (EOS banned). Once they are all
streaming, one client sends a prompt of `--prompt-tokens` tokens, while another scrapes
/metrics in a loop and times /health between scrapes. Reported: per stream, its median gap
between tokens before the prompt came (a decode step) and its longest gap while the
prompt was read; the prompt's time to first token and the number of chunks it was read in
(the server's prompt_chunks counter); /health's longest and median answer, each sent
together with a /metrics scrape, twice a second while the prompt is read. The bound the server keeps: no stream waits more than two decode steps plus one
prompt chunk (about --prompt-slice-ms).

llama-cpp-python's server computes one request at a time: the long prompt waits for the
running stream to end (there is one), so its row shows the prompt's wait, not a stall.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse
from typing import Any, Dict, List, Optional

from .._machine import measure_bandwidth
from ..assets.models import model_path as named_model_path
from .common import print_table
from .parallel import _Server


def _stream(url: str, prompt: str, max_tokens: int, times: List[float], eos: Dict[str, float]) -> None:
    """A streamed completion; appends each content chunk's arrival time to `times`."""
    parsed = urllib.parse.urlsplit(url)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "logit_bias": eos}).encode()
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=900)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        tail = b""
        while True:
            data = r.read1(65536)
            if not data:
                break
            now = time.perf_counter()
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            times.extend(now for line in lines if line.startswith(b'data: {'))
    finally:
        conn.close()


def _get(url: str, path: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _metric(text: str, name: str) -> Optional[float]:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _measure(server: _Server, streams: int, max_tokens: int, prompt: str, eos: Dict[str, float]) -> Dict[str, Any]:
    times: List[List[float]] = [[] for _ in range(streams)]
    workers = [threading.Thread(target=_stream, args=(server.url, f"Count {i}: 1, 2, 3,", max_tokens, times[i], eos))
               for i in range(streams)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 300
    while not all(len(t) >= 8 for t in times):  # every stream is streaming
        if time.monotonic() > deadline or not any(w.is_alive() for w in workers):
            raise RuntimeError(f"{server.label}: the streams did not start")
        time.sleep(0.02)
    chunks_before = _metric(_get(server.url, "/metrics"), "powerinfer_prompt_chunks_total") or 0.0
    health: List[float] = []
    scraping = threading.Event()
    scraping.set()

    def scrape() -> None:
        # A scrape every half second (Prometheus scrapes every 15 s by default; a tight loop
        # would take a core of the two from the server it measures), /health sent with it.
        while scraping.is_set():
            done = threading.Event()
            threading.Thread(target=lambda: (_get(server.url, "/metrics"), done.set())).start()
            t0 = time.perf_counter()
            _get(server.url, "/health") if server.label.startswith("powerinfer") else _get(server.url, "/v1/models")
            health.append(time.perf_counter() - t0)
            done.wait(120)
            scraping.wait(0) and time.sleep(0.5)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    t_prompt = time.perf_counter()
    long_times: List[float] = []
    _stream(server.url, prompt, 1, long_times, {})
    t_first = (long_times[0] if long_times else time.perf_counter()) - t_prompt
    t_end = time.perf_counter()
    scraping.clear()
    scraper.join()
    after = _get(server.url, "/metrics")
    chunks = (_metric(after, "powerinfer_prompt_chunks_total") or 0.0) - chunks_before
    longest_step = _metric(after, "powerinfer_step_seconds_max")
    for w in workers:
        w.join()
    rows = []
    for t in times:
        before = [b - a for a, b in zip(t, t[1:]) if b <= t_prompt]
        during = [b - a for a, b in zip(t, t[1:]) if a < t_end and b > t_prompt]
        rows.append({"step": statistics.median(before[-32:]) if before else float("nan"),
                     "worst": max(during) if during else float("nan"),
                     "median_during": statistics.median(during) if during else float("nan"), "n_during": len(during)})
    return {"streams": rows, "ttft": t_first, "chunks": chunks, "health": health, "longest_step": longest_step}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer_py.bench stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF path or a model name of powerinfer_py.assets.models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4, help="streams running when the prompt comes (also --n_parallel - 1)")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=1500, help="tokens of each running stream")
    ap.add_argument("--n-ctx", type=int, default=4096, help="per slot")
    ap.add_argument("--llama-cpp", action="store_true", help="also measure llama-cpp-python's server")
    args = ap.parse_args(argv)
    model = args.model if args.model.endswith(".gguf") else named_model_path(args.model)
    print(f"memory bandwidth ~{measure_bandwidth(args.threads) / 1e9:.1f} GB/s; {args.threads} threads")
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    unit = " ".join(f"item {i}," for i in range(50))
    prompt = unit
    while len(vocab.tokenize(prompt.encode())) < args.prompt_tokens:
        prompt += " " + unit
    prompt_tokens = vocab.tokenize(prompt.encode())[: args.prompt_tokens]
    prompt = vocab.detokenize(prompt_tokens).decode(errors="replace")
    eos = {str(vocab.token_eos()): -100.0}
    del vocab
    servers = [("powerinfer-py", "powerinfer_py.server", ["--n_parallel", str(args.streams + 1)])]
    if args.llama_cpp:
        servers.append(("llama-cpp-python", "llama_cpp.server", []))
    table = []
    for label, module, extra in servers:
        server = _Server(label, module, model, args.threads, args.n_ctx, extra)
        try:
            r = _measure(server, args.streams if module.startswith("powerinfer") else 1, args.max_tokens, prompt, eos)
        finally:
            server.close()
        health = sorted(r["health"]) or [float("nan")]
        for i, s in enumerate(r["streams"]):
            table.append([label, f"stream {i}", f"{s['step'] * 1000:.1f}", f"{s['median_during'] * 1000:.1f}",
                          f"{s['worst'] * 1000:.1f}", str(s["n_during"]),
                          f"{(r['longest_step'] or float('nan')) * 1000:.1f}",
                          f"{r['ttft']:.2f}", f"{r['chunks']:.0f}", f"{health[-1] * 1000:.1f}",
                          f"{statistics.median(health) * 1000:.1f}"])
    print_table(f"A {args.prompt_tokens}-token prompt arriving while {args.streams} streams run; /health during "
                "/metrics scrapes", ["server", "stream", "decode step ms (median)", "median gap during the prompt ms",
                 "longest gap during the prompt ms", "tokens during it", "longest step of the server ms", f"{args.prompt_tokens}-token prompt TTFT s", "prompt chunks",
                 "health max ms", "health median ms"], table)
    return 0
