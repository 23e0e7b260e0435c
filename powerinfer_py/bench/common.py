"""What the benchmarks share: the child-process runner (each measured run in a fresh
process, so its peak RSS is its own), the peak-RSS run of one engine and its table, the
table printer (every table says which CPU it ran on; the CPU and bandwidth probes live in
powerinfer_py._machine), and the synthetic model pair's arguments."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._machine import cpu_model
from ..assets.models import cache_dir

RESULT_PREFIX = "BENCH_RESULT "


# ---- child processes ---------------------------------------------------------------------


class ChildError(RuntimeError):
    """A benchmark child that printed no result: `reason` (exit status or signal) and its output."""

    def __init__(self, reason: str, output: str):
        super().__init__(f"{reason}: {output[-800:]}")
        self.reason, self.output = reason, output


def spawn(fn: Callable[..., Dict[str, Any]], _env: Optional[Dict[str, str]] = None, **kwargs: Any) -> Dict[str, Any]:
    """fn(**kwargs) (a module-level function of this package returning a JSON-able dict),
    run in a fresh `python -m powerinfer_py.bench --child` process (`_env` added to its
    environment, e.g. POWERINFER_KERNELS); ChildError if the child prints no result line."""
    module = fn.__module__
    if module == "__main__":  # the parent runs as `python -m powerinfer_py.bench.<name>`
        module = sys.modules["__main__"].__spec__.name
    spec = {"target": f"{module}:{fn.__qualname__}", "kwargs": kwargs}
    cmd = [sys.executable, "-m", "powerinfer_py.bench", "--child", json.dumps(spec)]
    env = dict(os.environ, **_env) if _env else None
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    reason = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
    raise ChildError(reason, (r.stderr or r.stdout).strip())


def peak_rss_mib() -> float:
    """This process's peak resident set in MiB: the kernel's high-water mark of its own
    address space (VmHWM). Not getrusage's ru_maxrss: on Linux that keeps the peak of the
    image before exec, so a child spawned by a parent that had loaded a model reported the
    parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def prompt_tokens(tokenize: Callable[[bytes], List[int]], n: int, text: str) -> List[int]:
    """The first n tokens of `text` repeated as often as it takes."""
    repeated = text
    while True:
        toks = tokenize(repeated.encode())
        if len(toks) >= n:
            return toks[:n]
        repeated += text


def peak_rss(engine: str, path: str, threads: int, n_prompt: int, n_gen: int, prompt_text: str,
             sparse_mode: str = "auto") -> Dict[str, Any]:
    """A child (spawn): one engine alone, llama-cpp-python or ours in `sparse_mode`: load, a
    prompt of n_prompt tokens of prompt_text, n_gen greedy decode steps; the load's seconds
    and the process's peak RSS."""
    import numpy as np

    kw = dict(n_ctx=n_prompt + n_gen + 64, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    t0 = time.perf_counter()
    if engine == "llama-cpp-python":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, **kw)
        last = lambda: upstream_last_logits(llm)  # noqa: E731
    else:
        from ..llama import Llama

        llm = Llama(model_path=path, sparse_mode=sparse_mode, **kw)
        last = llm._last_logits_view
    t_load = time.perf_counter() - t0
    llm.eval(prompt_tokens(llm.tokenize, n_prompt, prompt_text))
    for _ in range(n_gen):
        llm.eval([int(np.argmax(last()))])
    return {"load_s": t_load, "peak_rss_mib": peak_rss_mib()}


def upstream_last_logits(llm: Any):
    """The last decoded token's logits of a llama_cpp.Llama (its `scores` keep them only with
    logits_all=True)."""
    import llama_cpp
    import numpy as np

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def greedy_steps_interleaved(ref: Any, ours: Any, n_gen: int) -> Tuple[float, float]:
    """n_gen greedy decode steps of llama-cpp-python's Llama (ref) and ours, one step of each
    in turn (the machine's bandwidth drifts); the seconds each engine spent."""
    import numpy as np

    t_ref = t_ours = 0.0
    for _ in range(n_gen):
        t = time.perf_counter()
        ref.eval([int(np.argmax(upstream_last_logits(ref)))])
        t_ref += time.perf_counter() - t
        t = time.perf_counter()
        ours.eval([int(np.argmax(ours._last_logits_view()))])
        t_ours += time.perf_counter() - t
    return t_ref, t_ours


def child_main(spec_json: str) -> int:
    """The child side of spawn(): runs the named function and prints its result line."""
    spec = json.loads(spec_json)
    module, name = spec["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    print(RESULT_PREFIX + json.dumps(fn(**spec["kwargs"])), flush=True)
    return 0


# ---- output -----------------------------------------------------------------------------------


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], align: bool = False) -> None:
    """A Markdown table under its title and the CPU it ran on; `align` pads the columns."""
    print(f"{title}\nCPU: {cpu_model()}\n{kernels_line()}\n")
    if align:
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    else:
        widths = [0] * len(header)
    print("| " + " | ".join(c.ljust(w) for c, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) if align else "---" for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def kernels_line() -> str:
    """Our sparse kernels' ISA level here and the features llama-cpp-python's ggml was built
    with (a ratio compares the two)."""
    from .._core.bindings import kernel_level, kernel_levels

    ggml = ""
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        feats = [f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")]
        ggml = ", ".join(f for f in feats if f.startswith(("AVX", "SSE", "F16C", "FMA", "NEON", "ARM", "DOTPROD", "AMX", "BMI")))
    except Exception:  # noqa: BLE001 - informational only
        pass
    return (f"powerinfer kernels: {kernel_level()} (this CPU runs: {', '.join(kernel_levels())}); "
            f"llama-cpp-python's ggml CPU features: {ggml or 'unknown'}")


def print_rss_table(rss: Dict[str, Dict[str, Any]]) -> None:
    """The peak_rss() results by engine label, after a blank line; nothing if there are none."""
    if not rss:
        return
    print()
    print_table("Peak RSS, each engine alone (load, the longest prompt, the decode):", ("engine", "load s", "peak RSS"),
                [[k, f"{r['load_s']:.1f}", f"{r['peak_rss_mib']:.0f} MiB"] for k, r in rss.items()])


# ---- the synthetic pair -------------------------------------------------------------------------


def default_pair() -> Dict[str, str]:
    """The 7B-shaped synthetic pair (python -m powerinfer_py.assets.synthetic --preset 7b)."""
    cache = cache_dir() / "synthetic"
    return {"dense": str(cache / "relu-7b-shaped.gguf"), "powerinfer": str(cache / "relu-7b-shaped.powerinfer.gguf")}


MISSING_PAIR_HINT = ("make it with `python -m powerinfer_py.assets.synthetic --preset 7b "
                     "--out ~/.cache/powerinfer-py/synthetic`")


def add_pair_arguments(p: argparse.ArgumentParser, dense_help: str, powerinfer_help: str) -> None:
    """The model pair, threads, decoded tokens and --json of the sparse and hybrid benchmarks."""
    d = default_pair()
    p.add_argument("--dense", default=d["dense"], help=dense_help)
    p.add_argument("--powerinfer", default=d["powerinfer"], help=powerinfer_help)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--json", help="also write the results here")


def missing_pair(paths: Sequence[str]) -> Optional[str]:
    """An error message if one of the model files is missing."""
    for path in paths:
        if not os.path.exists(path):
            return f"error: {path} not found; {MISSING_PAIR_HINT}"
    return None
