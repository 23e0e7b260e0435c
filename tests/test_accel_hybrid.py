"""llama.cpp's tensor placement on our Llama and server: override_tensor (-ot), cpu_moe and
n_cpu_moe, with llama.cpp's meanings, and the module (docs/accel.md) running the sparse
weights that stay on the CPU while the rest runs on a device.

The device tests need a GPU in ggml's registry: CI runs this file in a child pytest with
ggml's Vulkan module on Mesa's lavapipe (tests/test_vulkan_backend.py::
test_the_device_tests_pass_on_vulkan); in an ordinary CPU test run they are skipped and the
CPU-only ones run. The model is the tiny qwen3moe of tests/test_accel_moe.py (2 layers, 8
experts, 2 used), whose expert stacks and attention queries carry thresholds.

The reference of a hybrid run is the same file all on the CPU (n_gpu_layers=0) in the same
process: the module computes the same kept columns in both, and the device's matmuls keep
activations in f32 where the CPU quantizes them to 8 bits; test_device.py bounds that by 5%
of the logits' scale (measured 2.2% on SmolLM2 on lavapipe), and so does this file.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import pytest

from powerinfer_py import Llama
from powerinfer_py._core import accel
from powerinfer_py._core.devices import gpu_count

llama_cpp = pytest.importorskip("llama_cpp")

needs_device = pytest.mark.skipif(gpu_count() == 0, reason="ggml lists no GPU (load a backend: docs/hybrid.md#vulkan)")

PROMPT = [1, 128, 139, 203, 255, 12, 41, 221]
N_GEN = 8
SCALE_TOL = 5e-2


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Dict[str, Any]:
    """The tiny MoE model, a copy with threshold 0 for its expert stacks and attn_q, and
    their 40% thresholds (each weight's |x| quantile measured on the dense run)."""
    import ggml_capture
    from powerinfer_py.assets.synthetic import generate_qwen3moe
    from powerinfer_py.formats.gguf_io import open_gguf

    out = tmp_path_factory.mktemp("hybrid")
    src = generate_qwen3moe(out)
    names = [t.name for t in open_gguf(src).tensors if "_exps." in t.name or ".attn_q.weight" in t.name]
    xs: Dict[str, List[np.ndarray]] = {}
    for node in ggml_capture.capture(src, [PROMPT], set(names).__contains__, n_threads=2):
        xs.setdefault(node.weight, []).append(np.abs(node.x).ravel())
    assert set(xs) == set(names)
    return {"dense": src, "dir": out, "t0": _with_thresholds(src, str(out / "t0.gguf"), {n: 0.0 for n in names}),
            "t40": {n: float(np.quantile(np.concatenate(xs[n]), 0.4)) for n in names}}


def _with_thresholds(src: str, dst: str, thresholds: Dict[str, float]) -> str:
    from powerinfer_py.pipeline.libllama import write_tensor_thresholds

    write_tensor_thresholds(src, dst, list(thresholds), list(thresholds.values()), {}, {}, progress=False)
    return dst


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """The median over steps of |a - b| / |b| (a median: a router near a tie may send one
    step's token to another expert on either side)."""
    return float(np.median(np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)))


def _greedy(path: str, along: Optional[List[int]] = None, **kw):
    """Greedy token ids (from the logits; `along`: those tokens instead), the logits of each
    step, and the module's sparse weights (name -> kept share) after the run."""
    llm = Llama(path, n_ctx=128, n_threads=2, verbose=False, logits_all=True, **kw)
    try:
        llm.eval(PROMPT)
        tokens, rows = [], []
        for step in range(N_GEN):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            rows.append(row)
            tokens.append(int(row.argmax()) if along is None else along[step])
            llm.eval([tokens[-1]])
        tag = llm._accel_tag
        kept = {}
        if tag is not None:
            shares = accel.sparse_stats(tag)["weights"]
            kept = {w["name"]: shares.get(w["name"]) for w in accel.weights(tag) if w["sparse"]}
        return tokens, np.array(rows), kept, llm.engine
    finally:
        llm.close()


# ------------------------------------------------------------------------ without a device


def test_bad_overrides_are_refused_with_what_is_wrong(smollm2_path):
    cases = [
        (dict(override_tensor="ffn_up"), "is not PATTERN=BUFFER_TYPE"),
        (dict(override_tensor="ffn_up=NoSuchGPU0"), "unknown buffer type 'NoSuchGPU0'; available: CPU"),
        (dict(override_tensor="(ffn=CPU"), "is not a regular expression"),
        (dict(override_tensor="=CPU"), "an empty pattern"),
        (dict(override_tensor=[("ffn",)]), "is not a (pattern, buffer type) pair"),
        (dict(n_cpu_moe=-1), "n_cpu_moe must be an integer >= 0"),
        (dict(n_cpu_moe=1.5), "n_cpu_moe must be an integer >= 0"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError) as e:
            Llama(smollm2_path, verbose=False, **kw)
        assert message in str(e.value), (kw, str(e.value))


def test_an_override_runs_the_model_on_libllama_with_llama_cpps_tokens(smollm2_path):
    """An override is libllama's to apply: the model runs on llama-cpp-python's engine, and
    an override to the CPU changes none of its tokens (the CPU's extra buffer types, ggml's
    repacked weights, still apply, as in llama.cpp). cpu_moe / n_cpu_moe on a model without
    experts match nothing: the core keeps it."""
    prompt = "The capital of France is"
    ref = llama_cpp.Llama(model_path=smollm2_path, n_ctx=128, n_threads=2, verbose=False)
    want = ref.create_completion(prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    ref.close()
    for spec in (r"blk\.\d+\.ffn_.*=CPU", {r"attn_.*": "CPU"}, [(r"token_embd", "CPU"), (r"output", "CPU")]):
        with Llama(smollm2_path, n_ctx=128, n_threads=2, verbose=False, override_tensor=spec) as llm:
            assert llm.engine == "llama-cpp-python"
            assert llm.create_completion(prompt, max_tokens=12, temperature=0)["choices"][0]["text"] == want
    with Llama(smollm2_path, n_ctx=128, n_threads=2, verbose=False, cpu_moe=True, n_cpu_moe=4) as llm:
        assert llm.engine == "powerinfer"


def test_n_cpu_moe_spells_llama_cpps_patterns():
    from powerinfer_py._llama import overrides

    pairs = overrides.parse(r"blk\.3\.attn_q=CPU", cpu_moe=True, n_cpu_moe=2)
    assert overrides.to_llama_cpp(pairs) == [
        r"blk\.3\.attn_q=CPU",
        r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
        r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
        r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
    ]


def test_server_flags_reach_llama(smollm2_path):
    """The server takes llama.cpp's spellings (-ot, --cpu-moe without a value, -ncmoe N)."""
    import argparse

    from powerinfer_py.server.__main__ import _from_args, add_args_from_model
    from powerinfer_py.server.settings import ModelSettings

    parser = argparse.ArgumentParser()
    add_args_from_model(parser, ModelSettings)
    args = parser.parse_args(["--model", smollm2_path, "-ot", r"ffn_.*=CPU", "--cpu-moe", "-ncmoe", "3"])
    settings = _from_args(ModelSettings, args)
    assert (settings.override_tensor, settings.cpu_moe, settings.n_cpu_moe) == (r"ffn_.*=CPU", True, 3)
    args = parser.parse_args(["--model", smollm2_path, "--cpu-moe", "false"])
    assert _from_args(ModelSettings, args).cpu_moe is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", smollm2_path, "--n-cpu-moe", "x"])
    with pytest.raises(ValueError):
        ModelSettings(model=smollm2_path, n_cpu_moe=-1)

    from powerinfer_py.server.model import load_llama_from_model_settings

    llm = load_llama_from_model_settings(ModelSettings(model=smollm2_path, n_ctx=128, verbose=False,
                                                       override_tensor=r"ffn_.*=CPU"))
    try:
        assert llm.engine == "llama-cpp-python"
    finally:
        llm.close()
    with pytest.raises(ValueError, match="unknown buffer type"):
        load_llama_from_model_settings(ModelSettings(model=smollm2_path, verbose=False, override_tensor="ffn=GPU7"))


def test_main_takes_llama_cpps_spellings(smollm2_path, cli_path):
    """main's -ot runs the model on libllama with llama.cpp's greedy text; bad values exit
    non-zero with a message."""
    import subprocess

    prompt = "The capital of France is"
    ref = llama_cpp.Llama(model_path=smollm2_path, n_ctx=128, n_threads=2, verbose=False)
    want = ref.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    ref.close()

    def main(*args):
        return subprocess.run([str(cli_path), "-m", smollm2_path, "-p", prompt, "-n", "8", "--temp", "0", "-t", "2",
                               *args], capture_output=True, text=True, errors="replace", timeout=120)

    out = main("-ot", r"blk\.[0-9]+\.ffn_.*=CPU,attn_q=CPU", "--cpu-moe", "-ncmoe", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.endswith(want) or want in out.stdout, (out.stdout, want)
    assert "engine      = libllama (-ot" in out.stderr
    for args, message in ((["-ot", "ffn=NoSuchGPU0"], "unknown buffer type 'NoSuchGPU0'; available: CPU"),
                          (["-ot", "ffn"], "'ffn' is not PATTERN=BUFFER_TYPE"),
                          (["-ot", "=CPU"], "an empty pattern"),
                          (["--n-cpu-moe", "-1"], "invalid value '-1' for --n-cpu-moe")):
        out = main(*args)
        assert out.returncode != 0 and message in out.stderr, (args, out.stderr[-1000:])


# ------------------------------------------------------------------------ with a device

CASES = {
    # name: (Llama kwargs, the sparse weights the module must hold)
    "all on the device": (dict(n_gpu_layers=-1), lambda n: False),
    "cpu_moe": (dict(n_gpu_layers=-1, cpu_moe=True), lambda n: "_exps." in n),
    "n_cpu_moe=1": (dict(n_gpu_layers=-1, n_cpu_moe=1), lambda n: n.startswith("blk.0.") and "_exps." in n),
    "layer 0 to the CPU": (dict(n_gpu_layers=-1, override_tensor=r"blk\.0\.=CPU"), lambda n: n.startswith("blk.0.")),
    "attn_q to the CPU": (dict(n_gpu_layers=-1, override_tensor={r"attn_q\.weight": "CPU"}), lambda n: ".attn_q." in n),
}


@needs_device
@pytest.mark.parametrize("case", list(CASES))
def test_the_cpu_resident_weights_run_sparse_beside_the_device(moe, case):
    """The module holds exactly the sparse weights the overrides keep on the CPU (the rest is
    on the device) and computes them:

    - threshold 0: every input kept, and the logits those of llama.cpp's own placement of the
      dense file (the module's 8-bit inputs against ggml's: measured <= 0.0044 of a step's
      logits' norm, median; 0.02 allowed, as test_accel_moe bounds the CPU's);
    - the 40% thresholds on exactly those weights: 45-75% of their inputs kept, and the logits
      those of the same file all on the CPU up to the device's own rounding. That rounding
      (the dense file's device-vs-CPU distance, measured 0.7-1.0% median) moves some inputs
      across their thresholds, so the sparse runs differ by more: measured 0.8-2.5%, up to
      2.6x the dense distance; 4x allowed, and at most half of what the thresholds do to the
      logits on the CPU (measured 7-14%): a device run that computed those weights dense
      would sit that far away."""
    kw, on_cpu = CASES[case]
    names = sorted(n for n in moe["t40"] if on_cpu(n))
    tokens, dense_cpu, _, _ = _greedy(moe["dense"])
    _, dense_dev, kept, engine = _greedy(moe["dense"], along=tokens, **kw)
    assert engine == "llama-cpp-python" and kept == {}
    noise = _rel(dense_dev, dense_cpu)
    assert noise < 0.05, noise  # the device computes the model

    _, t0_dev, kept, _ = _greedy(moe["t0"], along=tokens, **kw)
    assert sorted(kept) == names, (case, sorted(kept))
    assert all(share >= 0.99 for share in kept.values()), kept
    assert _rel(t0_dev, dense_dev) <= 0.02, (case, _rel(t0_dev, dense_dev))

    if not names:
        return
    path = _with_thresholds(moe["dense"], str(moe["dir"] / f"t40-{len(names)}-{abs(hash(case))}.gguf"),
                            {n: moe["t40"][n] for n in names})
    cpu_tokens, sparse_cpu, kept_cpu, _ = _greedy(path)
    _, sparse_dev, kept, _ = _greedy(path, along=cpu_tokens, **kw)
    assert sorted(kept) == sorted(kept_cpu) == names
    assert all(0.45 <= share <= 0.75 for share in kept.values()), kept
    _, dense_along, _, _ = _greedy(moe["dense"], along=cpu_tokens)
    effect = _rel(sparse_cpu, dense_along)  # what the thresholds do: measured 7-14%
    assert _rel(sparse_dev, sparse_cpu) <= min(4 * noise, 0.5 * effect), (case, _rel(sparse_dev, sparse_cpu), noise, effect)


@needs_device
def test_main_keeps_the_experts_on_the_cpu_sparse(moe, cli_path):
    """main -ngl 99 --cpu-moe on a sparsified MoE file: the module runs the 6 expert stacks,
    the rest is on the device."""
    import subprocess

    out = subprocess.run([str(cli_path), "-m", moe["t0"], "-p", "hello", "-n", "4", "--temp", "0", "-t", "2",
                          "-ngl", "99", "--cpu-moe", "-v"], capture_output=True, text=True, errors="replace", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sparse mode = input (the module: 6 weights" in out.stderr, out.stderr[-2000:]
