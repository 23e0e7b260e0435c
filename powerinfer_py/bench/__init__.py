"""Benchmarks against llama-cpp-python, same machine, same run:

    python -m powerinfer_py.bench [dense|sparse|hybrid] [options]     (no word: dense)

- `dense`: speed and memory of Llama vs llama_cpp.Llama on the real models;
- `sparse`: decode speed of the sparse modes on a synthetic sparse pair;
- `hybrid`: decode speed under device-memory budgets vs llama-cpp-python's -ngl;
- `common`: the child-process runner, the table printer, the memory bandwidth.
"""
