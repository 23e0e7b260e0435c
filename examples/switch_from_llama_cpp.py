"""A llama-cpp-python script, switched to PowerInfer-Py by its first line.

    python examples/switch_from_llama_cpp.py [MODEL.gguf]

Everything below the first line is plain llama-cpp-python code: `llama_cpp.Llama` is
now powerinfer_py.Llama, and llama_cpp's grammar, chat formats and caches work with it.
MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct.
"""

import powerinfer_py.compat  # noqa: F401  (the one line: `import llama_cpp` is PowerInfer-Py from here on)

import os
import sys

import llama_cpp
from llama_cpp.llama_grammar import LlamaGrammar

from powerinfer_py.assets.models import model_path

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POWERINFER_MODEL") or model_path()

llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False)
print(f"llama_cpp.Llama is {llama_cpp.Llama.__module__}.{llama_cpp.Llama.__qualname__}")

out = llm("Q: Name the planet closest to the Sun. A:", max_tokens=16, stop=["\n", "Q:"], temperature=0)
print("completion:", out["choices"][0]["text"].strip())

yes_no = LlamaGrammar.from_string('root ::= "yes" | "no"', verbose=False)
out = llm("Q: Is water wet? Answer yes or no. A: ", max_tokens=4, grammar=yes_no, temperature=0)
print("grammar-constrained:", out["choices"][0]["text"])
llm.close()
