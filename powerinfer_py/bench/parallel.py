"""Concurrent clients against the server: `python -m powerinfer_py.bench parallel`.

Starts `python -m powerinfer_py.server --n_parallel N` and llama-cpp-python's own server
(`python -m llama_cpp.server`, one request at a time) on the same model and threads, then
runs rounds of 1 and of `--clients` concurrent clients against each, the servers taking
turns round by round. Every client sends the same kind of chat request in a closed loop:
a shared system prompt (the prompt cache's case) and its own question, streamed, greedy,
EOS banned so every request generates its length: `--max-tokens`, or with `--stagger`
between half and 1.5 times that, by question (as chats differ in length; with equal
lengths the clients' requests all start in the same step, and each waits for the others'
prompts). A round lasts `--duration` seconds (the clients keep sending requests, and the
tokens that arrive by then count: a steady state), or with `--duration 0` until each client
has had `--requests` answers (the last requests then run with fewer clients). Reported per
server and client count: aggregate generated tokens/s of the best round and of the median
one (on a noisy host the ratio of two bests flatters whichever count got the luckier
round), the median time to first token, and whether each concurrent stream's text equals
the same request's text with one client.

The clients are plain HTTP/1.1 connections that keep the raw streams and decode them after
the round: they share the CPUs with the servers, and decoding JSON per chunk as it arrives
(`--client httpx`) takes CPU time from the server being measured.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._machine import cpu_model, measure_bandwidth
from ..assets.models import model_path as named_model_path
from .common import print_table

SYSTEM = ("You are a concise assistant. Answer in plain sentences, without lists or code, "
          "and keep to the question.")
QUESTIONS = [
    "Why is the sky blue?", "What does a compiler do?", "How do bees make honey?",
    "What is a prime number?", "Why do leaves change colour in autumn?", "What is inflation?",
    "How does a refrigerator keep food cold?", "What is the tallest mountain on Earth?",
]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, label: str, module: str, model: str, threads: int, n_ctx: int, extra: Sequence[str]):
        import httpx

        self.label = label
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", module, "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
               "--verbose", "false", *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label}: `{' '.join(cmd)}` exited with status {self.proc.returncode}")
            try:
                # /v1/models: llama_cpp.server has no /health; ours answers it 503 until loaded.
                if httpx.get(self.url + "/v1/models", timeout=60).status_code == 200 and (
                    module != "powerinfer_py.server" or httpx.get(self.url + "/health", timeout=60).status_code == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{label} did not come up within 180 s")
            time.sleep(0.3)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _chat_body(question: str, max_tokens: int, eos_bias: Dict[str, float]) -> Dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "logit_bias": eos_bias,
    }  # fmt: skip


# A content chunk: `"content": "` followed by anything but the closing quote.
_CONTENT = re.compile(rb'"content":\s*"[^"]')


def _chat(url: str, question: str, max_tokens: int, eos_bias: Dict[str, float],
          deadline: float = math.inf) -> Dict[str, Any]:
    """One streamed chat request over a plain HTTP/1.1 connection: the raw stream (with the
    arrival time of each piece) and the time to the first content chunk; the connection is
    closed at `deadline` if the stream is still running ("complete": False). The stream is
    parsed after the round (_parse): the clients share the server's CPUs, and a client that
    decodes JSON per chunk (httpx with json.loads cost 0.7-1 ms per token here) takes CPU
    time from the server it measures."""
    parsed = urllib.parse.urlsplit(url)
    body = json.dumps(_chat_body(question, max_tokens, eos_bias)).encode()
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    pieces: List[Tuple[float, bytes]] = []
    complete = True
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        while True:
            data = r.read1(65536)
            now = time.perf_counter()
            if not data:
                break
            if ttft is None and _CONTENT.search((pieces[-1][1][-64:] if pieces else b"") + data):
                ttft = now - t0
            pieces.append((now, data))
            if now >= deadline:
                complete = False
                break
    finally:
        conn.close()
    return {"pieces": pieces, "ttft": ttft if ttft is not None else time.perf_counter() - t0, "complete": complete}


def _chat_httpx(url: str, question: str, max_tokens: int, eos_bias: Dict[str, float],
                deadline: float = math.inf) -> Dict[str, Any]:
    """The same request with httpx, decoding each chunk as it arrives (--client httpx)."""
    import httpx

    t0 = time.perf_counter()
    ttft: Optional[float] = None
    pieces: List[Tuple[float, bytes]] = []
    complete = True
    with httpx.Client(timeout=600) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=_chat_body(question, max_tokens, eos_bias)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: {"):
                    if json.loads(line[6:])["choices"][0].get("delta", {}).get("content"):
                        ttft = ttft if ttft is not None else now - t0
                    pieces.append((now, line.encode() + b"\n"))
                if now >= deadline:
                    complete = False
                    break
    return {"pieces": pieces, "ttft": ttft if ttft is not None else time.perf_counter() - t0, "complete": complete}


def _parse(result: Dict[str, Any], deadline: float) -> Dict[str, Any]:
    """The text of a raw stream, and its content chunks (tokens): all of them, and those
    that arrived by `deadline`."""
    text, chunks, in_time = "", 0, 0
    tail = b""
    for t, data in result.pop("pieces"):
        lines = (tail + data).split(b"\n")
        tail = lines.pop()
        for line in lines:
            line = line.strip()
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                if delta.get("content"):
                    text += delta["content"]
                    chunks += 1
                    in_time += t <= deadline
    return dict(result, text=text, chunks=chunks, chunks_in_time=in_time)


# --stagger: request lengths, as fractions of --max-tokens, by question.
_STAGGER = [1.0, 0.5, 1.25, 0.75, 1.5, 0.625, 1.125, 0.875]


def _round(url: str, clients: int, per_client: int, max_tokens: int, eos_bias: Dict[str, float],
           stagger: bool, chat: Any = _chat, duration: float = 0.0) -> Dict[str, Any]:
    """`clients` clients, each sending requests one after another: `per_client` of them, or
    with `duration` as many as fit in that many seconds (the tokens that arrive in time
    count: a steady state of `clients` streams, without the tail of a fixed request count
    where the last client's requests run alone). Client c asks questions c*per_client,
    c*per_client + 1, ... (modulo their number)."""
    def length(q: int) -> int:
        return max(1, round(max_tokens * _STAGGER[q % len(_STAGGER)])) if stagger else max_tokens

    t0 = time.perf_counter()
    deadline = t0 + duration if duration > 0 else math.inf

    def client(c: int) -> List[Dict[str, Any]]:
        out = []
        for i in itertools.count():
            if (duration <= 0 and i >= per_client) or time.perf_counter() >= deadline:
                break
            q = (c * per_client + i) % len(QUESTIONS)
            out.append(dict(chat(url, QUESTIONS[q], length(q), eos_bias, deadline), question=QUESTIONS[q]))
        return out

    with ThreadPoolExecutor(clients) as ex:
        results = [r for rs in ex.map(client, range(clients)) for r in rs]
    end = time.perf_counter()
    wall = duration if duration > 0 else end - t0
    return {"wall": wall, "results": [_parse(r, deadline) for r in results]}


def _metrics(url: str) -> Dict[str, float]:
    """Our server's /metrics as {name: value} (the `powerinfer_` prefix dropped)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("powerinfer_"):
            out[name[len("powerinfer_"):]] = float(value)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a name from powerinfer_py.assets.models, or a GGUF path")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (and --n_parallel)")
    p.add_argument("--duration", type=float, default=10.0,
                   help="seconds per round: clients send requests until then, and the tokens that arrive in time "
                        "count (0: --requests requests per client, the round lasting until the last one ends)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per round with --duration 0")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--stagger", action="store_true", help="vary the request lengths (0.5x to 1.5x --max-tokens)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per server and client count: the table gives the best round and the median one "
                        "(the best for TTFT and the outputs)")
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama-cpp-python's server")
    p.add_argument("--client", choices=("lean", "httpx"), default="lean",
                   help="lean: plain HTTP, streams parsed after each round (default); httpx: httpx, each chunk "
                        "decoded as it arrives (the client then takes a share of the server's CPUs)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if min(args.threads, args.clients, args.requests, args.max_tokens, args.rounds) < 1 or args.duration < 0:
        p.error("--threads, --clients, --requests, --max-tokens and --rounds must be positive")
    model = args.model if os.path.isfile(args.model) else named_model_path(args.model)

    from .. import Llama

    vocab = Llama(model_path=model, vocab_only=True, verbose=False)
    eos_bias = {str(t): -100.0 for t in {vocab.token_eos(), *_end_tokens(vocab)} if t >= 0}
    vocab.close()

    print("measuring bandwidth ...", file=sys.stderr, flush=True)
    bandwidth = measure_bandwidth(args.threads) / 1e9
    servers: List[_Server] = []
    try:
        servers.append(_Server("powerinfer-py", "powerinfer_py.server", model, args.threads, args.n_ctx,
                               ["--n_parallel", str(args.clients)]))
        if not args.no_llama_cpp:
            servers.append(_Server("llama-cpp-python", "llama_cpp.server", model, args.threads, args.n_ctx,
                                   ["--interrupt_requests", "false"]))  # serve the queue, do not cut streams
        best: Dict[tuple, Dict[str, Any]] = {}
        rates: Dict[tuple, List[float]] = {}
        for rnd in range(args.rounds):
            for clients in (1, args.clients):
                for server in servers:
                    print(f"round {rnd + 1}: {server.label}, {clients} client(s) ...", file=sys.stderr, flush=True)
                    r = _round(server.url, clients, args.requests, args.max_tokens, eos_bias, args.stagger,
                               _chat if args.client == "lean" else _chat_httpx, args.duration)
                    r["tokens"] = sum(x["chunks_in_time"] for x in r["results"])
                    r["tok_s"] = r["tokens"] / r["wall"]
                    key = (server.label, clients)
                    rates.setdefault(key, []).append(r["tok_s"])
                    if key not in best or r["tok_s"] > best[key]["tok_s"]:
                        best[key] = r
        ours = _metrics(servers[0].url)
    finally:
        for server in servers:
            server.close()

    rows, out = [], []
    for (label, clients), r in best.items():
        # Streams cut at the round's end are left out of the comparison and the TTFT.
        solo = {x["question"]: x["text"] for x in best[(label, 1)]["results"] if x["complete"]}
        same = all(solo.get(x["question"], x["text"]) == x["text"] for x in r["results"] if x["complete"])
        ttft = statistics.median(x["ttft"] for x in r["results"] if x["complete"])
        base = best[(label, 1)]
        base_ttft = statistics.median(x["ttft"] for x in base["results"] if x["complete"])
        median = statistics.median(rates[(label, clients)])
        base_median = statistics.median(rates[(label, 1)])
        rows.append([label, str(clients), f"{r['tok_s']:.1f}", f"{r['tok_s'] / base['tok_s']:.2f}x",
                     f"{median:.1f}", f"{median / base_median:.2f}x",
                     f"{ttft * 1000:.0f}", f"{ttft / base_ttft:.2f}x",
                     "yes" if same else "NO"])  # fmt: skip
        out.append({"server": label, "clients": clients, "tok_s": r["tok_s"], "tok_s_rounds": rates[(label, clients)],
                    "ttft_median_s": ttft, "outputs_equal_solo": same, "wall_s": r["wall"],
                    "tokens": r["tokens"]})  # fmt: skip
    print_table(
        f"Concurrent streamed chat completions: {os.path.basename(model)}, {args.threads} threads, "
        + (f"{args.duration:g} s per round" if args.duration > 0 else f"{args.requests} requests per client")
        + f", {args.max_tokens} tokens each{' (staggered: 0.5x-1.5x)' if args.stagger else ''}; "
        + f"{args.client} client; bandwidth {bandwidth:.1f} GB/s",
        ["server", "clients", "aggregate tok/s (best round)", "vs 1 client", "median round tok/s", "vs 1 client",
         "median TTFT ms", "TTFT vs 1 client", "outputs = 1-client run"],
        rows,
    )  # fmt: skip
    busy = ours.get("busy_seconds_total", 0.0)
    print(f"powerinfer-py, all rounds: {ours.get('decode_steps_total', 0):.0f} steps, "
          f"{ours.get('decode_steps_restarted_total', 0):.0f} interrupted for a new request and computed again "
          f"({ours.get('restart_seconds_total', 0):.2f} s thrown away, "
          f"{100 * ours.get('restart_seconds_total', 0) / busy if busy else 0:.1f}% of {busy:.1f} s computing); "
          f"{ours.get('prompt_tokens_cached_total', 0):.0f} prompt tokens from the cache, "
          f"{ours.get('prompt_tokens_total', 0):.0f} computed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "bandwidth_gbs": bandwidth, "model": model, "rows": out, "metrics": ours},
                      f, indent=1)
    return 0


def _end_tokens(vocab: Any) -> List[int]:
    """End-of-turn tokens the chat template may stop on (<|im_end|>, <|endoftext|>)."""
    ids = []
    for text in (b"<|im_end|>", b"<|endoftext|>", b"<|eot_id|>"):
        toks = vocab.tokenize(text, add_bos=False, special=True)
        if len(toks) == 1:
            ids.append(toks[0])
    return ids


if __name__ == "__main__":
    sys.exit(main())
