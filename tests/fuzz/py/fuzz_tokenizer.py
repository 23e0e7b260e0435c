"""atheris target: Llama's tokenizer entry points on untrusted input, over a real vocabulary
(SmolLM2-135M-Instruct, the tests' model; loaded once per process with vocab_only=True).

Promises under test:
- tokenize(bytes, add_bos, special) returns ids inside the vocabulary for any bytes
  (invalid UTF-8 included), and detokenize takes them back;
- detokenize(ids) and token_to_piece(id) return bytes for ids inside the vocabulary; an
  id outside it raises RuntimeError naming the id (OverflowError for an id that is not an
  int32 at all); never a native crash, which would kill the process;
- the model's chat template (Jinja2, llama-cpp-python's formatter, as create_chat_completion
  uses it) formats any conversation of valid strings, or raises the template's own
  TemplateError; its prompt tokenizes with special=True.

Input layout: tests/fuzz/py/common.py. powerinfer_py is instrumented; the core's tokenizer
(libllama, C++) is not, so coverage guides only the Python side and the C++ gets random
mutations of the seeds (tests/fuzz/py/tokenizer.dict holds the special-token texts).

Run through scripts/fuzz_py.sh; by hand:
    .venv/bin/python tests/fuzz/py/fuzz_tokenizer.py -max_total_time=60 build-fuzz/py/corpus/tokenizer
The model comes from POWERINFER_FUZZ_MODEL (a GGUF path) or powerinfer_py.assets.models.
"""

from __future__ import annotations

import os
import sys

import atheris

import common  # noqa: F401  (puts the repository on sys.path)

import jinja2  # noqa: E402

import powerinfer_py.llama  # noqa: E402
from powerinfer_py import Llama  # noqa: E402
from powerinfer_py._core import model as _core_model  # noqa: E402
from powerinfer_py._llama import tokenizer as _tokenizer, upstream  # noqa: E402
from powerinfer_py.assets.models import model_path  # noqa: E402

common.instrument_modules(powerinfer_py.llama, _tokenizer, _core_model)

LLM = Llama(os.environ.get("POWERINFER_FUZZ_MODEL") or model_path("smollm2"), vocab_only=True, verbose=False)
N_VOCAB = LLM.n_vocab()
_TEMPLATE = LLM.metadata.get("tokenizer.chat_template")
FORMATTER = None
if _TEMPLATE:
    FORMATTER = upstream.llama_chat_format().Jinja2ChatFormatter(
        template=_TEMPLATE, eos_token=LLM._token_text(LLM.token_eos()), bos_token=LLM._token_text(LLM.token_bos()),
        stop_token_ids=[LLM.token_eos()])


def _check_ids(ids, what: str) -> None:
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < N_VOCAB for t in ids):
        raise AssertionError(f"{what} gave ids outside [0, {N_VOCAB}): {ids[:20]!r}")


def _tokenize(text: bytes, add_bos: bool, special: bool) -> None:
    ids = LLM.tokenize(text, add_bos=add_bos, special=special)
    _check_ids(ids, "tokenize")
    if len(ids) > 3 * len(text) + 2:  # an invalid byte becomes U+FFFD, at most 3 tokens
        raise AssertionError(f"{len(text)} bytes became {len(ids)} tokens")
    back = LLM.detokenize(ids, special=special)
    if not isinstance(back, bytes):
        raise AssertionError(f"detokenize returned {type(back).__name__}")


def _expect_out_of_range(call, ids) -> None:
    """`call()` on ids of which some are outside the vocabulary: the right Python error."""
    first_bad = next(t for t in ids if not 0 <= t < N_VOCAB)
    try:
        call()
    except RuntimeError as e:
        if not -(2**31) <= first_bad < 2**31:
            raise AssertionError(f"id {first_bad} (not an int32) raised RuntimeError, not OverflowError") from e
        if "out of range" not in str(e):
            raise AssertionError(f"RuntimeError for id {first_bad} does not say why: {e}") from e
    except OverflowError as e:
        if -(2**31) <= first_bad < 2**31:
            raise AssertionError(f"int32 id {first_bad} raised OverflowError ({e}), not the core's RuntimeError") from e
    else:
        raise AssertionError(f"ids {ids[:20]!r} with {first_bad} outside [0, {N_VOCAB}) were accepted")


def _detokenize(ids, special: bool) -> None:
    if all(0 <= t < N_VOCAB for t in ids):
        out = LLM.detokenize(ids, special=special)
        if not isinstance(out, bytes):
            raise AssertionError(f"detokenize returned {type(out).__name__}")
    else:
        _expect_out_of_range(lambda: LLM.detokenize(ids, special=special), ids)


def _token_to_piece(ids, special: bool) -> None:
    for t in ids[:64]:
        if 0 <= t < N_VOCAB:
            piece = LLM.token_to_piece(t, special)
            if not isinstance(piece, bytes) or piece != LLM.token_to_piece(t, special):
                raise AssertionError(f"token_to_piece({t}) gave {piece!r}")
        else:
            _expect_out_of_range(lambda: LLM.token_to_piece(t, special), [t])


def _chat(payload: bytes) -> None:
    if FORMATTER is None:
        return
    try:
        prompt = FORMATTER(messages=common.chat_messages(payload)).prompt
    except jinja2.TemplateError:
        return  # the template refusing a conversation (raise_exception) is its right
    _check_ids(LLM.tokenize(prompt.encode("utf-8"), add_bos=False, special=True), "tokenize(chat prompt)")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    flags, payload = data[0], data[1:]
    op = common.TOK_OPS[flags & 3]
    if op == "tokenize":
        _tokenize(common.tokenize_text(flags, payload), bool(flags & common.TOK_ADD_BOS),
                  bool(flags & common.TOK_SPECIAL))
    elif op == "detokenize":
        _detokenize(common.token_ids(flags, payload, N_VOCAB), bool(flags & common.TOK_ADD_BOS))
    elif op == "token_to_piece":
        _token_to_piece(common.token_ids(flags, payload, N_VOCAB), bool(flags & common.TOK_ADD_BOS))
    else:
        _chat(payload)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
