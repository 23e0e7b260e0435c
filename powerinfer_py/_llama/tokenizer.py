"""Llama's vocabulary family: the LlamaTokenizer adapter over the core's tokenizer,
token pieces (cached: the vocabulary never changes), detokenization with
llama-cpp-python's rules, and the special tokens read from the GGUF metadata.

Every function takes the powerinfer_py.Llama it serves as `llama`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence


class CoreTokenizer:
    """llama_cpp.llama_tokenizer.LlamaTokenizer's interface over the core's vocabulary."""

    def __init__(self, llama: Any):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> List[int]:
        return tokenize(self._llama, text, add_bos, special)

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None, special: bool = False) -> bytes:
        return detokenize(self._llama, tokens, special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> List[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: List[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


def tokenize(llama: Any, text: bytes, add_bos: bool, special: bool) -> List[int]:
    """The core's tokens of `text` (add_bos: the vocabulary's prefix when it asks for one)."""
    return llama._require_model().tokenize(text, add_bos, special)


def token_to_piece(llama: Any, token: int, special: bool) -> bytes:
    """The text of one token, from the piece cache."""
    key = (int(token), bool(special))
    piece = llama._pieces.get(key)
    if piece is None:
        piece = llama._pieces[key] = llama._require_model().token_to_piece(*key)
    return piece


def detokenize(llama: Any, tokens: Sequence[int], special: bool) -> bytes:
    """Concatenated pieces (llama-cpp-python's LlamaTokenizer rule: a leading space after
    an initial BOS is dropped)."""
    output = b"".join(llama.token_to_piece(int(t), special) for t in tokens)
    if len(tokens) > 0 and tokens[0] == llama._token_bos and output[0:1] == b" ":
        return output[1:]
    return output


def token_text(llama: Any, token: int) -> str:
    """The text of a special token ("" for -1)."""
    return llama.token_to_piece(token, special=True).decode("utf-8", errors="replace") if token != -1 else ""


def token_nl(llama: Any) -> int:
    """The newline token (the last token of "\\n", which is the byte token for SPM vocabularies)."""
    tokens = tokenize(llama, b"\n", False, False)
    return tokens[-1] if tokens else -1


def meta_token(llama: Any, *keys: str) -> int:
    """The token id under the first of `keys` present in the metadata, else -1."""
    for key in keys:
        value = llama.metadata.get(key)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                pass
    return -1


def add_bos_token(llama: Any) -> bool:
    return llama._require_model().add_bos()


def add_eos_token(llama: Any) -> bool:
    # Not in the C API yet: read the GGUF key libllama reads (false for llama/qwen2 vocabularies).
    return llama.metadata.get("tokenizer.ggml.add_eos_token", "false") == "true"


def token_sep(llama: Any) -> int:
    return meta_token(llama, "tokenizer.ggml.seperator_token_id")


def token_cls(llama: Any) -> int:
    # libllama's llama_vocab_cls is the BOS token.
    return llama._token_bos


_FIM_TEXTS = (
    ("fim_pre", "prefix", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>")),
    ("fim_suf", "suffix", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>")),
    ("fim_mid", "middle", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>")),
)


def fim_tokens(llama: Any) -> tuple:
    """(prefix, suffix, middle) fill-in-the-middle tokens, -1 where the vocabulary has none.

    The C API does not expose them yet: read the GGUF keys, then look up the texts
    libllama recognizes (as llama-vocab.cpp does)."""
    cached = llama.__dict__.get("_fim_cache")
    if cached is not None:
        return cached
    found = []
    for key, old_key, texts in _FIM_TEXTS:
        token = meta_token(llama, f"tokenizer.ggml.{key}_token_id", f"tokenizer.ggml.{old_key}_token_id")
        if token == -1:
            for text in texts:
                ids = tokenize(llama, text.encode("utf-8"), False, True)
                if len(ids) == 1 and token_text(llama, ids[0]) == text:
                    token = ids[0]
                    break
        found.append(token)
    llama._fim_cache = tuple(found) if -1 not in found else (-1, -1, -1)
    return llama._fim_cache
