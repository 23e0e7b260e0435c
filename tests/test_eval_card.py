"""`powerinfer eval` (powerinfer_py/pipeline/evaluate.py): the trust card.

Its figures are checked against paths that do not share its code: the same GGUF scored by
llama-cpp-python and by our engine in dense mode must agree bit for bit (the parity the
dense engine promises), so KL is 0 and top-1 agreement 100% exactly; the reference's NLL
must match the NLL recomputed here from llama-cpp-python's logits_all scores; and on a synthetic PowerInfer file with an exact predictor
the engine's own counters of computed neurons must equal what the card's numpy evaluation
of the predictor and the captured activations says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from powerinfer_py.assets.synthetic import PRESETS, generate
from powerinfer_py.pipeline.common import tokenize_texts
from powerinfer_py.pipeline.evaluate import passages

PROSE = ("The harbour was quiet in the early morning, and the fishing boats rocked gently against the pier "
         "while gulls argued over scraps on the wet stones. ") * 6
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n") * 6


def _eval(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "powerinfer_py.pipeline", "eval", *map(str, args)],
                       capture_output=True, text=True, timeout=900)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("card")
    (d / "prose.txt").write_text(PROSE)
    (d / "code.txt").write_text(CODE)
    return d


def test_card_of_a_model_against_itself_is_exact(smollm2_path, texts, tmp_path):
    out = tmp_path / "card"
    r = _eval(smollm2_path, "--text", f"prose={texts / 'prose.txt'}", f"code={texts / 'code.txt'}",
              "--reference", smollm2_path, "--passages", 1, "--n-tokens", 24, "--n-gen", 8, "--n-prompt", 32,
              "--out", out)
    card = json.loads((tmp_path / "card.json").read_text())
    md = (tmp_path / "card.md").read_text()
    assert md in r.stdout and "**prose**" in md and "**code**" in md and "KL from reference" in md
    assert card["modes"] == ["dense"]  # a plain GGUF: dense only
    for dom in ("prose", "code"):
        ref, dense = card["quality"][dom]["reference"], card["quality"][dom]["dense"]
        assert dense["kl"] == 0.0 and dense["top1"] == 1.0 and dense["nll"] == ref["nll"], (dom, ref, dense)
        assert ref["tokens"] == dense["tokens"] == 23
    # The reference's NLL recomputed here from llama-cpp-python's logits_all scores, one token
    # per micro-batch (n_ubatch=1 runs the kernels a decode runs; a larger batch takes other
    # matmul kernels and moved this NLL by 0.009 nats on Q4_1).
    for dom, text in (("prose", PROSE), ("code", CODE)):
        nll = _reference_nll(smollm2_path, text, 24, 1)
        assert abs(nll - card["quality"][dom]["reference"]["nll"]) < 1e-9, (dom, nll)
    layers = card["layers"]["fired"]
    assert len(layers) == 30 and all(0.0 < f < 1.0 for f in layers)
    sp = card["speed"]["modes"]["dense"]
    assert all(sp[k] > 0 for k in ("decode", "decode_ref", "prompt", "prompt_ref"))
    # the CPU it ran on, in the Markdown too: a name and this machine's cores; where the kernel
    # names the CPU (x86 Linux), that name
    cpu, cores = card["speed"]["cpu"], f", {os.cpu_count()} cores"
    assert f"CPU: {cpu}" in md and cpu.endswith(cores) and cpu[: -len(cores)], cpu
    names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    if names:
        assert cpu == names[0] + cores, (cpu, names[0])


def _reference_nll(path, text, n_tokens, ubatch):
    """The mean NLL of the text's first window from llama-cpp-python's logits_all scores: its
    first token alone, then the rest in micro-batches of ubatch."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=n_tokens + 8, n_batch=ubatch, n_ubatch=ubatch, logits_all=True,
                          n_threads=2, verbose=False)
    p = passages(tokenize_texts(path, [text]), 1, n_tokens)[0]
    llm.eval([int(p[0])])
    llm.eval([int(t) for t in p[1:-1]])
    x = np.array(llm.scores[: len(p) - 1], dtype=np.float64)
    llm.close()
    m = x.max(axis=1, keepdims=True)
    lp = x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    return -lp[np.arange(len(p) - 1), p[1:]].mean()


def test_card_in_batches(smollm2_path, texts, tmp_path):
    """--batch 4: both engines score 4 tokens per step after a passage's first. The
    reference's NLL is the one llama-cpp-python's logits_all scores give with micro-batches
    of 4; dense mode against it is close (here the same kernels: KL 0 measured; a file
    whose batch kernels differ between the engines, such as Qwen2.5's Q4_K, stays within
    KL 0.006 per 256 tokens), and the card says how it scored."""
    r = _eval(smollm2_path, "--text", f"prose={texts / 'prose.txt'}", "--reference", smollm2_path,
              "--passages", 1, "--n-tokens", 24, "--batch", 4, "--no-speed", "--out", tmp_path / "card")
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["batch"] == 4 and "4 tokens per step" in r.stdout
    ref, dense = card["quality"]["prose"]["reference"], card["quality"]["prose"]["dense"]
    assert abs(_reference_nll(smollm2_path, PROSE, 24, 4) - ref["nll"]) < 1e-9, ref
    assert ref["tokens"] == dense["tokens"] == 23
    assert dense["kl"] < 0.01 and dense["top1"] >= 0.9, dense


def test_card_counts_what_the_engine_computes(tmp_path):
    """The tiny synthetic PowerInfer file has exact predictors: the predictor chooses exactly
    the neurons that fire, so its recall is 1, the engine's counters of computed neurons
    equal the share that fires at the positions its sparse steps ran (every scored position
    but each passage's first, which runs dense: counted here from the dense FFN's captured
    activations), and predictor mode scores the text exactly as dense mode."""
    from powerinfer_py._core import Context, Model

    paths = generate(PRESETS["tiny"], tmp_path / "m", progress=False)
    text = PROSE[:240]  # 241 tokens with BOS (a byte per token): two windows of 32, far apart
    (tmp_path / "prose.txt").write_text(text)
    r = _eval(paths["powerinfer"], "--text", tmp_path / "prose.txt", "--passages", 2, "--n-tokens", 32,
              "--out", tmp_path / "card.md")
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["modes"] == ["dense", "predictor"] and card["reference"] is None and "speed" not in card
    lay = card["layers"]
    assert lay["predictor_recall"] == [1.0, 1.0]
    np.testing.assert_allclose(lay["predictor_chosen"], lay["fired"], atol=1e-9)
    n_layer, n_ff = PRESETS["tiny"].n_layer, PRESETS["tiny"].n_ff
    fired, n_sparse = np.zeros(n_layer), 0
    with Model(paths["powerinfer"], sparse_mode="dense") as model:
        for p in passages(tokenize_texts(paths["powerinfer"], [text]), 2, 32):
            with Context(model, n_ctx=64, n_batch=64, n_threads=2) as ctx:
                ctx.set_ffn_capture(True)
                ctx.decode([int(t) for t in p[:-1]], 0)
                for il in range(n_layer):
                    fired[il] += (ctx.ffn_capture(il)[1][1:] > 0).sum()
            n_sparse += len(p) - 2
    np.testing.assert_allclose(lay["computed"]["predictor"], fired / (n_sparse * n_ff), atol=1e-9)
    q = card["quality"]["prose"]
    assert abs(q["predictor"]["nll"] - q["dense"]["nll"]) < 1e-4, q
    assert "KL from reference" not in r.stdout and "predictor recall" in r.stdout


def test_card_errors(smollm2_path, texts, tmp_path):
    tiny = generate(PRESETS["tiny"], tmp_path / "m", progress=False)["powerinfer"]
    cases = [
        ((smollm2_path, "--text", tmp_path / "missing.txt"), "no such file"),
        ((smollm2_path, "--text", texts / "prose.txt", "--modes", "fast"), "unknown mode"),
        ((tiny, "--text", texts / "prose.txt", "--reference", smollm2_path), "same vocabulary"),
        ((smollm2_path, "--text", f"a={texts / 'prose.txt'}", f"a={texts / 'code.txt'}"), "two domains named"),
        ((smollm2_path, "--text", texts / "prose.txt", "--n-tokens", 1), "--n-tokens"),
        ((smollm2_path, "--text", texts / "prose.txt", "--batch", 33), "--batch must be between 1 and 32"),
        ((smollm2_path, "--text", texts / "prose.txt", "--batch", 0), "--batch must be between 1 and 32"),
        # predictor mode computes the union of a batch's neurons: a batch would flatter it
        ((tiny, "--text", texts / "prose.txt", "--batch", 4), "score it with --batch 1"),
    ]
    for args, msg in cases:
        r = _eval(*args, "--no-speed", check=False)
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])


def test_convert_ends_with_a_card(smollm2_path, texts, tmp_path):
    """`powerinfer convert --card` writes the output's card beside it; bad card text fails
    before anything is converted."""
    out = tmp_path / "s.powerinfer.gguf"
    base = [sys.executable, "-m", "powerinfer_py.pipeline", "convert", smollm2_path, "--out", str(out), "--outtype", "q8_0"]
    r = subprocess.run(base + ["--card", str(tmp_path / "nope.txt")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "no such file" in r.stderr and not out.exists()
    r = subprocess.run(base + ["--card", f"code={texts / 'code.txt'}", "--card-reference", smollm2_path,
                               "--card-passages", "1", "--card-n-tokens", "16", "--card-n-gen", "4",
                               "--card-n-prompt", "24"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    card = json.loads((tmp_path / "s.powerinfer.card.json").read_text())
    assert card["model"] == str(out) and card["reference"] == smollm2_path and list(card["quality"]) == ["code"]
    # Q8_0 re-quantization of a Q4_1 model: close to the original, not identical
    q = card["quality"]["code"]["dense"]
    assert 0.0 <= q["kl"] < 0.1 and q["top1"] >= 0.8, q
    assert (tmp_path / "s.powerinfer.card.md").read_text().startswith("# Trust card: s.powerinfer.gguf")


def test_passages_cover_the_whole_file(tmp_path, monkeypatch):
    """Issue 28, item 9: the windows are spread over the whole file (they came from its first
    4 * passages * n_tokens + n_tokens tokens only). A file of prose, then code, then a last
    line: the first window is the file's start, one lies in the code and the last ends with
    the file's last bytes; the same for a file above WHOLE_FILE_BYTES, which is read only
    where its windows fall. The windows are the ones the engine scored, read back as text."""
    from powerinfer_py._core import Model
    from powerinfer_py.pipeline import evaluate as ev

    path = generate(PRESETS["tiny"], tmp_path / "m", progress=False)["powerinfer"]
    scored = []
    real = ev.model_logp

    def spy(model, passage, threads, batch=1):
        scored.append(np.array(passage))
        return real(model, passage, threads, batch)

    monkeypatch.setattr(ev, "model_logp", spy)
    tail = b"the end.\n"
    with Model(path, vocab_only=True) as m:
        for n_rep in (1, 6000):  # 1.5 KB; 9 MB
            raw = (PROSE * n_rep + CODE * n_rep).encode() + tail
            f = tmp_path / "mixed.txt"
            f.write_bytes(raw)
            scored.clear()
            card = ev.evaluate(path, [("mixed", str(f))], modes=["dense"], n_passages=4, n_tokens=32,
                               measure_speed=False, progress=False)
            assert card["domains"]["mixed"]["passages"] == 4 and all(len(p) == 32 for p in scored)
            texts = [b"".join(m.token_to_piece(int(t), False) for t in p) for p in scored]
            # (the tokenizer puts a space before the text's first word, as sentencepiece does)
            assert raw.startswith(texts[0].lstrip(b" ")) and int(scored[0][0]) == m.token_bos(), n_rep
            assert texts[1] in PROSE.encode() * 2 and texts[2] in CODE.encode() * 2, (n_rep, texts)
            assert texts[3].endswith(tail) and raw.endswith(texts[3]), (n_rep, texts[3])
