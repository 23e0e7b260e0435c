"""Bad input gives a clear error, never a crash: Python raises ValueError with the
core's message, and the `main` CLI exits with a non-zero status and a message on
stderr (not a signal)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List

import numpy as np
import pytest

from conftest import N_THREADS

CLI_TIMEOUT_S = 120
TRUNCATED = r"(?i)(truncat|corrupt|not a (valid )?GGUF)"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens


def _load(path, **kwargs):
    from powerinfer_py import Llama

    return Llama(str(path), n_ctx=64, n_threads=N_THREADS, verbose=False, **kwargs)


def _run_cli(cli: Path, args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(cli), *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def _assert_cli_fails(cli: Path, model: Path, pattern: str, extra: List[str] = ()) -> None:
    r = _run_cli(cli, ["-m", str(model), "-p", "Hello", "-n", "4", "-t", str(N_THREADS), *extra])
    tail = r.stderr[-3000:]
    assert r.returncode > 0, (
        f"expected a failure exit status, got {r.returncode} "
        f"({'killed by a signal' if r.returncode < 0 else 'success'})\nstderr:\n{tail}"
    )
    assert re.search(pattern, r.stderr), f"stderr does not match {pattern!r}:\n{tail}"


SURFACES = ["python", "cli"]


def _expect_load_error(surface: str, request, path: Path, pattern: str, **kwargs) -> None:
    """Python: ValueError matching `pattern` and naming the file; CLI: clean failure exit."""
    if surface == "cli":
        _assert_cli_fails(request.getfixturevalue("cli_path"), path, pattern)
        return
    with pytest.raises(ValueError, match=pattern) as e:
        _load(path, **kwargs)
    assert str(path) in str(e.value), str(e.value)


def _truncate(src: str, dst: Path, n: int) -> Path:
    with open(src, "rb") as f_in, open(dst, "wb") as f_out:
        remaining = n
        while remaining > 0:
            chunk = f_in.read(min(remaining, 4 << 20))
            if not chunk:
                break
            f_out.write(chunk)
            remaining -= len(chunk)
    assert dst.stat().st_size == n
    return dst


def _data_offset(path: str) -> int:
    gguf = pytest.importorskip("gguf")
    return int(gguf.GGUFReader(path).data_offset)


# ---- missing and non-GGUF files ---------------------------------------------------


@pytest.mark.parametrize("surface", SURFACES)
def test_missing_file(surface, request, tmp_path):
    path = tmp_path / "no-such-model.gguf"
    _expect_load_error(surface, request, path, re.escape(str(path)))


@pytest.mark.parametrize(
    "content",
    [b"", b"GG", b"this is not a model\n" * 100, b"GGML" + bytes(1000)],
    ids=["empty", "two-bytes", "text", "wrong-magic"],
)
@pytest.mark.parametrize("surface", SURFACES)
def test_not_a_gguf(surface, request, tmp_path, content):
    path = tmp_path / "not-a-model.gguf"
    path.write_bytes(content)
    _expect_load_error(surface, request, path, r"(?i)not a (valid )?GGUF")


@pytest.mark.parametrize("surface", SURFACES)
def test_directory_instead_of_file(surface, request, tmp_path):
    _expect_load_error(surface, request, tmp_path, r"(?i)regular file|directory")


# ---- truncated GGUF -------------------------------------------------------------------


def _truncation_points(path: str) -> List[int]:
    size = Path(path).stat().st_size
    data = _data_offset(path)
    points = {
        8: "magic+version",
        100: "inside the KV pairs",
        1000: "inside the KV pairs",
        data // 2: "half the header",
        data: "header only, no tensor data",
        data + (size - data) // 2: "mid tensor data",
        size - 1: "one byte short",
    }
    return sorted(p for p in points if 0 < p < size)


@pytest.mark.parametrize("surface", SURFACES)
def test_truncated_gguf(surface, request, tmp_path, smollm2_path):
    points = _truncation_points(smollm2_path)
    assert len(points) == 7
    for n in points:
        path = _truncate(smollm2_path, tmp_path / f"smollm2-first-{n}-bytes.gguf", n)
        _expect_load_error(surface, request, path, TRUNCATED)
        path.unlink()


def test_untruncated_copy_loads(tmp_path, smollm2_path):
    """The truncation test's copies fail because they are short, not because they are copies."""
    path = tmp_path / "smollm2-copy.gguf"
    shutil.copyfile(smollm2_path, path)
    llm = _load(path, fallback=False)
    try:
        assert llm.engine == "powerinfer"
        assert llm.n_vocab() > 0
    finally:
        llm.close()


# ---- unsupported architecture ------------------------------------------------------------


def _tiny_gguf(path: Path, arch: str) -> Path:
    """A small, well-formed GGUF of architecture `arch`: hyperparameters, an SPM
    tokenizer and the tensors a decoder-only model starts with."""
    gguf = pytest.importorskip("gguf")
    n_embd, n_ff, n_head, n_vocab = 16, 32, 2, 8
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>", "\u2581", "a", "b", "\u2581a"]
    types = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.BYTE,
        gguf.TokenType.NORMAL,
        gguf.TokenType.NORMAL,
        gguf.TokenType.NORMAL,
        gguf.TokenType.NORMAL,
    ]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(128)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("surface", SURFACES)
def test_unsupported_architecture(surface, request, tmp_path):
    path = _tiny_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3")
    _expect_load_error(surface, request, path, r"gemma3", fallback=False)
    if surface == "python":
        with pytest.raises(ValueError, match=r"(?i)not (implemented|supported)|unsupported"):
            _load(path, fallback=False)
        # With the llama-cpp-python fallback (the default) this file fails there too
        # (it has no layers); the message still names the architecture.
        with pytest.raises(ValueError, match=r"gemma3"):
            _load(path)


# ---- prompt longer than the context ------------------------------------------------------


def test_prompt_longer_than_context(smollm2_path, ref_llama):
    llm = _load(smollm2_path, fallback=False)
    try:
        n_ctx = llm.n_ctx()
        import llama_cpp

        # n_ctx=64 is rounded up the way llama.cpp does it.
        ref64 = llama_cpp.Llama(model_path=smollm2_path, n_ctx=64, n_threads=N_THREADS, verbose=False)
        try:
            assert n_ctx == ref64.n_ctx()
        finally:
            ref64.close()
        tokens = llm.tokenize(LONG_PROMPT.encode(), special=True)
        assert len(tokens) > n_ctx
        msg = rf"^Requested tokens \({len(tokens)}\) exceed context window of {n_ctx}$"
        with pytest.raises(ValueError, match=msg):
            llm.create_completion(LONG_PROMPT, max_tokens=4)
        # The same wording as llama-cpp-python.
        ref = ref_llama("smollm2")
        with pytest.raises(ValueError, match=r"^Requested tokens \(\d+\) exceed context window of \d+$"):
            ref.create_completion(LONG_PROMPT * 2, max_tokens=4)
        with pytest.raises(ValueError, match=r"exceed context window"):
            llm.compute_logits(tokens)

        # Boundary: n_ctx tokens are refused, n_ctx - 1 fit (llama-cpp-python's rule).
        with pytest.raises(ValueError, match=rf"Requested tokens \({n_ctx}\)"):
            llm.create_completion(tokens[:n_ctx], max_tokens=4)
        out = llm.create_completion(tokens[: n_ctx - 1], max_tokens=4, temperature=0.0)
        assert out["usage"]["prompt_tokens"] == n_ctx - 1
        assert out["usage"]["completion_tokens"] <= 1
        # The instance stays usable after the error.
        assert llm.create_completion("Hello", max_tokens=2, temperature=0.0)["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()


def test_prompt_longer_than_context_cli(smollm2_path, cli_path):
    r = _run_cli(cli_path, ["-m", smollm2_path, "-c", "64", "-p", LONG_PROMPT, "-n", "4", "-t", str(N_THREADS)])
    assert r.returncode > 0, f"exit status {r.returncode}\nstderr:\n{r.stderr[-3000:]}"
    assert re.search(r"(?i)context|too long|exceed", r.stderr), r.stderr[-3000:]


def test_closed_model_raises(smollm2_path):
    llm = _load(smollm2_path, fallback=False)
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.tokenize(b"hello")


def test_context_manager_closes(smollm2_path):
    with _load(smollm2_path, fallback=False) as llm:
        assert llm.tokenize(b"hello", add_bos=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.create_completion("hello")



def test_prompt_file_that_cannot_be_read_cli(smollm2_path, cli_path, tmp_path):
    """Issue 53, item 9: `main -f DIR` opened the directory, read nothing (EISDIR, unchecked)
    and generated from an empty prompt with exit status 0. A prompt file that cannot be read
    is an error that names it, as a missing one is."""
    for bad in (tmp_path, tmp_path / "missing.txt"):
        r = _run_cli(cli_path, ["-m", smollm2_path, "-f", str(bad), "-n", "4", "-t", str(N_THREADS)])
        assert r.returncode == 1, f"exit status {r.returncode}\nstdout:\n{r.stdout[-1000:]}\nstderr:\n{r.stderr[-3000:]}"
        assert f"cannot read prompt file '{bad}'" in r.stderr, r.stderr[-3000:]
    assert "Is a directory" in _run_cli(cli_path, ["-m", smollm2_path, "-f", str(tmp_path), "-n", "4"]).stderr
