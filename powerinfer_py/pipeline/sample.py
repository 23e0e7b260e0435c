"""powerinfer sample MODEL.gguf --out SAMPLES.jsonl --n-tokens N

Text sampled from a model, as training data that no corpus has to supply (data-free
distillation): `relufy` distilled on the original model's own samples keeps the student
close to it on the kinds of text the model itself writes, such as the modern
conversational English that corpora installable offline (scripture, plays, code, manual
pages) lack.

Each sample answers one prompt:
- two in three are chat requests (the model's chat template), a task form ("Explain ...",
  "Write a short story about ...", "Give advice on ...") applied to a topic, both drawn
  from fixed generic lists below; the sample is the model's reply;
- one in three continues a plain-text opener ("Dear Sam,", "In 1998,"), without the chat
  template; the sample is the opener and its continuation.
None of the prompts quotes any evaluation text.

Sampling: temperature 0.8, top-p 0.95 and top-k 100 (the model's own distribution, its
far tail cut), at most --max-tokens per sample; sample i uses seed SEED + i. Samples are generated
--parallel at a time in one batch (ParallelLlama with the packed kernels), and each
stream equals its solo run, so the output depends only on the arguments. Samples are
kept in index order until their completion tokens reach --n-tokens.

Output: JSON lines, one per sample: {"i", "kind" (chat|text), "prompt", "text",
"n_tokens"}; the first line is a header {"powerinfer_samples": {settings}}. With
--skip-existing, an output whose header has the same settings is kept as it is. The
file is written to a temporary name and renamed, so an interrupted run leaves no
partial file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .common import PipelineError, Progress, files, read_samples, replacing, run_cli

TOPICS = (
    "cooking dinner for friends", "the ocean", "a job interview", "friendship", "learning to drive",
    "a rainy afternoon", "ancient Rome", "growing tomatoes", "a cat that will not come down from a tree",
    "travelling to the Moon", "saving money", "learning the guitar", "a long train journey", "winter in the city",
    "the first day at a new school", "planning a birthday party", "climate and weather", "a visit to the dentist",
    "the history of the bicycle", "moving to a new country", "a football match", "sleep", "electric cars",
    "a small bakery", "volcanoes", "writing a novel", "a lost wallet", "chess", "bees and honey", "a wedding",
    "the internet", "running a marathon", "an old lighthouse", "making coffee", "a noisy neighbour",
    "the stock market", "dinosaurs", "a summer holiday by the sea", "recycling", "a haunted house",
    "photography", "the French Revolution", "a robot that learns to paint", "time management", "a farm in spring",
    "mountains", "the human heart", "a museum at night", "video games", "politeness", "an elephant", "libraries",
    "the invention of the printing press", "a thunderstorm", "choosing a pet", "city buses", "a detective story",
    "the solar system", "baking bread", "a grandmother's advice", "working from home", "rivers", "a magic trick",
    "the Olympic Games",
)
FORMS = (
    "Explain {t} to a ten-year-old.", "Write a short story about {t}.", "Give me some advice about {t}.",
    "Write a short poem about {t}.", "What are the pros and cons of {t}?", "Tell me a fun fact about {t}.",
    "Write a friendly letter to a friend about {t}.", "Describe {t} in a few paragraphs.",
    "Write a short dialogue between two people about {t}.", "What do most people get wrong about {t}?",
    "Summarize what you know about {t}.", "Write a diary entry about {t}.", "Make a list of ideas related to {t}.",
    "Tell me a joke about {t}.", "Write a short news report about {t}.", "Why does {t} matter?",
)
OPENERS = (
    "Dear Sam,", "Once upon a time,", "In 1998,", "The problem with", "I remember the first time",
    "According to a recent survey,", "It was late at night when", "Here is what I learned", "My favourite",
    "The best way to", "Last summer we", "Q: What is", "Many people believe that", "When the train stopped,",
    "Chapter 1\n\n", "Ingredients:", "Thank you for your letter.", "She looked at the clock and",
    "The meeting started at", "If you have ever wondered", "Breaking news:", "Step 1:", "He said that",
    "There are three reasons why", "Welcome to", "Everyone knows that", "The little village of", "Note to self:",
    "Today I", "In the beginning of the twentieth century,", "A good friend is", "Yesterday,",
)
CHAT_SHARE = 2 / 3  # the rest continue an opener
TEMPERATURE = 0.8  # below 1: a 135M model at 1 rambles into noise within a sentence or two
TOP_P = 0.95
TOP_K = 100  # a full-vocabulary top-p sort per token costs more than the batched step itself
PROGRESS_EVERY = 0.25  # seconds between redraws of the progress bar (tokens generated, tok/s)


def prompts(n: int, seed: int) -> List[Tuple[str, str]]:
    """The first N prompts for SEED, as (kind, text): kind "chat" (a user message) or
    "text" (a plain-text opener). The chat prompts walk a seeded permutation of every
    form x topic pair before repeating one."""
    rng = random.Random(seed)
    pairs = [f.format(t=t) for f in FORMS for t in TOPICS]
    rng.shuffle(pairs)
    out: List[Tuple[str, str]] = []
    n_chat = 0
    for i in range(n):
        if (i + 1) * CHAT_SHARE >= n_chat + 1:  # CHAT_SHARE of every prefix, spread evenly
            out.append(("chat", pairs[n_chat % len(pairs)]))
            n_chat += 1
        else:
            out.append(("text", OPENERS[rng.randrange(len(OPENERS))]))
    return out


def _settings(model_path: str, n_tokens: int, max_tokens: int, seed: int) -> Dict:
    st = os.stat(model_path)
    return {"model": os.path.abspath(model_path), "model_bytes": st.st_size, "n_tokens": n_tokens,
            "max_tokens": max_tokens, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "seed": seed,
            "prompts": "powerinfer_py.pipeline.sample v2"}


def sample(model_path: str, out: str, n_tokens: int, max_tokens: int = 256, n_parallel: int = 8, seed: int = 0,
           threads: int = 0, skip_existing: bool = False, progress: bool = True) -> Dict:
    if not os.path.isfile(model_path):
        raise PipelineError(f"model {model_path}: no such file")
    if n_tokens < 1 or max_tokens < 1 or not 1 <= n_parallel <= 64:
        raise PipelineError("--n-tokens and --max-tokens must be >= 1, --parallel in [1, 64]")
    settings = _settings(model_path, n_tokens, max_tokens, seed)
    if skip_existing and os.path.isfile(out):
        try:
            head, recs = read_samples(out)
        except PipelineError:
            head, recs = None, []
        if head == settings:
            print(f"sample: {out} already holds these samples ({len(recs)}); kept", file=sys.stderr)
            return {"out": out, "samples": len(recs), "n_tokens": sum(r["n_tokens"] for r in recs), "reused": True}
    from ..llama import Llama
    from ..parallel import ParallelLlama

    t0 = time.time()
    kw = {"n_threads": threads} if threads > 0 else {}
    llm = Llama(model_path=model_path, n_ctx=max_tokens + 128, repack=False, pack_dense=True, verbose=False, **kw)
    # Enough prompts for the shortest plausible samples; more are made if they run out.
    todo = prompts(max(64, 4 * n_tokens // 16), seed)
    done: Dict[int, Dict] = {}  # written by this thread only, from the finished futures
    bar = Progress("sample", n_tokens, progress, fmt=lambda n: f"{n} tokens", rate="tok")

    def one(i: int, pool: ParallelLlama) -> Dict:
        kind, prompt = todo[i]
        with pool.slot() as slot:
            if kind == "chat":
                r = slot.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                                temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, min_p=0.0, seed=seed + i)
                text = r["choices"][0]["message"]["content"] or ""
            else:
                r = slot.create_completion(prompt, max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P,
                                           top_k=TOP_K, min_p=0.0, seed=seed + i)
                text = prompt + r["choices"][0]["text"]
        return {"i": i, "kind": kind, "prompt": prompt, "text": text.strip(),
                "n_tokens": int(r["usage"]["completion_tokens"])}

    def prefix_tokens() -> Tuple[int, int]:  # (samples in the done prefix, their tokens) up to n_tokens
        total, k = 0, 0
        while k in done and total < n_tokens:
            total += done[k]["n_tokens"]
            k += 1
        return k, total

    with ParallelLlama(llm, n_parallel) as pool, ThreadPoolExecutor(n_parallel) as ex:
        running, nxt = set(), 0
        while True:
            k, total = prefix_tokens()
            # the tokens generated so far, finished samples or not: the first n_parallel
            # samples can hold the whole budget, and the kept prefix grows only as they end
            generated = max(total, pool.stats["tokens_generated"])
            bar.update(min(generated, n_tokens) if total < n_tokens else n_tokens, f"{k} samples done")
            if total >= n_tokens:
                break
            # Keep n_parallel in flight; index order, so the kept prefix never has a hole.
            while len(running) < n_parallel:
                if nxt == len(todo):
                    todo.extend(prompts(2 * len(todo), seed)[len(todo):])
                running.add(ex.submit(one, nxt, pool))
                nxt += 1
            finished, running = wait(running, timeout=PROGRESS_EVERY, return_when=FIRST_COMPLETED)
            for f in finished:
                rec = f.result()
                done[rec["i"]] = rec
        for f in running:
            f.cancel()
        wait(running)
        st = dict(pool.stats)
    bar.close()
    llm.close()
    k, total = prefix_tokens()
    recs = [done[i] for i in range(k)]
    Path(os.path.dirname(os.path.abspath(out))).mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp, open(tmp, "w") as f:
        f.write(json.dumps({"powerinfer_samples": settings}) + "\n")
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    dt = time.time() - t0
    print(f"sample: {len(recs)} samples, {total} tokens in {dt:.0f} s ({total / max(dt, 1e-9):.0f} tok/s; engine busy "
          f"{st['busy_seconds']:.0f} s, {st['tokens_generated'] / max(st['steps'], 1):.1f} tokens a step) -> {out}",
          file=sys.stderr)
    return {"out": out, "samples": len(recs), "n_tokens": total, "seconds": dt, "reused": False}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer sample", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF model to sample from (the original, for distillation)")
    p.add_argument("--out", required=True, help="output .jsonl")
    p.add_argument("--n-tokens", type=int, required=True, help="completion tokens to sample in all")
    p.add_argument("--max-tokens", type=int, default=256, help="at most this many tokens per sample")
    p.add_argument("--parallel", type=int, default=8, help="samples generated at once (one batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="engine threads (default: the engine's choice)")
    p.add_argument("--skip-existing", action="store_true", help="keep an output made with the same settings")

    def run(a):
        sample(a.model, a.out, a.n_tokens, a.max_tokens, a.parallel, a.seed, a.threads, a.skip_existing)

    return run_cli(run, argv, p, lambda a: ([("--out", a.out, files(a.out))], [("the model", a.model, files(a.model))]))


if __name__ == "__main__":
    sys.exit(main())
