"""Every program in examples/ runs, with short outputs, so that none rots: the Python
examples on SmolLM2 (the `openai` client one against `python -m powerinfer_py.server`),
the ReLU-SmolLM2 pipeline walk in a tiny configuration, and the C example
build/bin/simple (examples/simple.c)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

import pytest

from conftest import REPO_DIR, ServerProcess

EXAMPLES = REPO_DIR / "examples"
SIMPLE = REPO_DIR / "build" / "bin" / "simple"


def _run(args: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 600) -> str:
    r = subprocess.run([str(a) for a in args], cwd=REPO_DIR, env={**os.environ, **(env or {})},
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args}: exit status {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r.stdout


def _example(name: str, *args: str, model: Optional[str] = None) -> str:
    return _run([sys.executable, EXAMPLES / name, *args], {"POWERINFER_MODEL": model} if model else None)


def test_completion(smollm2_path):
    out = _example("completion.py", model=smollm2_path)
    assert out.startswith("The three primary colors are ")
    assert "engine: powerinfer" in out and "finish reason:" in out
    # The model path and the prompt as arguments.
    out = _example("completion.py", smollm2_path, "The capital of France is")
    assert out.startswith("The capital of France is") and "Paris" in out


def test_streaming_chat(smollm2_path):
    out = _example("streaming_chat.py", model=smollm2_path)
    assert out.strip(), out


def test_switch_from_llama_cpp(smollm2_path):
    out = _example("switch_from_llama_cpp.py", model=smollm2_path)
    assert "llama_cpp.Llama is powerinfer_py.llama.Llama" in out
    assert "completion: " in out
    assert ("grammar-constrained: yes" in out) or ("grammar-constrained: no" in out), out


def test_hybrid_placement(smollm2_path):
    out = _example("hybrid_placement.py", smollm2_path, "0.25", model=smollm2_path)
    placement = ast.literal_eval(next(line for line in out.splitlines() if line.startswith("{")))
    assert placement["active"] and 0 < placement["bytes_total"] <= placement["budget"] == int(0.25 * 2**30)
    assert "completion: Paris" in out


def test_langchain_chain(smollm2_path):
    pytest.importorskip("langchain_core", reason="the langchain extra is not installed")
    out = _example("langchain_chain.py", model=smollm2_path)
    assert "Paris" in out, out


def test_openai_client(smollm2_path):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    pytest.importorskip("httpx")
    with ServerProcess(smollm2_path, "--n_ctx", "512") as server:
        out = _example("openai_client.py", f"{server.url}/v1")
    assert "server model: smollm2" in out
    assert "completion: 5" in out, out
    chat = next(line for line in out.splitlines() if line.startswith("chat: "))
    assert chat[len("chat: "):].strip(), out


def test_relu_smollm2_walk(smollm2_path, tmp_path):
    """The whole pipeline walk (relufy -> profile -> train-predictor -> convert -> report)
    in a tiny configuration, on a corpus made of this repository's documentation."""
    pytest.importorskip("torch", reason="relufy needs torch (the pipeline extra)")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(p.read_text() for p in [REPO_DIR / "README.md", *sorted((REPO_DIR / "docs").glob("*.md"))]))
    work = tmp_path / "work"
    knobs = dict(SAMPLE_TOKENS="48", STEPS="2", STEPS2="0", LAYERWISE_STEPS="2", LAYERWISE_SEQS="2", SEQ_LEN="32", BATCH="1", N_PROFILE="256", N_HELDOUT="256", SAMPLES="200",
                 RANK="32", MIN_STEPS="20", OUTTYPE="f16", N_EVAL="16", N_PASSAGES="1", CARD_PASSAGES="1",
                 CARD_TOKENS="16", CARD_GEN="4", CARD_PROMPT="24", CORPUS=str(corpus), WORK=str(work))
    out = _run(["bash", EXAMPLES / "relu_smollm2" / "make_relu_smollm2.sh", smollm2_path], knobs)
    assert "total wall time" in out
    assert (work / "ReLU-SmolLM2-135M.powerinfer.gguf").is_file()
    report = (work / "report.md").read_text()
    assert "ReLU-SmolLM2 predictor" in report and "Predictor recall per layer" in report
    # relufy fitted layer by layer, then distilled from the original (the defaults), steering
    # its L1 coefficient to the target sparsity, and the walk ends with the card
    relufy = json.loads((work / "relufy.json").read_text())
    assert relufy["distill"] == 1.0 and len(relufy["layerwise"]["layers"]) == 30
    assert relufy["layerwise"]["target_sparsity"] == 0.83
    # the original's own samples (data-free distillation) are in the training text
    from powerinfer_py.pipeline.sample import read_samples

    head, recs = read_samples(str(work / "original-samples.jsonl"))
    assert head["n_tokens"] == 48 and sum(r["n_tokens"] for r in recs) >= 48
    assert recs[0]["text"][:200] in (work / "corpus" / "train.txt").read_text()
    card = json.loads((work / "card.json").read_text())
    assert card["modes"] == ["dense", "gate", "predictor"] and list(card["quality"]) == ["heldout"]
    assert set(card["quality"]["heldout"]) == {"reference", "dense", "gate", "predictor"}
    assert "KL from reference" in (work / "card.md").read_text()


def test_simple_c(smollm2_path):
    if not SIMPLE.is_file():
        pytest.skip(f"{SIMPLE.relative_to(REPO_DIR)} is not built (examples/simple.c, a CMake target of the C core)")
    out = _run([SIMPLE, "-m", smollm2_path, "-p", "The capital of France is", "-n", "8"], timeout=300)
    assert out.strip(), "build/bin/simple printed no text"


def test_parallel_requests(smollm2_path):
    out = _example("parallel_requests.py", model=smollm2_path)
    assert out.count("Q: ") == 4 and out.count("A: ") == 4
    assert "blue" in out  # "What colour is the sky?"
    generated, steps = (int(x) for x in re.search(r"(\d+) tokens generated in (\d+) batched steps", out).groups())
    assert steps < generated  # the four answers' steps were batched
