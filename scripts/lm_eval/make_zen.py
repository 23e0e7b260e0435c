"""Writes zen.jsonl, the local task's data: each aphorism of the Zen of Python (CPython's
`this` module, on every machine with Python) cut after its first words, to be completed."""

import codecs
import json
import sys
from pathlib import Path

import this  # noqa: F401  (prints the Zen on import; its text is this.s, rot13)

out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("zen.jsonl"))
lines = [l.strip() for l in codecs.decode(this.s, "rot13").splitlines()[2:] if l.strip()]
with out.open("w") as f:
    for line in lines:
        words = line.split()
        cut = max(2, len(words) // 2)
        f.write(json.dumps({"prefix": " ".join(words[:cut]), "rest": " ".join(words[cut:])}) + "\n")
print(f"{len(lines)} aphorisms -> {out}", file=sys.stderr)
