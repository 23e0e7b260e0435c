"""Stream a chat answer token by token (the GGUF's chat template formats the messages).

    python examples/streaming_chat.py [MODEL.gguf] [QUESTION]

MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct.
"""

import os
import sys

from powerinfer_py import Llama
from powerinfer_py.assets.models import model_path

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POWERINFER_MODEL") or model_path()
question = sys.argv[2] if len(sys.argv) > 2 else "Give me one tip for writing clear code."

with Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False) as llm:
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer in one or two sentences."},
        {"role": "user", "content": question},
    ]
    for chunk in llm.create_chat_completion(messages, max_tokens=48, temperature=0, stream=True):
        delta = chunk["choices"][0]["delta"]
        print(delta.get("content", ""), end="", flush=True)
    print()
