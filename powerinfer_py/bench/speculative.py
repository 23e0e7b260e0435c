"""Speculative decoding: decode speed with and without drafts, acceptance, tokens per verify
step, and the acceptance each setting needs to pay on this CPU (docs/speculative.md).

    python -m powerinfer_py.bench speculative [--settings lookup,draft,self] [--threads 2]
                                              [--n-gen 256] [--reps 2] [--json FILE]

Settings, each in a fresh process of its own (one for llama-cpp-python in `self`, whose
7B-shaped pair does not fit twice in memory):
- lookup: prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding(num_pred_tokens=10), the
  same object given to both engines) on input-copying tasks: edit a code file, summarise a text
  quoting it. Qwen2.5-Coder-0.5B (--lookup-model).
- draft: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (-md), code completion.
- self: the 7B-shaped synthetic pair: the PowerInfer file in predictor mode (the active rows
  only) drafts for its dense twin, which checks the drafts (the text is the dense model's).

Every run is greedy, from the same prompt tokens, with the same threads. Decode speed is the
generated tokens after the first over the time after the first (the prompt is not in it).
Runs alternate between the engines, `--reps` rounds, best of each. "same text" compares each
drafting run's tokens with the run without drafts on the same kernels (ours: batch-invariant;
llama-cpp-python: its own, whose check batch rounds differently from one-token steps).

Break-even: a verify decode of the token and k drafts costs V(k), a one-token step T, a draft
model's token D; drafting k tokens pays once a step gives more than (V(k) + k D) / T tokens,
i.e. when the acceptance rate a (each draft kept with probability a) exceeds the root of
1 + a + ... + a^k = (V(k) + k D) / T.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .._machine import cpu_model, measure_bandwidth
from ..assets.models import model_path as named_model_path
from .common import ChildError, default_pair, missing_pair, print_table, spawn

SETTINGS = ("lookup", "draft", "self")
N_CTX = 2048
NUM_PRED_TOKENS = 10  # LlamaPromptLookupDecoding's default, what llama-cpp-python's server uses
VERIFY_KS = (1, 2, 4, 8, 16)

# ---- the tasks ---------------------------------------------------------------------------------

CODE_FILE = '''import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(order=True)
class Entry:
    cost: float
    node: str = field(compare=False)


class Graph:
    """A weighted directed graph kept as adjacency lists."""

    def __init__(self) -> None:
        self.edges: Dict[str, List[Tuple[str, float]]] = {}

    def add_edge(self, src: str, dst: str, weight: float) -> None:
        if weight < 0:
            raise ValueError("negative weights are not supported")
        self.edges.setdefault(src, []).append((dst, weight))
        self.edges.setdefault(dst, [])

    def neighbours(self, node: str) -> List[Tuple[str, float]]:
        return self.edges.get(node, [])

    def shortest_paths(self, start: str) -> Dict[str, float]:
        dist: Dict[str, float] = {start: 0.0}
        queue = [Entry(0.0, start)]
        while queue:
            entry = heapq.heappop(queue)
            if entry.cost > dist.get(entry.node, float("inf")):
                continue
            for nxt, weight in self.neighbours(entry.node):
                cost = entry.cost + weight
                if cost < dist.get(nxt, float("inf")):
                    dist[nxt] = cost
                    heapq.heappush(queue, Entry(cost, nxt))
        return dist

    def path(self, start: str, goal: str) -> Optional[List[str]]:
        prev: Dict[str, str] = {}
        dist: Dict[str, float] = {start: 0.0}
        queue = [Entry(0.0, start)]
        while queue:
            entry = heapq.heappop(queue)
            if entry.node == goal:
                break
            for nxt, weight in self.neighbours(entry.node):
                cost = entry.cost + weight
                if cost < dist.get(nxt, float("inf")):
                    dist[nxt] = cost
                    prev[nxt] = entry.node
                    heapq.heappush(queue, Entry(cost, nxt))
        if goal not in dist:
            return None
        out = [goal]
        while out[-1] != start:
            out.append(prev[out[-1]])
        return out[::-1]
'''

QUOTE_TEXT = (
    "The committee met on Tuesday to review the proposal for the new library. The architect explained that "
    "the building would use timber from local forests and would need no air conditioning in summer. Several "
    "members asked about the cost. The treasurer said that the budget allowed for the building but not for "
    "the furniture, and that a second grant would be needed before the doors could open. The chair proposed "
    "that the committee write to the regional council before the end of the month. The motion was carried "
    "with seven votes in favour and two against. The members who voted against said that the town should "
    "first repair the old library on Market Street, whose roof has leaked since the storm of last winter."
)

LOOKUP_TASKS = {
    "code edit": "Here is a Python file:\n\n```python\n" + CODE_FILE + "```\n\nRename the method `neighbours` "
                 "to `successors` everywhere. Answer with the whole file, changed, in a Python code block.",
    "quote summary": "Read this text:\n\n" + QUOTE_TEXT + "\n\nSummarise it in a few sentences, quoting its "
                     "sentences word for word where you can.",
}

COMPLETION_PROMPT = (
    "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, with a docstring, "
    "type hints and a few doctests.<|im_end|>\n<|im_start|>assistant\n"
)

SELF_PROMPT = "The history of the city begins with a small settlement by the river, where "


def chatml(message: str) -> str:
    """A user message in the chat template both Qwen2.5 and SmolLM2 use (ChatML)."""
    return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n"
            "<|im_start|>assistant\n")


# ---- measuring ---------------------------------------------------------------------------------


def run_generate(llm: Any, tokens: List[int], n_gen: int) -> Dict[str, Any]:
    """Greedy generate() from `tokens` until an end-of-generation token or n_gen tokens (the
    same loop for both engines): the tokens, and the decode speed after the first token."""
    out: List[int] = []
    t0 = time.perf_counter()
    t_first = t0
    for token in llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if not out:
            t_first = time.perf_counter()
        if llm.token_eos() == token or _is_eog(llm, token):
            break
        out.append(int(token))
        if len(out) >= n_gen:
            break
    t_end = time.perf_counter()
    n = len(out)
    return {"tokens": out, "decode_s": t_end - t_first, "prompt_s": t_first - t0,
            "tok_s": (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0}


def _is_eog(llm: Any, token: int) -> bool:
    fn = getattr(llm, "token_is_eog", None)
    if fn is not None:
        return bool(fn(token))
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))


class Run:
    """One engine configuration: a callable returning run_generate's result, plus its
    drafting counters."""

    def __init__(self, label: str, engine: str, drafting: str, fn: Callable[[], Dict[str, Any]],
                 stats: Optional[Callable[[], Dict[str, Any]]] = None, same_as: Optional[str] = None):
        self.label, self.engine, self.drafting, self.fn, self.stats = label, engine, drafting, fn, stats
        self.same_as = same_as
        self.best: Optional[Dict[str, Any]] = None
        self.spec: Dict[str, Any] = {}

    def once(self) -> None:
        before = self.stats() if self.stats else None
        r = self.fn()
        if before is not None:
            r["spec"] = _spec_delta_from(before, self.stats())
        if self.best is None or r["tok_s"] > self.best["tok_s"]:
            self.best = r


def _spec_delta_from(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    d = {k: after[k] - before[k] for k in ("verify_steps", "drafted", "accepted", "generated")}
    d["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else None
    d["tokens_per_step"] = d["generated"] / d["verify_steps"] if d["verify_steps"] else None
    return d


def alternate(runs: Sequence[Run], reps: int) -> None:
    """Every run once per round, `reps` rounds: the engines share the bandwidth's drift."""
    for _ in range(reps):
        for run in runs:
            run.once()


def results(runs: Sequence[Run], baseline: str) -> List[Dict[str, Any]]:
    base = next(r for r in runs if r.label == baseline).best["tok_s"]
    by_label = {r.label: r for r in runs}
    out = []
    for r in runs:
        spec = r.best.get("spec", {})
        same = None
        if r.same_as is not None:
            same = r.best["tokens"] == by_label[r.same_as].best["tokens"]
        out.append({"label": r.label, "engine": r.engine, "drafting": r.drafting, "tok_s": r.best["tok_s"],
                    "vs_baseline": r.best["tok_s"] / base if base else None, "n_tokens": len(r.best["tokens"]),
                    "prompt_s": r.best["prompt_s"], "acceptance_rate": spec.get("acceptance_rate"),
                    "tokens_per_step": spec.get("tokens_per_step"), "same_text": same})
    return out


def verify_costs(llm: Any, tokens: List[int], ks: Sequence[int] = VERIFY_KS, reps: int = 3) -> Dict[str, float]:
    """Seconds of one decode of k + 1 tokens with every row's logits (a verify step), and of
    one token (k = 0), after `tokens`: the best of `reps`."""
    ctx, pos = llm._ctx, len(tokens)
    llm.reset()
    llm.eval(tokens)
    out: Dict[str, float] = {}
    for k in (0, *ks):
        batch = [tokens[-1]] * (k + 1)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            ctx.decode(batch, pos, k > 0)
            best = min(best, time.perf_counter() - t)
        out[str(k)] = best
    llm.reset()
    return out


def draft_token_cost(drafter: Any, tokens: List[int], reps: int = 8) -> float:
    """Seconds of one draft-model token (a one-token decode of the draft's context)."""
    ctx = drafter.ctx
    ctx.decode(tokens, 0, False)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        ctx.decode([tokens[-1]], len(tokens) + i, False)
        times.append(time.perf_counter() - t)
    drafter.seq.reset()
    return float(np.median(times))


def break_even(costs: Dict[str, float], draft_s: float = 0.0) -> Dict[str, Optional[float]]:
    """The acceptance rate each k needs (speculative.break_even_acceptance)."""
    from .._llama.speculative import break_even_acceptance

    one = costs["0"]
    return {k: break_even_acceptance(int(k), (costs[k] + int(k) * draft_s) / one) for k in costs if k != "0"}


# ---- the settings (each in a child process) ------------------------------------------------------


def _ours(path: str, threads: int, **kw: Any):
    from ..llama import Llama

    return Llama(path, n_ctx=N_CTX, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False,
                 fallback=False, **kw)


def _upstream(path: str, threads: int, **kw: Any):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_batch=512, n_threads=threads, n_threads_batch=threads,
                           verbose=False, **kw)


def _lookup() -> Any:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaPromptLookupDecoding(num_pred_tokens=NUM_PRED_TOKENS)


def lookup_child(model: str, threads: int, n_gen: int, reps: int) -> Dict[str, Any]:
    """Setting (a): prompt lookup on the copying tasks, both engines in this process."""
    ours_plain = _ours(model, threads)
    ours_bi = _ours(model, threads, batch_invariant=True)
    ours_pld = _ours(model, threads, draft_model=_lookup())
    up_plain = _upstream(model, threads)
    # logits_all: llama-cpp-python 0.3.36 sizes its score rows by logits_all (n_batch rows
    # without) while a draft makes it write one per position: past n_batch positions its
    # prompt lookup fails (ValueError in eval) unless the script asks for every row.
    up_pld = _upstream(model, threads, draft_model=_lookup(), logits_all=True)
    tasks = {}
    for name, message in LOOKUP_TASKS.items():
        prompt = ours_plain.tokenize(chatml(message).encode(), add_bos=False, special=True)
        runs = [
            Run("llama-cpp-python", "llama-cpp-python", "none", lambda: run_generate(up_plain, prompt, n_gen)),
            Run("llama-cpp-python + lookup", "llama-cpp-python", "prompt lookup",
                lambda: run_generate(up_pld, prompt, n_gen), same_as="llama-cpp-python"),
            Run("powerinfer-py", "powerinfer-py", "none", lambda: run_generate(ours_plain, prompt, n_gen)),
            Run("powerinfer-py, batch-invariant", "powerinfer-py", "none (batch-invariant kernels)",
                lambda: run_generate(ours_bi, prompt, n_gen)),
            Run("powerinfer-py + lookup", "powerinfer-py", "prompt lookup", lambda: run_generate(ours_pld, prompt, n_gen),
                stats=ours_pld.speculative_stats, same_as="powerinfer-py, batch-invariant"),
        ]
        alternate(runs, reps)
        tasks[name] = {"prompt_tokens": len(prompt), "rows": results(runs, "powerinfer-py")}
    costs = verify_costs(ours_bi, ours_plain.tokenize(chatml(LOOKUP_TASKS["code edit"]).encode(), add_bos=False,
                                                     special=True))
    return {"model": os.path.basename(model), "tasks": tasks, "verify_costs": costs, "break_even": break_even(costs)}


def draft_child(target: str, draft: str, threads: int, n_gen: int, reps: int, draft_max: int) -> Dict[str, Any]:
    """Setting (b): a draft model for a larger one, code completion."""
    ours_plain = _ours(target, threads)
    ours_spec = _ours(target, threads, draft_model_path=draft, draft_max=draft_max)
    up_plain = _upstream(target, threads)
    prompt = ours_plain.tokenize(COMPLETION_PROMPT.encode(), add_bos=False, special=True)
    drafter = ours_spec._drafter

    def without_draft() -> Dict[str, Any]:
        ours_spec._drafter = None  # the same Llama, kernels and all, drafting nothing
        try:
            return run_generate(ours_spec, prompt, n_gen)
        finally:
            ours_spec._drafter = drafter

    runs = [
        Run("llama-cpp-python", "llama-cpp-python", "none", lambda: run_generate(up_plain, prompt, n_gen)),
        Run("powerinfer-py", "powerinfer-py", "none", lambda: run_generate(ours_plain, prompt, n_gen)),
        Run("powerinfer-py, batch-invariant", "powerinfer-py", "none (batch-invariant kernels)", without_draft),
        Run("powerinfer-py + draft model", "powerinfer-py", f"{os.path.basename(draft)}, draft_max {draft_max}",
            lambda: run_generate(ours_spec, prompt, n_gen), stats=ours_spec.speculative_stats,
            same_as="powerinfer-py, batch-invariant"),
    ]
    alternate(runs, reps)
    costs = verify_costs(ours_spec, prompt)
    d = draft_token_cost(drafter, prompt)
    return {"target": os.path.basename(target), "draft": os.path.basename(draft), "prompt_tokens": len(prompt),
            "rows": results(runs, "powerinfer-py"), "verify_costs": costs, "draft_token_s": d,
            "break_even": break_even(costs, d)}


def self_upstream_child(dense: str, threads: int, n_gen: int, reps: int) -> Dict[str, Any]:
    """Setting (c), llama-cpp-python on the dense file (alone: the pair does not fit twice)."""
    up = _upstream(dense, threads)
    prompt = up.tokenize(SELF_PROMPT.encode(), add_bos=True)
    runs = [Run("llama-cpp-python", "llama-cpp-python", "none", lambda: run_generate(up, prompt, n_gen))]
    alternate(runs, reps)
    return {"prompt": prompt, "rows": results(runs, "llama-cpp-python"), "tokens": runs[0].best["tokens"]}


def self_child(dense: str, powerinfer: str, threads: int, n_gen: int, reps: int, draft_max: int,
               prompt: List[int]) -> Dict[str, Any]:
    """Setting (c), ours: the PowerInfer file (predictor mode) drafts for its dense twin."""
    spec = _ours(dense, threads, draft_model_path=powerinfer, draft_max=draft_max, draft_p_min=0.0)
    drafter = spec._drafter
    sparse = _ours(powerinfer, threads)

    def without_draft() -> Dict[str, Any]:
        spec._drafter = None
        try:
            return run_generate(spec, prompt, n_gen)
        finally:
            spec._drafter = drafter

    runs = [
        Run("powerinfer-py, batch-invariant", "powerinfer-py", "none (dense, batch-invariant kernels)", without_draft),
        Run("powerinfer-py, predictor mode", "powerinfer-py", "none (the sparse file alone: approximate text)",
            lambda: run_generate(sparse, prompt, n_gen)),
        Run("powerinfer-py + self-draft", "powerinfer-py", f"predictor-mode twin, draft_max {draft_max}",
            lambda: run_generate(spec, prompt, n_gen), stats=spec.speculative_stats,
            same_as="powerinfer-py, batch-invariant"),
    ]
    alternate(runs, reps)
    costs = verify_costs(spec, prompt, ks=(1, 2, 4, 8))
    d = draft_token_cost(drafter, prompt)
    out = {"rows": results(runs, "powerinfer-py, batch-invariant"), "verify_costs": costs, "draft_token_s": d,
           "break_even": break_even(costs, d), "sparse_active": sparse.sparse_stats()["active"]}
    sparse.close()
    spec.close()
    plain = _ours(dense, threads)
    runs = [Run("powerinfer-py", "powerinfer-py", "none", lambda: run_generate(plain, prompt, n_gen))]
    alternate(runs, reps)
    out["plain"] = results(runs, "powerinfer-py")[0]
    return out


# ---- the parent ---------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".1f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


def _rows_table(rows: List[Dict[str, Any]], base_label: str) -> List[List[str]]:
    return [[r["label"], r["drafting"], _fmt(r["tok_s"]), _fmt(r["vs_baseline"], ".2f") + "x",
             _fmt(r["acceptance_rate"], ".0%") if r["acceptance_rate"] is not None else "-",
             _fmt(r["tokens_per_step"], ".2f"), str(r["n_tokens"]), _fmt(r["same_text"])] for r in rows]


HEADER = ["run", "drafting", "decode tok/s", "vs {base}", "accepted", "tokens / verify step", "tokens", "same text"]


def _cost_rows(res: Dict[str, Any]) -> List[List[str]]:
    costs, be = res["verify_costs"], res["break_even"]
    one = costs["0"]
    return [[k, f"{costs[k] * 1e3:.1f}", f"{costs[k] / one:.2f}", _fmt(be[k], ".0%", "never")] for k in be]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer_py.bench speculative",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=256, help="tokens generated at most per run")
    p.add_argument("--reps", type=int, default=2, help="rounds; the best of each run is reported")
    p.add_argument("--lookup-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft-max", type=int, default=8)
    pair = default_pair()
    p.add_argument("--dense", default=pair["dense"])
    p.add_argument("--powerinfer", default=pair["powerinfer"])
    p.add_argument("--self-n-gen", type=int, default=64)
    p.add_argument("--self-draft-max", type=int, default=4)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        print(f"error: unknown setting {bad[0]!r} (of {', '.join(SETTINGS)})", file=sys.stderr)
        return 2

    def path(name: str) -> str:
        return name if os.path.exists(name) else named_model_path(name)

    bw = measure_bandwidth(a.threads)
    print(f"CPU: {cpu_model()}; read bandwidth {bw / 1e9:.1f} GB/s with {a.threads} threads\n")
    out: Dict[str, Any] = {"cpu": cpu_model(), "bandwidth_gb_s": bw / 1e9, "threads": a.threads}
    try:
        if "lookup" in settings:
            res = spawn(lookup_child, model=path(a.lookup_model), threads=a.threads, n_gen=a.n_gen, reps=a.reps)
            out["lookup"] = res
            for task, t in res["tasks"].items():
                print_table(f"(a) Prompt lookup (num_pred_tokens={NUM_PRED_TOKENS}), {res['model']}, task: {task} "
                            f"({t['prompt_tokens']} prompt tokens, greedy, {a.threads} threads, best of {a.reps})",
                            [h.format(base="ours") for h in HEADER], _rows_table(t["rows"], "powerinfer-py"))
                print()
            print_table(f"Verify step cost, {res['model']} (batch-invariant kernels): the acceptance rate prompt "
                        "lookup needs to pay", ["k drafts", "ms", "x one-token step", "break-even acceptance"],
                        _cost_rows(res))
            print()
        if "draft" in settings:
            res = spawn(draft_child, target=path(a.target), draft=path(a.draft), threads=a.threads, n_gen=a.n_gen,
                        reps=a.reps, draft_max=a.draft_max)
            out["draft"] = res
            print_table(f"(b) Draft model {res['draft']} for {res['target']}, code completion "
                        f"({res['prompt_tokens']} prompt tokens, greedy, {a.threads} threads, best of {a.reps}); "
                        "llama-cpp-python has no draft models", [h.format(base="ours") for h in HEADER],
                        _rows_table(res["rows"], "powerinfer-py"))
            print()
            print_table(f"Verify step cost, {res['target']}, and the draft's token "
                        f"({res['draft_token_s'] * 1e3:.1f} ms): the acceptance rate the draft needs",
                        ["k drafts", "ms", "x one-token step", "break-even acceptance"], _cost_rows(res))
            print()
        if "self" in settings:
            err = missing_pair([a.dense, a.powerinfer])
            if err:
                print(err, file=sys.stderr)
                return 1
            up = spawn(self_upstream_child, dense=a.dense, threads=a.threads, n_gen=a.self_n_gen, reps=a.reps)
            res = spawn(self_child, dense=a.dense, powerinfer=a.powerinfer, threads=a.threads, n_gen=a.self_n_gen,
                        reps=a.reps, draft_max=a.self_draft_max, prompt=up["prompt"])
            out["self"] = {"upstream": up["rows"], **res}
            rows = up["rows"] + [res["plain"]] + res["rows"]
            base = res["plain"]["tok_s"]
            for r in rows:
                r["vs_baseline"] = r["tok_s"] / base if base else None
            print_table(f"(c) Self-speculation, 7B-shaped synthetic pair: {os.path.basename(a.powerinfer)} "
                        f"(predictor mode, {res['sparse_active']:.0%} of FFN neurons active) drafts for "
                        f"{os.path.basename(a.dense)} ({len(up['prompt'])} prompt tokens, greedy, {a.threads} threads, "
                        f"best of {a.reps}; llama-cpp-python and the last two rows in separate processes)",
                        [h.format(base="ours") for h in HEADER], _rows_table(rows, "powerinfer-py"))
            print()
            print_table(f"Verify step cost, dense 7B shape, and the sparse draft's token "
                        f"({res['draft_token_s'] * 1e3:.1f} ms): the acceptance rate self-speculation needs",
                        ["k drafts", "ms", "x one-token step", "break-even acceptance"], _cost_rows(res))
            print()
    except ChildError as e:
        print(f"error: a benchmark child failed ({e.reason}):\n{e.output[-2000:]}", file=sys.stderr)
        return 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
