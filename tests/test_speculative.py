"""Speculative decoding (docs/speculative.md): with any draft, greedy output equals the output
without one (Llama, ParallelLlama slots, `main`, the server), on SmolLM2, Qwen2.5-Coder-0.5B
and a PowerInfer file; sampled output keeps the target's distribution (a chi-square over
many seeds, which a planted wrong rule fails); bad drafts and parameters are refused.

Drafters used: llama-cpp-python's LlamaPromptLookupDecoding, a draft model, and an oracle
that proposes the known continuation with one wrong token per draft, so that every step
accepts some drafts and rejects one (a drafter that is always right or always wrong would
leave half of the verify path untested)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from powerinfer_py import Llama, LlamaPromptLookupDecoding, ParallelLlama
from powerinfer_py._llama import generation, speculative
from powerinfer_py.assets.synthetic import PRESETS, generate

from conftest import N_THREADS

COPY_PROMPT = ("Repeat this list exactly: apples, pears, plums, cherries, figs, dates, limes, lemons, "
               "grapes, melons.\nList: apples, pears,")
N_GEN = 40
GREEDY = dict(temperature=0.0, repeat_penalty=1.0)


def _llama(path, **kw):
    return Llama(path, **{"n_ctx": 512, "n_threads": N_THREADS, "n_threads_batch": N_THREADS, "verbose": False, **kw})


class Oracle:
    """Proposes the reference continuation, k tokens at a time, with the proposal at a
    position that moves from step to step made wrong: each check keeps some drafts and
    rejects one (or keeps all, when the wrong one falls past the draft's end)."""

    def __init__(self, n_prompt: int, reference, k: int = 5):
        self.n_prompt, self.reference, self.k = n_prompt, list(reference), k
        self.calls = 0

    def __call__(self, input_ids, **kwargs):
        done = len(input_ids) - self.n_prompt  # generated so far, the token just sampled included
        proposal = self.reference[done : done + self.k]
        wrong = self.calls % (self.k + 2)
        self.calls += 1
        if wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % 100
        return np.array(proposal, dtype=np.intc)


def _completion_tokens(llm, prompt, n=N_GEN, **kw):
    out = llm.create_completion(prompt, max_tokens=n, logprobs=None, **{**GREEDY, **kw})
    return out["choices"][0]["text"]


def _generated(llm, prompt_tokens, n=N_GEN, stop_at_eog=True, **sampling):
    tokens = []
    for t in llm.generate(prompt_tokens, **{"temp": 0.0, "repeat_penalty": 1.0, **sampling}):
        if (stop_at_eog and llm.token_is_eog(t)) or len(tokens) >= n:
            break
        tokens.append(int(t))
    return tokens


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two tiny synthetic models on the same byte vocabulary (standard GGUF and PowerInfer
    twin each), different weights."""
    out = tmp_path_factory.mktemp("spec-synthetic")
    a = generate(PRESETS["tiny-q8"], out / "a", progress=False)
    from dataclasses import replace

    b = generate(replace(PRESETS["tiny-q8"], name="tiny-q8-b", seed=5), out / "b", progress=False)
    return a, b


# ---- greedy: the same tokens with any draft -------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder-0.5b"])
def test_greedy_with_drafts_equals_without(model_file, name):
    path = model_file(name)
    plain = _llama(path, batch_invariant=True)
    prompt = plain.tokenize(COPY_PROMPT.encode())
    reference = _generated(plain, prompt)
    assert len(reference) >= 16
    plain.close()
    for draft in (LlamaPromptLookupDecoding(num_pred_tokens=10), Oracle(len(prompt), reference)):
        llm = _llama(path, draft_model=draft)
        assert _generated(llm, prompt) == reference, type(draft).__name__
        st = llm.speculative_stats()
        assert st["verify_steps"] > 0 and st["accepted"] > 0, st
        if isinstance(draft, Oracle):
            assert st["accepted"] < st["drafted"], st  # some were rejected: the rollback ran
        llm.close()


def test_greedy_with_a_draft_model_and_completion_api(model_file):
    """A draft model (a GGUF, llama.cpp's -md): create_completion's text is unchanged, also
    through a chat completion, with a draft that disagrees often (another model's weights
    would; here the same file at default, not batch-invariant, kernels agrees mostly)."""
    path = model_file("smollm2")
    plain = _llama(path, batch_invariant=True)
    spec = _llama(path, draft_model_path=path, draft_max=6, draft_p_min=0.0)
    assert _completion_tokens(spec, COPY_PROMPT) == _completion_tokens(plain, COPY_PROMPT)
    messages = [{"role": "user", "content": "Name three colours."}]
    a = spec.create_chat_completion(messages, max_tokens=24, **GREEDY)["choices"][0]["message"]["content"]
    b = plain.create_chat_completion(messages, max_tokens=24, **GREEDY)["choices"][0]["message"]["content"]
    assert a == b
    st = spec.speculative_stats()
    assert st["accepted"] > 0 and st["tokens_per_step"] > 1.0, st
    spec.close()
    plain.close()


def test_draft_model_is_quiet_without_verbose(model_file, monkeypatch, capfd):
    """verbose=False keeps ggml quiet while the draft model loads and drafts, as it does for
    the target, also when another library has replaced ggml's log callback in between:
    llama-cpp-python installs its own (which prints every level, ggml's debug lines such as
    "repack: repack tensor ..." included) when it is first imported, which in a fresh
    process happens after the target's load. Qwen2.5-Coder's Q4_K weights are repacked on
    x86 with AVX2, and the draft, unlike the batch-invariant target, is repacked."""
    import ctypes
    import logging

    from powerinfer_py._llama import loading, upstream

    llama_cpp_logger = upstream.module("_logger")
    make_drafter = loading.make_drafter

    def after_a_late_llama_cpp_import(*args, **kwargs):
        # What llama_cpp/_logger.py does when first imported; its logger starts at NOTSET.
        upstream.module().llama_log_set(llama_cpp_logger.llama_log_callback, ctypes.c_void_p(0))
        return make_drafter(*args, **kwargs)

    monkeypatch.setattr(loading, "make_drafter", after_a_late_llama_cpp_import)
    monkeypatch.setattr(llama_cpp_logger.logger, "level", logging.NOTSET)
    path = model_file("qwen2.5-coder-0.5b")
    capfd.readouterr()
    llm = _llama(path, draft_model_path=path, draft_max=4, draft_p_min=0.0)
    _completion_tokens(llm, "def fibonacci(n):", n=8)
    assert llm.speculative_stats()["drafted"] > 0
    llm.close()
    err = capfd.readouterr().err
    assert "repack" not in err, err[-2000:]


def test_sampled_output_with_point_mass_drafts_is_the_same_draws(model_file):
    """Prompt lookup's drafts are point masses: the check draws from the target's sampler and
    compares, which makes the draws of a run without drafts: same seed, same text."""
    path = model_file("smollm2")
    plain = _llama(path, batch_invariant=True)
    spec = _llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=6))
    kw = dict(temperature=0.7, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=1234)
    out = spec.create_completion(COPY_PROMPT, max_tokens=N_GEN, **kw)["choices"][0]["text"]
    assert out == plain.create_completion(COPY_PROMPT, max_tokens=N_GEN, **kw)["choices"][0]["text"]
    assert spec.speculative_stats()["verify_steps"] > 0


@pytest.mark.parametrize("sampling", [{}, {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}])
def test_drafts_on_a_powerinfer_file(tiny_pair, sampling):
    """A PowerInfer file in predictor mode: a check's batch takes the sparse FFN over the union
    of its tokens' active neurons (each token computing only its own), so its logits equal
    one-token steps' to rounding (the partial sums are grouped by the union's length) and the
    tokens are the same, greedy or drawn with the same seed (the random weights' greedy text
    cycles; the drawn one does not). Checks stay within sparse_max_batch."""
    path = tiny_pair[0]["powerinfer"]
    plain = _llama(path, batch_invariant=True, seed=11)
    assert plain.sparse_mode_in_use() == "predictor"
    prompt = plain.tokenize(b"the cat sat on the mat and the dog")
    # Random weights: the text runs through end-of-text tokens.
    reference = _generated(plain, prompt, n=48, stop_at_eog=False, **sampling)
    assert len(set(reference)) > (10 if sampling else 2)
    for k in (3, 12):  # 12: more than sparse_max_batch allows in one check
        llm = _llama(path, draft_model=Oracle(len(prompt), reference, k=k), seed=11)
        assert _generated(llm, prompt, n=48, stop_at_eog=False, **sampling) == reference
        st = llm.speculative_stats()
        assert 0 < st["accepted"] < st["drafted"], st
        assert st["drafted"] <= st["verify_steps"] * (llm._ctx.sparse_max_batch() - 1)
        llm.close()


def test_parallel_slots_draft_and_equal_the_solo_run(model_file):
    """ParallelLlama: each slot drafts on its own (prompt lookup here), its greedy stream is
    the batch-invariant solo run's, while another slot generates alongside."""
    from concurrent.futures import ThreadPoolExecutor

    path = model_file("smollm2")
    solo = _llama(path, batch_invariant=True)
    expected = _completion_tokens(solo, COPY_PROMPT)
    other_expected = _completion_tokens(solo, "The capital of France is", n=24)
    solo.close()
    base = _llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8))
    with ParallelLlama(base, n_parallel=2) as pool:
        def run(args):
            prompt, n = args
            with pool.slot() as slot:
                return _completion_tokens(slot, prompt, n=n)

        got = list(ThreadPoolExecutor(2).map(run, [(COPY_PROMPT, N_GEN), ("The capital of France is", 24)]))
        assert got == [expected, other_expected]
        st = pool.speculative_stats()
        assert st["verify_steps"] > 0 and st["accepted"] > 0
    base.close()


# ---- sampled: the target's distribution -----------------------------------------------------

# Chi-square critical values at a false-alarm rate of 1e-4, by degrees of freedom.
_CHI2_1E4 = {5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72, 10: 35.56, 11: 37.37, 12: 39.13, 13: 40.87,
             14: 42.58, 15: 44.26, 16: 45.92, 17: 47.57, 18: 49.19, 19: 50.80, 20: 52.39}


def _chi_square(counts: np.ndarray, probs: np.ndarray, max_cells: int = 16):
    """(statistic, degrees of freedom) of observed counts against probabilities: the
    max_cells - 1 most probable tokens in cells of their own, the rest pooled into one, and
    no cell expected below 5 (so the test's approximation holds; few cells keep its power)."""
    n = counts.sum()
    expected = n * probs / probs.sum()
    small = expected < 5
    small[np.argsort(-expected)[max_cells - 1 :]] = True
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def _wrong_rule(p, q, draft, rng):
    """A plausible mistake: on rejection, draw from p itself instead of max(0, p - q)."""
    q_d = 1.0 if q is None else float(q[draft])
    if q_d > 0.0 and rng.random() * q_d < float(p[draft]):
        return int(draft)
    p64 = np.asarray(p, dtype=np.float64)
    return int(rng.choice(len(p64), p=p64 / p64.sum()))


@pytest.mark.parametrize("rule,passes", [(speculative.accept_draft, True), (_wrong_rule, False)])
def test_acceptance_rule_keeps_the_target_distribution(rule, passes):
    """Over a 6-token vocabulary: drafts drawn from q, kept or replaced by the rule; the tokens'
    counts against p. The standard rule passes, the planted wrong one is caught."""
    rng = np.random.default_rng(7)
    worst = 0.0
    for case in range(3):
        p = rng.dirichlet(np.ones(6))
        q = rng.dirichlet(np.ones(6)) if case < 2 else None  # the last: a point mass (prompt lookup)
        fixed = int(np.argmin(p))  # a point-mass draft the target rarely agrees with
        counts = np.zeros(6)
        for _ in range(20000):
            d = int(rng.choice(6, p=q)) if q is not None else fixed
            counts[rule(p, q, d, rng)] += 1
        stat, df = _chi_square(counts, p)
        worst = max(worst, stat / _CHI2_1E4[df])
    assert (worst < 1.0) == passes, worst


def _first_two_tokens_exact(target_path, prompt, sampling):
    """P(second generated token): sum over the first of p0(t0) p1(t | t0), with the target's
    own sampler chain (Sampler.probs) on one-token decodes."""
    from powerinfer_py._core import Context, Model, Sampler

    model = Model(target_path)
    # One thread: a tiny model's one-token decodes gain nothing from more, and a thread pool
    # spinning on a loaded machine made these 270 decodes take a minute.
    ctx = Context(model, n_ctx=64, n_threads=1, n_threads_batch=1, batch_invariant=True, flash_attn=1)
    sampler = Sampler(model, seed=0, penalty_last_n=0, repeat_penalty=1.0, frequency_penalty=0.0,
                      presence_penalty=0.0, mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, **sampling)
    ctx.decode(prompt, 0)
    p0 = sampler.probs(ctx, -1, np.asarray(prompt)).astype(np.float64)
    p1 = np.zeros_like(p0)
    for t0 in np.flatnonzero(p0 > 1e-9):
        ctx.decode([int(t0)], len(prompt))
        p1 += p0[t0] * sampler.probs(ctx, -1, np.asarray(prompt + [int(t0)])).astype(np.float64)
    ctx.close()
    model.close()
    return p1 / p1.sum()


# Seeds of the end-to-end test: the planted rule's chi-square grows with them, the right one's
# stays near its degrees of freedom.
N_SEEDS = 2500


@pytest.mark.parametrize("planted", [False, True])
def test_sampled_draft_model_keeps_the_distribution(tiny_pair, monkeypatch, planted):
    """A draft model on another model's weights draws its drafts from its own distribution q;
    the second generated token (the first the check decides) over many seeds against its exact
    distribution under the target. With the planted wrong rule the test fails."""
    target, draft = tiny_pair[0]["dense"], tiny_pair[1]["dense"]
    # A low temperature: peaked p and q, where drawing rejections from p instead of the
    # residual shows (chi-square 96 against a critical 44; the right rule 18, 15 expected).
    sampling = dict(temp=0.4, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)
    # One thread, as in _first_two_tokens_exact: thousands of tiny decodes.
    llm = _llama(target, draft_model_path=draft, draft_max=2, draft_p_min=0.0, n_threads=1, n_threads_batch=1)
    # Draft at every step: left to itself the drafter stops drafting once it sees that these
    # two random models rarely agree (speculative.DraftLength), and the rule would go unused.
    monkeypatch.setattr(llm._drafter.length, "choose", lambda room, n_min: room)
    prompt = llm.tokenize(b"once upon a time", add_bos=True)
    expected = _first_two_tokens_exact(target, prompt, sampling)
    if planted:
        monkeypatch.setattr(generation, "accept_draft", _wrong_rule)
    counts = np.zeros(llm.n_vocab())
    for seed in range(N_SEEDS):
        llm.set_seed(seed)
        it = llm.generate(prompt, repeat_penalty=1.0, **sampling)
        next(it)
        counts[next(it)] += 1
        it.close()
    st = llm.speculative_stats()
    assert 0 < st["accepted"] < st["drafted"], st  # both branches of the rule ran
    stat, df = _chi_square(counts, expected)
    assert (stat < _CHI2_1E4[df]) != planted, (stat, df)
    llm.close()


# ---- refused: bad drafts, bad parameters -----------------------------------------------------


def test_draft_with_another_vocabulary_is_refused(model_file):
    with pytest.raises(ValueError, match="does not share the vocabulary"):
        _llama(model_file("smollm2"), draft_model_path=model_file("qwen2.5-coder-0.5b"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(draft_max=0), "draft_max"),
    (dict(draft_max=4, draft_min=5), "draft_min"),
    (dict(draft_min=-1), "draft_min"),
    (dict(draft_p_min=1.5), "draft_p_min"),
    (dict(draft_p_min=-0.1), "draft_p_min"),
    (dict(draft_model="prompt-lookup-decoding"), "LlamaDraftModel"),
])
def test_bad_draft_parameters_raise(model_file, kwargs, match):
    kwargs.setdefault("draft_model", LlamaPromptLookupDecoding())
    with pytest.raises(ValueError, match=match):
        _llama(model_file("smollm2"), **kwargs)


def test_two_drafts_and_a_missing_draft_file_raise(model_file, tmp_path):
    path = model_file("smollm2")
    with pytest.raises(ValueError, match="not both"):
        _llama(path, draft_model=LlamaPromptLookupDecoding(), draft_model_path=path)
    with pytest.raises(ValueError, match="does not exist"):
        _llama(path, draft_model_path=str(tmp_path / "missing.gguf"))


# ---- main -md --------------------------------------------------------------------------------


def _main(cli_path, *args):
    return subprocess.run([str(cli_path), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.8", "-s", "7", "--repeat-penalty", "1.1"]])
def test_main_with_a_draft_model_prints_the_same_text(cli_path, model_file, sampling):
    path = model_file("smollm2")
    common = ["-m", path, "-p", COPY_PROMPT, "-n", str(N_GEN), "-t", str(N_THREADS), "-c", "512", *sampling]
    plain = _main(cli_path, *common, "--batch-invariant")
    spec = _main(cli_path, *common, "-md", path, "--draft-max", "6", "--draft-p-min", "0.5")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "speculative =" in spec.stderr and " 0 accepted" not in spec.stderr, spec.stderr


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "powerinfer"])
def test_main_with_a_draft_on_qwen_and_a_powerinfer_file(cli_path, model_file, tiny_pair, name):
    """Greedy `main -md` on Qwen2.5-Coder-0.5B (drafting for itself) and on a PowerInfer file
    in predictor mode, drafted for by its dense twin (mostly agreeing, sometimes not: both
    branches of the check run; main bounds a check by sparse_max_batch as Llama does)."""
    if name == "powerinfer":
        path, draft, extra = tiny_pair[0]["powerinfer"], tiny_pair[0]["dense"], ["--ignore-eos"]
    else:
        path = draft = model_file(name)
        extra = []
    common = ["-m", path, "-p", COPY_PROMPT, "-n", str(N_GEN), "-t", str(N_THREADS), "-c", "512", "--temp", "0",
              *extra]
    plain = _main(cli_path, *common, "--batch-invariant")
    spec = _main(cli_path, *common, "-md", draft, "--draft-max", "12", "--draft-p-min", "0")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "speculative =" in spec.stderr and " 0 accepted" not in spec.stderr, spec.stderr


@pytest.mark.parametrize("args,message", [
    (["--draft-max", "0"], "--draft-max"),
    (["--draft-max", "2", "--draft-min", "3"], "--draft-min"),
    (["--draft-p-min", "1.5"], "--draft-p-min"),
    (["--draft-p-min", "x"], "--draft-p-min"),
])
def test_main_refuses_bad_draft_parameters(cli_path, model_file, args, message):
    r = _main(cli_path, "-m", model_file("smollm2"), "-p", "x", "-n", "1", *args)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_main_refuses_a_draft_with_another_vocabulary(cli_path, model_file):
    r = _main(cli_path, "-m", model_file("smollm2"), "-md", model_file("qwen2.5-coder-0.5b"), "-p", "x", "-n", "1")
    assert r.returncode == 1 and "vocabulary" in r.stderr, r.stderr


# ---- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_server(model_file):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from powerinfer_py.server.app import create_app
    from powerinfer_py.server.settings import Settings

    settings = Settings(model=model_file("smollm2"), n_ctx=512, n_batch=512, n_threads=N_THREADS,
                        n_threads_batch=N_THREADS, verbose=False, n_parallel=2,
                        draft_model="prompt-lookup-decoding", draft_model_num_pred_tokens=8, draft_max=8)
    with TestClient(create_app(settings)) as client:
        yield client


def test_server_slots_draft_and_give_the_solo_text(spec_server, model_file):
    solo = _llama(model_file("smollm2"), batch_invariant=True)
    expected = _completion_tokens(solo, COPY_PROMPT)
    solo.close()
    r = spec_server.post("/v1/completions", json={"prompt": COPY_PROMPT, "max_tokens": N_GEN, **GREEDY,
                                                  "speculative.n_max": 6})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    metrics = spec_server.get("/metrics").text
    accepted = [line for line in metrics.splitlines() if line.startswith("powerinfer_draft_tokens_accepted_total ")]
    assert accepted and float(accepted[0].split()[1]) > 0, metrics


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "powerinfer"])
def test_server_slots_with_a_draft_model_give_the_solo_text(model_file, tiny_pair, name):
    """--model_draft under --n_parallel: each slot drafts with its own context on the draft
    model; two requests at once, each the batch-invariant solo run's text. Qwen2.5-Coder-0.5B
    drafting for itself; a PowerInfer file (predictor mode) drafted for by its dense twin."""
    pytest.importorskip("fastapi")
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from powerinfer_py.server.app import create_app
    from powerinfer_py.server.settings import Settings

    if name == "powerinfer":
        path, draft = tiny_pair[0]["powerinfer"], tiny_pair[0]["dense"]
        prompts = ["the cat sat on the mat and the dog", "once upon a time"]
    else:
        path = draft = model_file(name)
        prompts = [COPY_PROMPT, "def fibonacci(n):"]
    solo = _llama(path, batch_invariant=True)
    # End-of-text banned: the random weights of the synthetic file would end early.
    bias = {str(solo.token_eos()): -100.0}
    expected = [_completion_tokens(solo, p, n=24, logit_bias=bias) for p in prompts]
    solo.close()
    settings = Settings(model=path, model_draft=draft, n_ctx=512, n_batch=512, n_threads=N_THREADS,
                        n_threads_batch=N_THREADS, verbose=False, n_parallel=2, draft_max=8, draft_p_min=0.0)
    with TestClient(create_app(settings)) as client:
        def post(prompt):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "logit_bias": bias,
                                                     **GREEDY})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert list(ThreadPoolExecutor(2).map(post, prompts)) == expected
        metrics = client.get("/metrics").text
    accepted = [line for line in metrics.splitlines() if line.startswith("powerinfer_draft_tokens_accepted_total ")]
    assert accepted and float(accepted[0].split()[1]) > 0, metrics


@pytest.mark.parametrize("body", [{"speculative.n_max": 0}, {"speculative.p_min": 2.0},
                                  {"speculative.n_max": 2, "speculative.n_min": 3},
                                  {"speculative.n_min": 9}])  # more than the server's draft_max (8)
def test_server_refuses_bad_draft_parameters(spec_server, body):
    r = spec_server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_server_refuses_an_unknown_draft_method(model_file):
    from powerinfer_py.server.__main__ import main as server_main

    assert server_main(["--model", model_file("smollm2"), "--draft_model", "medusa", "--verbose", "false"]) == 1
    assert server_main(["--model", model_file("smollm2"), "--draft_max", "2", "--draft_min", "3"]) == 1
    proc = subprocess.run([sys.executable, "-m", "powerinfer_py.server", "--model", model_file("smollm2"),
                           "--draft_max", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "draft_max" in proc.stderr, proc.stderr


# ---- the draft length's timings (issue 53, item 7) -------------------------------------------


def _simulate(length, steps, verify_s, kept, slow_at=None):
    """Steps of a generation driven by `length`: a check of k drafts takes verify_s(k) seconds
    (slow_at: the check at that step takes 20x as long) and keeps kept(k); the k of each step."""
    ks = []
    for step in range(steps):
        k = length.choose(8, 0)
        seconds = verify_s(k) * (20 if step == slow_at and k else 1)
        length.record_decode(k, seconds)
        length.record_outcome(k, kept(k))
        ks.append(k)
    return ks


def test_draft_length_recovers_from_one_slow_check():
    """One check timed during a moment of load (20x a step) turned drafting off for good: only
    one-token steps were timed afterwards, so the slow check's timing never changed. Now a step
    drafts now and then anyway (a probe) and its timing replaces the stale one; where drafting
    does not pay the probes grow rare."""
    fast = speculative.DraftLength()
    ks = _simulate(fast, 300, lambda k: 0.010 + 0.0005 * k, lambda k: k, slow_at=3)
    assert ks[3] > 0 and sum(k > 0 for k in ks[-100:]) >= 90, ks
    assert fast.verify_s[8] < 0.02, fast.verify_s
    # Checks that cost 10 one-token steps and keep nothing: a handful of probes in 1000 steps.
    slow = speculative.DraftLength()
    ks = _simulate(slow, 1000, lambda k: 0.010 * (10 if k else 1), lambda k: 0)
    assert 1 <= slow.probes <= 7 and sum(k > 0 for k in ks) <= 10, (slow.probes, ks)


def test_one_slow_check_does_not_turn_drafting_off(model_file):
    """The same with the real engine, on a Llama and on each ParallelLlama slot (each has its
    own timings): after a check timed as if under load, drafting resumes within the stream."""
    path = model_file("smollm2")
    prompt = COPY_PROMPT + " plums, cherries, figs, dates, limes, lemons, grapes, melons.\nList: apples, pears,"

    def slow_then_generate(llm, length):
        _completion_tokens(llm, prompt, n=24)  # times one-token steps and checks
        assert 0 in length.verify_s and len(length.verify_s) > 1, length.verify_s
        for k in length.verify_s:  # one check slowed 50-fold by a moment of load
            if k:
                length.verify_s[k] = 50 * length.verify_s[0]
        before = llm._drafter.stats.verify_steps
        _completion_tokens(llm, prompt, n=60)
        return llm._drafter.stats.verify_steps - before

    with _llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8)) as llm:
        assert slow_then_generate(llm, llm._drafter.length) > 0
        with ParallelLlama(llm, n_parallel=2) as pool:
            for _ in range(2):
                with pool.slot() as slot:
                    assert slow_then_generate(slot, slot._drafter.length) > 0
