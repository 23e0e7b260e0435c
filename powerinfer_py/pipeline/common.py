"""What the `powerinfer` subcommands share: their error type and exit convention, the
corpus, its tokenization with the model's own tokenizer (through the core), and the
progress bar."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import Model
from .._progress import Progress

__all__ = ["PipelineError", "Progress", "read_corpus", "read_samples", "run_cli", "same_file", "tokenize_texts"]


class PipelineError(ValueError):
    """Bad input to a pipeline command: reported as `error: ...` with exit status 1."""


def run_cli(fn, argv) -> int:
    """Runs fn(argv) turning expected failures into a message and exit status 1."""
    try:
        return fn(argv) or 0
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def same_file(a, b) -> bool:
    return os.path.abspath(a) == os.path.abspath(b) or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def read_samples(path: str) -> Tuple[Dict, List[Dict]]:
    """(settings header, records) of a file written by `powerinfer sample`."""
    try:
        lines = Path(path).read_text().splitlines()
        head = json.loads(lines[0])["powerinfer_samples"] if lines else None
        recs = [json.loads(ln) for ln in lines[1:] if ln.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise PipelineError(f"{path}: not a `powerinfer sample` file ({e})") from None
    if not isinstance(head, dict) or not all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in recs):
        raise PipelineError(f"{path}: not a `powerinfer sample` file")
    return head, recs


def read_corpus(files: Sequence[str]) -> List[str]:
    """The texts of the corpus files: plain text, or the samples of a `powerinfer sample`
    .jsonl file (its texts joined by blank lines)."""
    texts = []
    for f in files:
        if not os.path.isfile(f):
            raise PipelineError(f"corpus file {f}: no such file")
        if f.endswith(".jsonl"):
            texts.append("\n\n".join(r["text"] for r in read_samples(f)[1]))
            continue
        texts.append(Path(f).read_text(errors="replace"))
    if not any(t.strip() for t in texts):
        raise PipelineError("the corpus is empty")
    return texts


def tokenize_texts(model_path: str, texts: Sequence[str], max_tokens: Optional[int] = None,
                   add_bos: bool = True) -> np.ndarray:
    """Token ids of the texts (each with the model's BOS if it uses one), concatenated,
    with the model's own tokenizer (libllama through the core, vocab only)."""
    with Model(model_path, vocab_only=True) as model:
        out: List[int] = []
        piece = 1 << 20  # tokenize in ~1 MiB slices, cut at whitespace so words stay whole
        for text in texts:
            raw = text.encode()
            start = 0
            while start < len(raw):
                end = min(start + piece, len(raw))
                if end < len(raw):
                    cut = raw.rfind(b" ", start, end)
                    end = cut + 1 if cut > start else end
                out.extend(model.tokenize(raw[start:end], add_bos and start == 0, False))
                start = end
                if max_tokens is not None and len(out) >= max_tokens:
                    return np.array(out[:max_tokens], dtype=np.int32)
        return np.array(out, dtype=np.int32)
