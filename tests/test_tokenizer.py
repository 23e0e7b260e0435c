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


# ---------------------------------------------------------------- found by tests/fuzz/py/fuzz_tokenizer.py

def test_out_of_range_ids_raise_the_cores_error(our_llama):
    """An id outside the vocabulary raises RuntimeError with the core's reason. The error
    return (INT32_MIN) used to be taken for a request of a 2^31-byte buffer, which was made
    before an OverflowError ("integer 2147483648 does not fit 'int32_t'") hid the reason."""
    ours = our_llama("smollm2")
    n_vocab = ours.n_vocab()
    for bad in (-1, -(2**31), n_vocab, 65535, 2**31 - 1):
        with pytest.raises(RuntimeError, match=rf"token id {bad} is out of range \[0, {n_vocab}\)"):
            ours.token_to_piece(bad)
        with pytest.raises(RuntimeError, match=rf"token id {bad} is out of range"):
            ours.detokenize([1, bad, 2])
    for huge in (2**31, -(2**31) - 1, 2**64):  # not an int32 at all: cffi's own check
        with pytest.raises(OverflowError):
            ours.token_to_piece(huge)
    assert ours.detokenize([n_vocab - 1]) == ours.token_to_piece(n_vocab - 1)


BEYOND_UNICODE = [b"\xf4\x90\x80\x80", b"a\xf7\xbf\xbf\xbfb", b"x \xf5\x80\x80\x80\xf4\x8f\xbf\xbf<|im_start|>"]

_BEYOND_UNICODE_CHILD = r"""
import json, sys
from powerinfer_py import Llama
texts = [bytes.fromhex(h) for h in json.loads(sys.argv[2])]
llm = Llama(sys.argv[1], vocab_only=True, fallback=False, verbose=False)
print(json.dumps([[llm.tokenize(t, add_bos=False, special=s) for s in (False, True)] for t in texts]))
"""


def _tokenize_in_child(path: str, texts) -> list:
    """Tokenizes in a child process: a regression aborts the child, not the test session."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _BEYOND_UNICODE_CHILD, path, json.dumps([t.hex() for t in texts])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"tokenizing with {Path(path).name} died (exit {r.returncode}):\n{r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _replaced(text: bytes) -> bytes:
    """What a tokenizer that decodes code points gets instead: U+FFFD for each of the 4 bytes."""
    import re

    return re.sub(rb"\xf4[\x90-\xbf][\x80-\xbf]{2}|[\xf5-\xf7][\x80-\xbf]{3}", "\ufffd".encode() * 4, text)


def test_text_beyond_unicode_does_not_abort(smollm2_path):
    """4 bytes (a UTF-8 form of a number past U+10FFFF) made libllama's BPE and WPM
    pre-tokenizers throw a C++ exception through the C API: std::terminate, the process
    gone. They are now read as 4 invalid bytes, U+FFFD each, like any other invalid UTF-8
    these tokenizers meet; SPM and UGM vocabularies, which never decoded them (SPM makes
    byte tokens), get the text unchanged."""
    paths = [smollm2_path] + [str(v) for v in VOCABS if v.name in (
        "ggml-vocab-gpt-2.gguf", "ggml-vocab-bert-bge.gguf", "ggml-vocab-llama-spm.gguf", "ggml-vocab-nomic-bert-moe.gguf")]
    for path in paths:
        raw_vocab = Path(path).name in ("ggml-vocab-llama-spm.gguf", "ggml-vocab-nomic-bert-moe.gguf")
        got = _tokenize_in_child(path, BEYOND_UNICODE + [_replaced(t) for t in BEYOND_UNICODE])
        crafted, replaced = got[:len(BEYOND_UNICODE)], got[len(BEYOND_UNICODE):]
        if raw_vocab:
            assert crafted != replaced, Path(path).name
        else:
            assert crafted == replaced, Path(path).name


def test_text_beyond_unicode_on_the_fallback_engine():
    """llama-cpp-python's engine (the fallback, here forced by a KV override) has the same
    abort; Llama guards its tokenizer with the core's rule."""
    import subprocess
    import sys

    gpt2 = [v for v in VOCABS if v.name == "ggml-vocab-gpt-2.gguf"]
    if not gpt2:
        pytest.skip("llama.cpp's vocabulary fixtures are not fetched")
    child = (
        "import sys\n"
        "from powerinfer_py import Llama\n"
        "llm = Llama(sys.argv[1], vocab_only=True, kv_overrides={'general.name': 'x'}, verbose=False)\n"
        "assert llm.engine == 'llama-cpp-python', llm.engine\n"
        "got = [llm.tokenize(t, add_bos=False) for t in (b'a\\xf7\\xbf\\xbf\\xbfb', 'a\\ufffd\\ufffd\\ufffd\\ufffdb'.encode())]\n"
        "assert got[0] == got[1], got\n"
        "print(got[0])\n"
    )
    r = subprocess.run([sys.executable, "-c", child, str(gpt2[0])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


def test_text_beyond_unicode_in_the_c_programs(smollm2_path, cli_path):
    """The replacement lives in the core's powerinfer_tokenize, so the C programs (the CLI,
    and any C caller of powerinfer.h) are safe too, not only Python."""
    import subprocess

    for prompt in BEYOND_UNICODE:
        r = subprocess.run([str(cli_path), "-m", smollm2_path, "-p", prompt, "-n", "1", "-t", "2"],
                           capture_output=True, timeout=300)
        assert r.returncode == 0, (prompt, r.returncode, r.stderr[-1500:])
