"""A LangChain chain on PowerInfer-Py: prompt | ChatPowerInfer | output parser.

    python examples/langchain_chain.py [MODEL.gguf] [COUNTRY]

Needs the langchain extra (pip install 'powerinfer-py[langchain]').
MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct.
"""

import os
import sys

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from powerinfer_py.assets.models import model_path
from powerinfer_py.langchain import ChatPowerInfer

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POWERINFER_MODEL") or model_path()
country = sys.argv[2] if len(sys.argv) > 2 else "France"

chat = ChatPowerInfer(model_path=model, n_ctx=512, n_threads=2, temperature=0, max_tokens=32, verbose=False)
prompt = ChatPromptTemplate.from_messages([
    ("system", "You are a geography teacher. Answer in one short sentence."),
    ("human", "What is the capital of {country}?"),
])
chain = prompt | chat | StrOutputParser()
print(chain.invoke({"country": country}))
