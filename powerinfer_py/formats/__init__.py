"""File formats read and written by both the engine side and the offline pipeline,
with numpy and gguf only (no C core, no torch):

- `pt_io`: PowerInfer's `.pt` files (activation counts, predictors), read without
  running pickle code;
- `gguf_io`: GGUF/PWRI reading and writing helpers, our keys and statistics tensors,
  and the one GGUF finisher (tmp file, PWRI magic, rename).
"""
