"""`powerinfer` command: the offline pipeline's subcommands.

    powerinfer profile MODEL --corpus FILE...          count activations, sample predictor data
    powerinfer train-predictor --samples DIR --out DIR train per-layer predictors
    powerinfer convert INPUT --out OUT.powerinfer.gguf HF dir / GGUF -> PowerInfer GGUF
    powerinfer sample MODEL.gguf --out F.jsonl --n-tokens N   the model's own text (data-free distillation)
    powerinfer relufy MODEL.gguf --corpus FILE... --out OUT.gguf   SiLU -> sparse ReLU (needs torch)
    powerinfer calibrate MODEL.gguf --corpus FILE... --out OUT.gguf  SiLU gate thresholds (training-free)
    powerinfer sparsify MODEL.gguf --sparsity S --out OUT.gguf   input sparsity on every matrix (training-free)
    powerinfer place MODEL --vram-budget GIB           hybrid placement -> MODEL.generated.gpuidx
    powerinfer eval MODEL --text FILE... [--reference ORIGINAL.gguf]   trust card (Markdown + JSON)
    powerinfer rpc-server [--host H] [--port P] [--mem MIB]   an RPC worker (docs/distributed.md)

`powerinfer COMMAND -h` shows each command's options. Each is also runnable as
`python -m powerinfer_py COMMAND ...`, `python -m powerinfer_py.pipeline COMMAND ...` or
`python -m powerinfer_py.pipeline.<module>`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# command -> (module, one-line help). Adding a command is one line here; the module
# needs a main(argv) -> int, which runs through common.run_cli with its parser and the
# paths it reads and writes, so that an output that is one of its inputs is refused
# (tests/test_pipeline.py holds a case for each command that writes files).
# Each module is imported when its command runs, so a command that does not run the
# engine (convert, train-predictor) works without libpowerinfer.
COMMANDS = {
    "profile": ("powerinfer_py.pipeline.profile", "run the engine over a corpus: activation counts, predictor samples"),
    "train-predictor": ("powerinfer_py.pipeline.train_predictor", "train per-layer low-rank activation predictors"),
    "convert": ("powerinfer_py.pipeline.convert", "HF safetensors dir or GGUF -> PowerInfer GGUF (PWRI)"),
    "sample": ("powerinfer_py.pipeline.sample", "text sampled from a model for data-free distillation (prompts: generic topics)"),
    "relufy": ("powerinfer_py.pipeline.relufy", "replace SiLU by ReLU and fine-tune for sparsity (needs torch)"),
    "calibrate": ("powerinfer_py.pipeline.calibrate", "training-free gate thresholds for SiLU models (CATS-style)"),
    "sparsify": ("powerinfer_py.pipeline.sparsify", "training-free input sparsity on every matrix of any GGUF (TEAL-style)"),
    "place": ("powerinfer_py.pipeline.place", "solve the hybrid GPU/CPU neuron placement, write <model>.generated.gpuidx"),
    "eval": ("powerinfer_py.pipeline.evaluate", "trust card: per-domain perplexity, KL and top-1 vs the original, sparsity, speed"),
    "rpc-server": ("powerinfer_py.pipeline.rpc_server", "serve this host's CPU to PowerInfer-Py and llama.cpp clients over ggml-rpc"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<16} {text}")
        return 0 if argv else 2
    cmd = argv[0]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[cmd][0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
