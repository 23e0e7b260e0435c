"""Speed and memory of powerinfer_py.Llama against llama_cpp.Llama, same machine, same run.

    python -m powerinfer_py.bench [dense] [--models smollm2,qwen2.5-coder-0.5b] [--threads 2]
                                          [--n-prompt 128] [--n-gen 128] [--reps 2]

Each (model, engine) pair runs in its own fresh subprocess, so the peak RSS it
reports belongs to that engine alone. A child loads the model, builds a prompt of
exactly n_prompt tokens, then, best of --reps: times one evaluation of the whole
prompt, and a greedy decode of n_gen tokens, one token per evaluation, ignoring
EOS. Both engines use the same threads, n_ctx=512 and n_batch=512.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..assets.models import model_path as named_model_path
from .common import ChildError, peak_rss_mib, print_table, spawn

ENGINES = ("powerinfer", "llama-cpp-python")
N_CTX = 512
N_BATCH = 512
N_TOKENS_COMPARED = 32  # greedy tokens reported so the parent can check both engines agree

# Deterministic prompt text; repeated until it yields n_prompt tokens.
PROMPT_TEXT = (
    "In the beginning of the industrial age, the cities of northern England grew faster "
    "than anyone had planned. Mills rose along every river, and the people who came to "
    "work in them lived in narrow streets of brick houses built in haste. Water came from "
    "wells and pumps shared by dozens of families, and the sewers, where there were any, "
    "emptied into the same rivers that turned the mill wheels. "
)


# --------------------------------------------------------------------------- child


class _Engine:
    """The few calls the benchmark needs, with equal overhead for both engines. Each
    engine is imported here, in its own child, so the other's library is not mapped
    into the process whose peak RSS is measured."""

    def __init__(self, name: str, model_path: str, threads: int):
        self.name = name
        if name == "powerinfer":
            from ..llama import Llama

            self.llm = Llama(
                model_path,
                n_ctx=N_CTX,
                n_batch=N_BATCH,
                n_threads=threads,
                n_threads_batch=threads,
                fallback=False,
                verbose=False,
            )
            self.weights_bytes = self.llm._model.size()
        elif name == "llama-cpp-python":
            import llama_cpp

            self._llama_cpp = llama_cpp
            self.llm = llama_cpp.Llama(
                model_path=model_path,
                n_ctx=N_CTX,
                n_batch=N_BATCH,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
            self.weights_bytes = int(llama_cpp.llama_model_size(self.llm.model))
        else:
            raise ValueError(f"unknown engine {name!r}; choose from {ENGINES}")
        self.n_vocab = self.llm.n_vocab()

    def tokenize(self, text: bytes) -> List[int]:
        return self.llm.tokenize(text, add_bos=True, special=False)

    def reset(self) -> None:
        self.llm.reset()

    def eval(self, tokens: Sequence[int]) -> None:
        self.llm.eval(tokens)

    def argmax_last(self) -> int:
        if self.name == "powerinfer":
            row = self.llm._last_logits_view()
        else:
            ptr = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
            row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return int(row.argmax())


def _prompt_tokens(engine: _Engine, n_prompt: int) -> List[int]:
    text = PROMPT_TEXT
    while True:
        tokens = engine.tokenize(text.encode("utf-8"))
        if len(tokens) >= n_prompt:
            return tokens[:n_prompt]
        text += PROMPT_TEXT


def run_child(engine_name: str, model_path: str, threads: int, n_prompt: int, n_gen: int, reps: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    engine = _Engine(engine_name, model_path, threads)
    load_s = time.perf_counter() - t0

    prompt = _prompt_tokens(engine, n_prompt)
    best_prompt_s = best_gen_s = float("inf")
    generated: List[int] = []
    for _ in range(reps):
        engine.reset()
        t0 = time.perf_counter()
        engine.eval(prompt)
        best_prompt_s = min(best_prompt_s, time.perf_counter() - t0)

        token = engine.argmax_last()
        generated = [token]
        t0 = time.perf_counter()
        for _ in range(n_gen):  # n_gen single-token evaluations
            engine.eval([token])
            token = engine.argmax_last()
            generated.append(token)
        best_gen_s = min(best_gen_s, time.perf_counter() - t0)

    return {
        "engine": engine_name,
        "model_path": model_path,
        "threads": threads,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "load_s": load_s,
        "prompt_s": best_prompt_s,
        "prompt_tok_s": n_prompt / best_prompt_s,
        "decode_s": best_gen_s,
        "decode_tok_s": n_gen / best_gen_s,
        "peak_rss_mib": peak_rss_mib(),
        "weights_bytes": engine.weights_bytes,
        "file_bytes": os.path.getsize(model_path),
        "prompt_sha1": hashlib.sha1(np.asarray(prompt, dtype=np.int32).tobytes()).hexdigest(),
        "first_tokens": generated[:N_TOKENS_COMPARED],
    }


# --------------------------------------------------------------------------- parent


def _spawn(engine: str, model_path: str, args: argparse.Namespace) -> Dict[str, Any]:
    try:
        return spawn(run_child, engine_name=engine, model_path=model_path, threads=args.threads,
                     n_prompt=args.n_prompt, n_gen=args.n_gen, reps=args.reps)
    except ChildError as e:
        return {"engine": engine, "error": f"{e.reason}: {e.output[-800:]}"}


def _ratio(x: Optional[float], ref: Optional[float]) -> str:
    return f"{x / ref:.2f}x" if x and ref else "-"


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def print_report(rows: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    header = ["model", "engine", "prompt tok/s", "decode tok/s", "peak RSS MiB", "prompt vs lcp", "decode vs lcp"]
    table: List[List[str]] = []
    notes: List[str] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        group = {r["engine"]: r for r in rows if r["model"] == model}
        ref = group.get("llama-cpp-python", {})
        for engine in ENGINES:
            r = group.get(engine)
            if r is None:
                continue
            if "error" in r:
                table.append([model, engine, "error", "-", "-", "-", "-"])
                notes.append(f"{model} / {engine}: {r['error']}")
                continue
            table.append([
                model, engine, f"{r['prompt_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}",
                f"{r['peak_rss_mib']:.0f}",
                _ratio(r["prompt_tok_s"], ref.get("prompt_tok_s")),
                _ratio(r["decode_tok_s"], ref.get("decode_tok_s")),
            ])  # fmt: skip
        ok = [group[e] for e in ENGINES if e in group and "error" not in group[e]]
        if ok:
            size = ok[0]["file_bytes"]
            bw = ", ".join(
                f"{r['engine']} {size * r['decode_tok_s'] / 1e9:.2f} GB/s" for r in ok
            )
            notes.append(
                f"{model}: weights file {size / 2**20:.1f} MiB "
                f"(tensor data {ok[0]['weights_bytes'] / 2**20:.1f} MiB); "
                f"implied decode bandwidth (file size x decode tok/s): {bw}"
            )
        if len(ok) == 2:
            a, b = ok
            if a["prompt_sha1"] != b["prompt_sha1"]:
                notes.append(f"{model}: WARNING the engines tokenized the prompt differently")
            d = _first_divergence(a["first_tokens"], b["first_tokens"])
            notes.append(
                f"{model}: first {len(a['first_tokens'])} greedy tokens "
                + ("identical" if d is None else f"diverge at step {d}")
            )

    print_table(
        f"threads {args.threads}, n_ctx {N_CTX}, n_batch {N_BATCH}, prompt {args.n_prompt} tokens, "
        f"decode {args.n_gen} tokens (greedy, EOS ignored), best of {args.reps}",
        header, table, align=True,
    )
    for note in notes:
        print(note)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench [dense]", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b",
                   help="comma-separated names from powerinfer_py.assets.models, or GGUF paths")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-prompt", type=int, default=128)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    args = p.parse_args(argv)

    if args.n_prompt < 1 or args.n_gen < 1 or args.reps < 1 or args.threads < 1:
        p.error("--n-prompt, --n-gen, --reps and --threads must be positive")
    if args.n_prompt + args.n_gen > N_CTX:
        p.error(f"--n-prompt + --n-gen must fit in n_ctx={N_CTX}")

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    rows: List[Dict[str, Any]] = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        path = model if os.path.isfile(model) else named_model_path(model)
        for engine in engines:
            print(f"running {model} on {engine} ...", file=sys.stderr, flush=True)
            result = _spawn(engine, path, args)
            result["model"] = model
            rows.append(result)
    print_report(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
