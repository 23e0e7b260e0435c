"""Hybrid GPU/CPU placement under a device-memory budget, and what the engine placed.

    python examples/hybrid_placement.py [MODEL.gguf] [BUDGET_GIB]

Attention, norms, output, the KV cache and the compute buffers go to the device first,
then the hottest FFN neurons of a sparse (PowerInfer) model with what is left; the
budget is never exceeded. Without a GPU backend in the installed ggml the device is
emulated in host memory (emulate_device=True), so the split runs, on the CPU.
MODEL: the argument, else $POWERINFER_MODEL, else SmolLM2-135M-Instruct (a dense model:
only its dense parts are placed). BUDGET_GIB defaults to 0.5.
"""

import os
import sys

from powerinfer_py import Llama, gpu_count
from powerinfer_py.assets.models import model_path

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POWERINFER_MODEL") or model_path()
budget_gib = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
has_gpu = gpu_count() > 0  # a GPU in the installed ggml (CUDA, ROCm, Vulkan, Metal builds)

with Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False,
           vram_budget=budget_gib, emulate_device=not has_gpu) as llm:
    placement = llm.placement()
    mib = 2**20
    print(f"device: {placement['device']} ({'emulated in host memory' if placement['emulated'] else 'GPU'})")
    print(f"budget {placement['budget'] / mib:.1f} MiB, placed {placement['bytes_total'] / mib:.1f} MiB: "
          f"dense {placement['bytes_dense'] / mib:.1f}, KV {placement['bytes_kv'] / mib:.1f}, "
          f"compute {placement['bytes_compute'] / mib:.1f}, FFN rows {placement['bytes_ffn'] / mib:.1f}")
    print(f"attention of {placement['n_layers_attn']} layers and {placement['n_hot']} of "
          f"{placement['n_neurons']} FFN neurons on the device")
    print(placement)
    out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0, stop=["\n"])
    print("completion:", out["choices"][0]["text"].strip())
