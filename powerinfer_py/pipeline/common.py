"""What the `powerinfer` subcommands share: their error type and exit convention, the
refusal of an output that is one of their inputs, outputs written whole or not at all,
the corpus, its tokenization with the model's own tokenizer (through the core), and the
progress bar."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import Model
from .._files import check_folder, check_space, replacing, terminate_as_interrupt
from .._progress import Progress

# Input mode's quality probes and trust cards need the sparse arithmetic itself: where the
# kernels have no SIMD column product (kernel level "scalar"), the engine would otherwise run
# those matrices dense (never slower than dense) and the probes would measure nothing.
os.environ.setdefault("POWERINFER_INPUT_SCALAR", "1")

__all__ = ["PipelineError", "Progress", "check_output", "check_paths", "files", "read_corpus", "read_samples", "replacing",
           "run_cli",
           "same_file", "tokenize_texts", "write_text"]


class PipelineError(ValueError):
    """Bad input to a pipeline command: reported as `error: ...` with exit status 1."""


# What a command reads or writes, for check_paths: (label, the argument as given or None when
# it was not, the glob patterns of the files it stands for; files() makes them).
Paths = Sequence[Tuple[str, Optional[str], Sequence[str]]]


def run_cli(fn, argv, parser=None, paths: Optional[Callable[..., Tuple[Paths, Paths]]] = None) -> int:
    """Runs fn(argv) turning expected failures into a message and exit status 1. With a
    parser, fn gets the parsed arguments, once check_paths(*paths(args)) has refused an
    output that would overwrite an input or that cannot be written: every command declares
    both, so that the one check runs before the command does anything (`sample MODEL --out
    MODEL` replaced a 98 MB model by 473 bytes of JSON lines; an output in a read-only
    folder failed after the whole computation). SIGTERM ends the command as SIGINT does,
    its temporary files removed (_files.terminate_as_interrupt)."""
    with terminate_as_interrupt():
        try:
            if parser is not None:
                argv = parser.parse_args(argv)
                if paths is not None:
                    check_paths(*paths(argv))
            return fn(argv) or 0
        except (OSError, ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1


def check_output(path, label: str = "--out", nbytes: int = 0) -> None:
    """PipelineError unless a file can be written at path (its folder exists and takes a new
    file) with room for about nbytes: checked first by the commands that write a model,
    which do not make missing folders, so that a slip ends before minutes of work."""
    why = check_folder(path, label) or (check_space(path, nbytes, label) if nbytes > 0 else None)
    if why:
        raise PipelineError(why)


def files(path: Optional[str], *inside: str) -> List[str]:
    """Glob patterns of path itself and of the files `inside` it (patterns relative to it)."""
    if path is None:
        return []
    root = glob.escape(os.fspath(path))
    return [root] + [os.path.join(root, pattern) for pattern in inside]


def check_paths(outputs: Paths, inputs: Paths) -> None:
    """PipelineError when a file or directory an output stands for is one an input stands
    for (links and other spellings of a path included). Only what exists can be
    overwritten, so the patterns stand for the paths that match them now."""
    def found(entries: Paths):
        for label, given, patterns in entries:
            if given is not None:
                for pattern in patterns:
                    for path in glob.glob(pattern):
                        if os.path.exists(path):  # not a dangling link
                            yield label, given, path

    ins = list(found(inputs))
    for o_label, o_given, o_path in found(outputs):
        for i_label, _, i_path in ins:
            if os.path.samefile(o_path, i_path):
                raise PipelineError(f"{o_label} {o_given} would overwrite {i_label} {i_path}; write the output "
                                    "elsewhere")
    for label, given, _ in outputs:
        why = check_folder(given, label, create=True) if given is not None else None
        if why:
            raise PipelineError(why)


def write_text(path, text: str) -> None:
    """Path(path).write_text(text), whole or not at all (replacing())."""
    with replacing(path) as tmp:
        Path(tmp).write_text(text)


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


def spread_pieces(texts: Sequence[str], n: int, chars: int) -> Optional[List[str]]:
    """n pieces of `chars` characters from evenly spaced places of the texts taken as one
    (the middles of n equal parts), each from a line's start, so that a sample of the
    corpus is the corpus as a whole and not its first document; None when the texts hold
    fewer than 2 * n * chars characters (a small corpus is best taken whole)."""
    total = sum(len(t) for t in texts)
    if n < 1 or chars < 1 or total < 2 * n * chars:
        return None
    starts = np.cumsum([0] + [len(t) for t in texts])
    pieces = []
    for k in range(n):
        at = (2 * k + 1) * total // (2 * n)
        i = int(np.searchsorted(starts, at, side="right")) - 1
        text, off = texts[i], at - int(starts[i])
        line = text.rfind("\n", max(0, off - chars // 2), off)  # back to a line's start, if one is near
        off = line + 1 if line >= 0 else off
        pieces.append(text[off : off + chars])
    return pieces


# Characters of text taken per token wanted when sampling pieces of a corpus: enough for
# prose (about 4 per token) and for text with runs of spaces (rendered manual pages).
CHARS_PER_TOKEN = 12


def token_chunks(tokenize: Callable[[str], List[int]], texts: Sequence[str], n: int, length: int,
                 spread: bool = True) -> List[List[int]]:
    """Up to n chunks of up to `length` tokens (tokenize: text -> ids, with the model's BOS):
    with spread, one from each of n evenly spaced places of the texts (spread_pieces; a piece
    shorter than half a chunk is left out); else, or when the texts are too short to spread,
    the consecutive whole chunks of their first tokens."""
    pieces = spread_pieces(texts, n, length * CHARS_PER_TOKEN) if spread else None
    if pieces is not None:
        chunks = [tokenize(p)[:length] for p in pieces]
        return [c for c in chunks if len(c) >= length // 2]
    tokens: List[int] = []
    for text in texts:
        tokens.extend(tokenize(text))
        if len(tokens) >= n * length:
            break
    end = min(len(tokens), n * length)
    return [tokens[k : k + length] for k in range(0, end - length + 1, length)]


def run_chunks(tokenize: Callable[[str], List[int]], run: Callable[[List[int]], None], texts: Sequence[str], n_tokens: int,
               chunk: int, spread: bool, progress: bool) -> int:
    """Calibration's loop: up to n_tokens of the texts in chunks of `chunk` tokens
    (token_chunks), each given to run() with a progress bar; returns the tokens used."""
    chunks = token_chunks(tokenize, texts, n_tokens // chunk, chunk, spread)
    if not chunks:
        raise PipelineError(f"the calibration text has fewer than {chunk} tokens (one chunk)")
    used = sum(len(c) for c in chunks)
    bar = Progress("calibrating", used, progress)
    done = 0
    for c in chunks:
        run(c)
        done += len(c)
        bar.update(done)
    bar.close()
    return used


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
