"""The offline pipeline: one module per `powerinfer` subcommand (`cli.py` is the command).

- `profile`: run the engine over a corpus, count activations, sample predictor data;
- `train_predictor`: per-layer low-rank activation predictors (numpy);
- `convert`: Hugging Face llama dir or GGUF -> PowerInfer GGUF (PWRI);
- `relufy`: SiLU -> sparse ReLU by fine-tuning (torch);
- `calibrate`: training-free gate thresholds for SiLU models;
- `place`: hybrid GPU/CPU placement for a budget -> <model>.generated.gpuidx;
- `common`: errors and exit status, corpus, tokenization, the progress bar.

File formats (GGUF helpers, .pt files) are in powerinfer_py.formats.
"""
