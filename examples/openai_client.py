"""The official `openai` client against PowerInfer-Py's OpenAI-compatible server.

    python -m powerinfer_py.server --model MODEL.gguf --port 8000 &
    python examples/openai_client.py [BASE_URL]

BASE_URL: the argument, else $OPENAI_BASE_URL, else http://127.0.0.1:8000/v1. The
server has the model; this script asks it for a completion and a streamed chat answer.
"""

import os
import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))

model = client.models.list().data[0].id
print(f"server model: {model}")

completion = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
print("completion:", completion.choices[0].text.strip())

print("chat: ", end="")
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello in three words."}],
    max_tokens=16,
    temperature=0,
    stream=True,
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
