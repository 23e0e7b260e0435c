"""Tokenizer parity: llama.cpp's own fixtures (ggml-vocab-*.gguf with .inp/.out, as
run by its tests/test-tokenizer-0.cpp) through our core and through llama-cpp-python,
plus a detokenize round trip on SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import pytest

from powerinfer_py.assets.models import llama_cpp_sdist_dir

SEPARATOR = "\n__ggml_vocab_test__\n"


def _vocab_files() -> List[Path]:
    folder = Path(llama_cpp_sdist_dir())
    return sorted(
        p
        for p in folder.glob("ggml-vocab-*.gguf")
        if p.with_name(p.name + ".inp").is_file() and p.with_name(p.name + ".out").is_file()
    )


def _read_cases(vocab: Path) -> List[Tuple[str, List[int]]]:
    """The (text, expected ids) pairs, split exactly as test-tokenizer-0.cpp does."""
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    # test-tokenizer-0 stops at the end of the file; a trailing separator adds no case.
    if texts and texts[-1] == "" and raw.endswith(SEPARATOR):
        texts.pop()
    lines = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines), f"{vocab.name}: {len(texts)} inputs but {len(lines)} outputs"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


VOCABS = _vocab_files()


def test_fixtures_present():
    assert len(VOCABS) >= 10, f"expected llama.cpp's vocab fixtures, found {VOCABS}"


@pytest.mark.parametrize("vocab", VOCABS, ids=lambda p: p.name[len("ggml-vocab-") : -len(".gguf")])
def test_tokenize_matches_llama_cpp_fixtures(vocab: Path):
    import llama_cpp

    from powerinfer_py import Llama

    try:
        ref = llama_cpp.Llama(model_path=str(vocab), vocab_only=True, verbose=False)
    except Exception as e:  # only llama-cpp-python's own failure is a reason to skip
        pytest.skip(f"llama-cpp-python cannot load {vocab.name}: {e}")
    ours = Llama(str(vocab), vocab_only=True, fallback=False, verbose=False)
    try:
        assert ours.engine == "powerinfer"
        cases = _read_cases(vocab)
        assert cases
        failures = []
        for text, expected in cases:
            data = text.encode("utf-8")
            # test-tokenizer-0.cpp: common_tokenize(ctx, text, add_special=false, parse_special=false)
            got = ours.tokenize(data, add_bos=False, special=False)
            want_lcp = ref.tokenize(data, add_bos=False, special=False)
            if got != expected or want_lcp != expected:
                failures.append(f"{text!r}: ours {got}, llama-cpp-python {want_lcp}, .out {expected}")
        assert not failures, f"{vocab.name}: {len(failures)}/{len(cases)} cases differ:\n" + "\n".join(failures[:10])
    finally:
        ours.close()
        ref.close()


ROUND_TRIP_TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "Line one\nLine two\n\ttabbed",
    "Ünïcödé: 日本語のテキスト, emoji 🦙🚀",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_detokenize_round_trip_smollm2(text, our_llama, ref_llama):
    ours, ref = our_llama("smollm2"), ref_llama("smollm2")
    data = text.encode("utf-8")
    tokens = ours.tokenize(data, add_bos=False, special=False)
    assert tokens == ref.tokenize(data, add_bos=False, special=False)
    assert ours.detokenize(tokens) == data
    assert ours.detokenize(tokens) == ref.detokenize(tokens)

    special = ours.tokenize(data, add_bos=False, special=True)
    assert special == ref.tokenize(data, add_bos=False, special=True)
    assert ours.detokenize(special, special=True) == data
    assert ours.detokenize(special, special=False) == ref.detokenize(special, special=False)


def test_special_tokens_parse_only_when_asked(our_llama):
    ours = our_llama("smollm2")
    text = b"<|im_start|>"
    assert len(ours.tokenize(text, add_bos=False, special=True)) == 1
    assert len(ours.tokenize(text, add_bos=False, special=False)) > 1
