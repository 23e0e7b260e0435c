"""`Llama`'s method families, each a module of functions taking the Llama they serve:

- `loading`: constructor checks, model parameters, activation counts, the banner;
- `tokenizer`: the LlamaTokenizer adapter, pieces, detokenization, special tokens;
- `generation`: decode, logits views, the sampler set-up, the generate() loop;
- `completion`, `chat`, `embedding`, `state`: create_completion, chat handlers and
  create_chat_completion, embed/create_embedding, save_state/load_state;
- `fallback`: llama-cpp-python's engine behind the same methods;
- `upstream`: the real llama_cpp modules (reused pieces, the fallback engine);
- `aliases`: the `llama_cpp` alias modules of install_as_llama_cpp();
- `constants`: llama.cpp's enum values and our engine/mode names.

They import powerinfer_py._core, powerinfer_py.formats and each other, never
powerinfer_py.llama (import-linter contracts in pyproject.toml).
"""
