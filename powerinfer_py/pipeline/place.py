"""`powerinfer place`: solve the hybrid GPU/CPU placement for a budget and write the
`<model>.generated.gpuidx` cache, reading PowerInfer's `activation/activation_{i}.pt`
counts if given (the C `main` cannot read pickle-based files; it reuses the cache):

    powerinfer place MODEL.powerinfer.gguf --vram-budget 8 [--activation DIR] [-c 4096 -b 512]

then `main -m MODEL.powerinfer.gguf --vram-budget 8 -c 4096 -b 512 ...` uses it (the cache
is valid for the same budget, context and batch sizes: they set the FFN's share). Prints
what goes on the device and each layer's share of neurons. See docs/hybrid.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..llama import Llama
from .common import PipelineError, files, run_cli


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer place", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--vram-budget", type=float, required=True, help="device memory budget in GiB")
    p.add_argument("--activation", help="PowerInfer activation folder (activation_{i}.pt); "
                                        "default: <model folder>/activation if present, else the model's counts")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size main will use (default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="batch size main will use (default 512)")
    p.add_argument("--sparse-mode", default="auto", choices=("auto", "gate", "predictor"))
    p.add_argument("--emulate-device", action="store_true", help="emulate the device in host memory (no GPU)")
    def run(args):
        if not os.path.isfile(args.model):
            raise PipelineError(f"{args.model}: no such file")
        if not args.vram_budget > 0:
            raise PipelineError("--vram-budget must be > 0 GiB")
        if args.ctx_size < 0 or args.batch_size < 1:
            raise PipelineError("-c must be >= 0 and -b >= 1")
        probe = Llama(model_path=args.model, vocab_only=True, verbose=False)
        arch = probe.metadata.get("general.architecture", "")
        n_ctx_train = int(probe.metadata.get(f"{arch}.context_length", 0))
        n_layer = int(probe.metadata.get(f"{arch}.block_count", 0))
        probe.close()
        n_ctx = args.ctx_size if 0 < args.ctx_size <= n_ctx_train or not n_ctx_train else n_ctx_train  # as main clamps
        llm = Llama(model_path=args.model, n_ctx=n_ctx, n_batch=args.batch_size, vram_budget=args.vram_budget,
                    activation_dir=args.activation, reset_gpu_index=True, emulate_device=args.emulate_device,
                    sparse_mode=args.sparse_mode, verbose=bool(os.environ.get("PI_DEBUG")))
        pl = llm.placement()
        mib = 2**20
        print(f"device: {pl['device']}; budget {pl['budget'] / mib:.1f} MiB, placed {pl['bytes_total'] / mib:.1f} MiB "
              f"(dense {pl['bytes_dense'] / mib:.1f}, KV {pl['bytes_kv'] / mib:.1f}, "
              f"compute {pl['bytes_compute'] / mib:.1f}, FFN rows {pl['bytes_ffn'] / mib:.1f}); "
              f"attention of {pl['n_layers_attn']} layers")
        if not pl["active"]:
            print("nothing placed (see the log with -v, or a larger budget)")
            return 0
        n_ff = pl["n_neurons"] // max(n_layer, 1)
        shares = [len(llm.hot_neurons(il)) / n_ff for il in range(n_layer)]
        print(f"FFN neurons on the device: {100 * pl['n_hot'] / pl['n_neurons']:.1f}% "
              f"(per layer: {' '.join(f'{100 * s:.0f}' for s in shares)} %)")
        cache = args.model + ".generated.gpuidx"
        if pl["n_hot"] and os.path.exists(cache):
            print(f"wrote {cache}")
        llm.close()
        return 0

    def paths(a):
        cache = a.model + ".generated.gpuidx"
        return ([("the placement cache", cache, files(cache))],
                [("the model", a.model, files(a.model)),
                 ("--activation", a.activation, files(a.activation, "activation_*.pt"))])

    return run_cli(run, argv, p, paths)

if __name__ == "__main__":
    sys.exit(main())
