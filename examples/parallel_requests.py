"""Answer several questions at once on one model: ParallelLlama's slots decode in one batch.

    python examples/parallel_requests.py [MODEL.gguf]

Each slot is a Llama of its own (same API as llama-cpp-python's), sharing the model; a
thread per question takes a slot, and the pool's engine batches their decode steps.
MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct.
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from powerinfer_py import Llama, ParallelLlama
from powerinfer_py.assets.models import model_path

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POWERINFER_MODEL") or model_path()
questions = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
             "What do bees make?"]

# repack=False: every batch column rounds as it would alone, so each answer is the one a
# lone request gets (docs/parallel.md).
with Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False, repack=False) as llm, \
        ParallelLlama(llm, n_parallel=4) as pool:

    def ask(question: str) -> str:
        with pool.slot() as slot:
            out = slot.create_chat_completion([{"role": "user", "content": question}], max_tokens=32, temperature=0)
            return out["choices"][0]["message"]["content"].strip()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as ex:
        answers = list(ex.map(ask, questions))
    wall = time.perf_counter() - t0
    for q, a in zip(questions, answers):
        print(f"Q: {q}\nA: {a}\n")
    s = pool.stats
    print(f"[{len(questions)} requests in {wall:.2f} s: {s['tokens_generated']} tokens generated in "
          f"{s['steps']} batched steps]")
