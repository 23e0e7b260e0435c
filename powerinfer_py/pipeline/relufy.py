"""Make a SwiGLU llama model activation-sparse (ProSparse / TurboSparse style):

    powerinfer relufy MODEL.gguf --corpus FILE... --out OUT.gguf [--act relu|drelu]
        [--l1 COEF] [--fatrelu-shift S] [--steps N] [--seq-len L] [--batch B]
        [--distill W] [--layerwise-steps N] [--target-sparsity S]
        [--checkpoint-dir D] [--resume] [--check]

The model (a llama- or qwen2-architecture GGUF, any weight type: dequantized with gguf)
is rebuilt in PyTorch exactly as the engine computes it: RMSNorm, RoPE in ggml's normal
mode for llama (adjacent pairs: GGUF q/k weights are already permuted for it) and NEOX
mode for qwen2 (halves), qwen2's q/k/v biases, grouped-query attention, tied output. The FFN activation SiLU(gate)·up is replaced by ReLU(gate)·up
(or dReLU, ReLU(gate)·ReLU(up)); optionally a FATReLU shift zeroes gate values below
S. The model is then fine-tuned on the corpus with next-token cross-entropy plus an L1
penalty on the FFN activations (per token, the sum of |act| over a layer's neurons,
averaged over layers; its coefficient ramps up linearly over the first quarter of the
steps, as ProSparse does progressively), the token embedding (and the tied
output) frozen. With --distill W the task loss is (1-W)·cross-entropy + W·KL(original ||
model): the original model (its own activation), frozen, runs on the same batch as the teacher, which
keeps the model close to it on text the corpus does not cover.

With --layerwise-steps N a cheaper stage comes first (layerwise_distill): layer after
layer, the relufied FFN is fitted by regression to the original's residual stream on
corpus tokens, N steps each, so the end-to-end steps start from a model that is already
close (on SmolLM2-135M the plain ReLU swap is at KL 5-6 nats from the original on unseen
text; the fitted one, after 4 minutes, at about 2.5). --target-sparsity S replaces the
fixed, ramped L1 coefficient with one steered (SparsityController) so that a share S of
the activations is zero, in both stages. Progress (step, loss, sparsity, tokens/s) goes to stderr, a checkpoint
is written every --checkpoint-every steps, and --resume continues from the last one.
--check then compares the torch forward pass of the ORIGINAL model with our engine's
logits on 32 corpus tokens (this catches RoPE/permutation layout errors).

The result is a standard GGUF (F16 or Q8_0) with every key of the input (tokenizer
included) and `powerinfer.ffn_activation = relu` (with a FATReLU shift S, also
`powerinfer.gate_thresholds` = S per layer), ready for profile -> train-predictor ->
convert. Needs PyTorch (`pip install 'powerinfer-py[pipeline]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..formats.gguf_io import (KEY_ACTIVATION, KEY_GATE_THRESHOLDS, KEY_THRESHOLD, KEY_THRESHOLDS, add_weight, copy_kv,
                               field, file_type, finish, new_writer, open_gguf, tensor_f32)
from ..llama import Llama
from .common import PipelineError, Progress, check_output, files, read_corpus, run_cli, replacing, same_file, tokenize_texts, write_text

ACTS = ("silu", "relu", "drelu")
ARCHS = ("llama", "qwen2")  # qwen2: llama with q/k/v biases and RoPE in NEOX mode (rotated halves)
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_BIASES = ("attn_q", "attn_k", "attn_v")  # qwen2's, as blk.N.attn_q.bias ...
_FFN_TENSORS = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")  # what the layerwise stage fits


def _torch():
    try:
        import torch
    except ImportError:
        raise PipelineError("relufy needs PyTorch: pip install 'powerinfer-py[pipeline]' (or torch==2.13.0)") from None
    return torch


def llama_hparams(reader, path="model") -> Dict:
    """Hyper-parameters of a llama- or qwen2-architecture GGUF (what relufy needs)."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise PipelineError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    hp = {"arch": arch, "rope_neox": arch == "qwen2"}
    for k, key, default in (("n_embd", "embedding_length", None), ("n_layer", "block_count", None),
                            ("n_ff", "feed_forward_length", None), ("n_head", "attention.head_count", None),
                            ("n_head_kv", "attention.head_count_kv", None), ("eps", "attention.layer_norm_rms_epsilon", 1e-5),
                            ("rope_base", "rope.freq_base", 10000.0), ("n_ctx", "context_length", 2048),
                            ("n_rot", "rope.dimension_count", None)):
        v = field(reader, f"{arch}.{key}", default)
        if v is None and k not in ("n_head_kv", "n_rot"):
            raise PipelineError(f"{path}: missing key {arch}.{key}")
        hp[k] = v
    hp["n_head_kv"] = hp["n_head_kv"] or hp["n_head"]
    if hp["n_rot"] is None:
        hp["n_rot"] = hp["n_embd"] // hp["n_head"]
    if field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise PipelineError(f"{path}: RoPE scaling is not supported by the pipeline")
    hp["activation"] = field(reader, KEY_ACTIVATION, "silu")
    return hp


def load_weights(model_path: str):
    """(hparams, {gguf tensor name: float32 array}) of a llama GGUF."""
    r = open_gguf(model_path)
    hp = llama_hparams(r, model_path)
    w = {t.name: tensor_f32(t) for t in r.tensors}
    need = ["token_embd.weight", "output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(hp["n_layer"])
                                                          for n in _LAYER_TENSORS]
    if hp["arch"] == "qwen2":
        need += [f"blk.{i}.{n}.bias" for i in range(hp["n_layer"]) for n in _BIASES]
    missing = [n for n in need if n not in w]
    if missing:
        raise PipelineError(f"{model_path}: missing tensors {missing[:5]}" + (" ..." if len(missing) > 5 else "")
                            + " (relufy needs a standard llama GGUF with ffn_down, not a PowerInfer file)")
    return hp, w, r


def build_model(hp: Dict, weights: Dict[str, np.ndarray], act: str = "silu", shift: float = 0.0):
    """A torch module computing the engine's llama forward pass. forward(tokens [B, T])
    returns (logits [B, T, n_vocab], per-layer FFN activations if collect=True)."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional
    if act not in ACTS:
        raise PipelineError(f"--act must be one of {ACTS}, not {act!r}")

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.hp, self.act, self.shift = hp, act, float(shift)
            self.tok_embd = nn.Parameter(torch.from_numpy(weights["token_embd.weight"].copy()), requires_grad=False)
            self.output = (nn.Parameter(torch.from_numpy(weights["output.weight"].copy()), requires_grad=False)
                           if "output.weight" in weights else None)
            self.output_norm = nn.Parameter(torch.from_numpy(weights["output_norm.weight"].copy()))
            self.blocks = nn.ModuleList()
            for i in range(hp["n_layer"]):
                blk = nn.ParameterDict({n: nn.Parameter(torch.from_numpy(weights[f"blk.{i}.{n}.weight"].copy()))
                                        for n in _LAYER_TENSORS})
                for n in _BIASES if hp["arch"] == "qwen2" else ():
                    blk[n + "_bias"] = nn.Parameter(torch.from_numpy(weights[f"blk.{i}.{n}.bias"].copy()))
                self.blocks.append(blk)
            hd = hp["n_embd"] // hp["n_head"]
            self.head_dim = hd
            inv = hp["rope_base"] ** (-np.arange(0, hp["n_rot"], 2, dtype=np.float64) / hp["n_rot"])
            self.register_buffer("inv_freq", torch.tensor(inv, dtype=torch.float32), persistent=False)

        def _norm(self, x, w):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.hp["eps"])).to(x.dtype) * w

        def _rope(self, x, cos, sin):  # x [B, H, T, hd]
            nr = self.hp["n_rot"]
            xr, xp = x[..., :nr], x[..., nr:]
            if self.hp["rope_neox"]:  # ggml NEOX mode: dimension j pairs with j + n_rot/2
                e, o = xr[..., : nr // 2], xr[..., nr // 2 :]
                out = torch.cat((e * cos - o * sin, e * sin + o * cos), dim=-1)
            else:  # ggml NORMAL mode rotates adjacent pairs
                e, o = xr[..., 0::2], xr[..., 1::2]
                out = torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2)
            return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out

        def _proj(self, blk, h, n):
            y = h @ blk[n].t()
            return y + blk[n + "_bias"] if n + "_bias" in blk else y

        def ffn_act(self, g, u):
            if self.act == "silu":
                return F.silu(g), F.silu(g) * u
            if self.act == "drelu":
                a = F.relu(g) * F.relu(u)
                return a, a
            a = F.relu(g) if self.shift <= 0 else g * (g > self.shift)
            return a, a * u

        def rope_tables(self, T: int, device=None):
            pos = torch.arange(T, dtype=torch.float32, device=device)
            ang = pos[:, None] * self.inv_freq[None, :]
            return ang.cos(), ang.sin()

        def attention(self, i: int, x, cos, sin):
            """The residual stream after layer i's attention: x + attn(norm(x))."""
            blk = self.blocks[i]
            B, T = x.shape[:2]
            H, Hkv, hd = self.hp["n_head"], self.hp["n_head_kv"], self.head_dim
            h = self._norm(x, blk["attn_norm"])
            q = self._proj(blk, h, "attn_q").view(B, T, H, hd).transpose(1, 2)
            k = self._proj(blk, h, "attn_k").view(B, T, Hkv, hd).transpose(1, 2)
            v = self._proj(blk, h, "attn_v").view(B, T, Hkv, hd).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
            return x + att.transpose(1, 2).reshape(*x.shape[:2], H * hd) @ blk["attn_output"].t()

        def ffn(self, i: int, x):
            """(activation [.., n_ff], FFN output [.., n_embd]) of layer i on the residual x."""
            blk = self.blocks[i]
            h = self._norm(x, blk["ffn_norm"])
            a, y = self.ffn_act(h @ blk["ffn_gate"].t(), h @ blk["ffn_up"].t())
            return a, y @ blk["ffn_down"].t()

        def forward(self, tokens, collect: bool = False):
            x = self.tok_embd[tokens]
            cos, sin = self.rope_tables(tokens.shape[1], tokens.device)
            acts = []
            for i in range(len(self.blocks)):
                x = self.attention(i, x, cos, sin)
                a, y = self.ffn(i, x)
                if collect:
                    acts.append(a)
                x = x + y
            x = self._norm(x, self.output_norm)
            logits = x @ (self.output if self.output is not None else self.tok_embd).t()
            return logits, acts

    return Llama()


def engine_logits(model_path: str, tokens: Sequence[int]) -> np.ndarray:
    """Every position's logits from our engine (dense), for checking the torch model."""
    llm = Llama(model_path=model_path, n_ctx=max(64, len(tokens) + 8), n_threads=2, sparse_mode="dense", verbose=False)
    try:
        return np.asarray(llm.compute_logits(list(tokens)), dtype=np.float32)
    finally:
        llm.close()


def check_against_engine(model_path: str, tokens: Sequence[int], hp=None, weights=None) -> Dict:
    """Runs the ORIGINAL activation in torch (float32) and in our engine on the same tokens:
    the max abs logit difference relative to the logit spread, and top-1 agreement."""
    torch = _torch()
    if weights is None:
        hp, weights, _ = load_weights(model_path)
    model = build_model(hp, weights, act=hp["activation"] if hp["activation"] in ACTS else "silu")
    with torch.no_grad():
        ours = model(torch.tensor([list(tokens)], dtype=torch.long))[0][0].numpy()
    ref = engine_logits(model_path, tokens)
    diff = float(np.abs(ours - ref).max())
    spread = float(ref.max() - ref.min())
    return {"max_abs_diff": diff, "rel_diff": diff / max(spread, 1e-9),
            "top1_agree": float(np.mean(ours.argmax(-1) == ref.argmax(-1)))}


def export_gguf(reader, model, out: str, outtype: str = "f16", progress: bool = True) -> None:
    """Writes the fine-tuned weights as a standard GGUF of the input's architecture, with its keys."""
    act = model.act
    w = new_writer(out, model.hp["arch"])
    copy_kv(reader, w, skip={"general.file_type", KEY_ACTIVATION, KEY_GATE_THRESHOLDS, KEY_THRESHOLD, KEY_THRESHOLDS})
    w.add_file_type(file_type(outtype))
    w.add_string(KEY_ACTIVATION, act)
    if act == "relu" and model.shift > 0:  # gate mode then skips exactly what FATReLU zeroes
        w.add_array(KEY_GATE_THRESHOLDS, [float(model.shift)] * model.hp["n_layer"])
    sd = {k: v.detach().float().numpy() for k, v in model.named_parameters()}
    add_weight(w, "token_embd.weight", sd["tok_embd"], outtype)
    if model.output is not None:
        add_weight(w, "output.weight", sd["output"], outtype)
    add_weight(w, "output_norm.weight", sd["output_norm"], outtype)
    for i in range(model.hp["n_layer"]):
        for n in _LAYER_TENSORS:
            add_weight(w, f"blk.{i}.{n}.weight", sd[f"blocks.{i}.{n}"], outtype)
        for n in _BIASES if model.hp["arch"] == "qwen2" else ():
            add_weight(w, f"blk.{i}.{n}.bias", sd[f"blocks.{i}.{n}_bias"], outtype)
    finish(w, out, progress=progress)


def _save_checkpoint(torch, path: Path, model, opt, step: int, meta: Dict, lam: Optional[float] = None,
                     layerwise: Optional[Dict] = None) -> None:
    state = {"step": step, "meta": meta, "opt": opt.state_dict(), "lam": lam, "layerwise": layerwise,
             "params": {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad},
             "rng": torch.get_rng_state(), "np_rng": np.random.get_state()}
    with replacing(path) as tmp:
        torch.save(state, tmp)


def distill_kl(torch):
    """KL(teacher || student) per token as an autograd function of the student's logits
    [N, V] (fp32) and the teacher's log-probabilities [N, V]. Its gradient, softmax(student)
    - softmax(teacher) over N, is written directly: autograd through log_softmax and kl_div
    walks the [N, V] tensors several more times, a tenth of an end-to-end step at a 49k
    vocabulary. Returns (kl, the student's log-probabilities, detached, for reporting)."""

    class _KL(torch.autograd.Function):
        @staticmethod
        def forward(ctx, s, t_logp):
            s_logp = torch.log_softmax(s, -1)
            t_p = t_logp.exp()
            tp, n = t_p.view(-1), s.shape[0]  # two dot products: no [N, V] temporary
            kl = (torch.dot(tp, t_logp.view(-1)) - torch.dot(tp, s_logp.view(-1))) / n
            ctx.save_for_backward(s_logp, t_p)
            ctx.mark_non_differentiable(s_logp)
            return kl, s_logp

        @staticmethod
        def backward(ctx, g, _g_logp):
            s_logp, t_p = ctx.saved_tensors  # in place: each is 4 N V bytes, used once
            return s_logp.exp_().sub_(t_p).mul_(g / s_logp.shape[0]), None

    return _KL.apply


def sparsity_of(acts) -> float:
    return float(np.mean([(a == 0).float().mean().item() for a in acts]))


class SparsityController:
    """Steers an L1 coefficient so that the measured share of zero activations reaches a
    target: after each step, lam <- lam * exp(gain * (target - sparsity)), within
    [lo, hi]. A target the model cannot reach at a small coefficient is reached at a larger
    one, whatever the model's activation scale, so no coefficient is tuned per model."""

    def __init__(self, target: float, lam: float, gain: float, lo: float = 1e-6, hi: float = 1e3):
        if not 0.0 < target < 1.0:
            raise PipelineError(f"--target-sparsity must be in (0, 1), not {target}")
        self.target, self.lam, self.gain, self.lo, self.hi = float(target), float(lam), float(gain), lo, hi

    def update(self, sparsity: float) -> float:
        self.lam = min(self.hi, max(self.lo, self.lam * math.exp(self.gain * (self.target - sparsity))))
        return self.lam


def _cosine(lr: float, step: int, steps: int, warm: int) -> float:
    return lr * min(1.0, (step + 1) / max(1, warm)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1))))


def layerwise_distill(model, teacher, tokens: np.ndarray, *, steps: int, n_seq: int, seq_len: int,
                      batch_tokens: int = 1024, lr: float = 3e-4, target_sparsity: Optional[float] = None,
                      seed: int = 0, progress: bool = True) -> Dict:
    """Local distillation, one layer after the other, before any end-to-end training.

    The original (teacher) and the relufied model (student) run on the same N_SEQ x SEQ_LEN
    corpus tokens. For layer i, the student's residual stream after its (unchanged)
    attention is the FFN's input, and the teacher's residual stream after layer i the
    target: the student's FFN (gate, up, down, ffn_norm) is fitted by regression to what
    makes its residual equal the teacher's, so it also makes up for the drift that the
    layers below left. Each token is one sample of a regression with n_embd targets (an
    end-to-end step learns from one next-token distribution per token), and a step
    computes one FFN instead of the whole model, which is why this stage costs minutes.
    Loss: squared error over the target's mean square (scale-free across layers) plus
    lam * mean|act| / (its value before training); with TARGET_SPARSITY lam is steered so
    the share of zero activations reaches it. Returns the per-layer numbers."""
    torch = _torch()
    n_layer, d = model.hp["n_layer"], model.hp["n_embd"]
    rng = np.random.default_rng(seed + 7919)
    starts = rng.integers(0, len(tokens) - seq_len, size=n_seq)
    seqs = torch.from_numpy(np.stack([tokens[s : s + seq_len] for s in starts]).astype(np.int64))
    cos, sin = model.rope_tables(seq_len)
    chunk = max(1, 16384 // seq_len)  # sequences per no-grad forward (bounds attention's memory)
    gen = torch.Generator().manual_seed(seed + 104729)
    with torch.no_grad():
        x_t = model.tok_embd[seqs].float()
        x_s = x_t.clone()
    layers = []
    bar = Progress("relufy layerwise", n_layer * steps, progress and steps > 0)
    t0 = time.time()
    for i in range(n_layer):
        with torch.no_grad():
            y_t = torch.empty_like(x_t)
            a_s = torch.empty_like(x_s)
            for c in range(0, n_seq, chunk):
                u = teacher.attention(i, x_t[c : c + chunk], cos, sin)
                y_t[c : c + chunk] = u + teacher.ffn(i, u)[1]
                a_s[c : c + chunk] = model.attention(i, x_s[c : c + chunk], cos, sin)
            inp = a_s.reshape(-1, d)
            target = (y_t - a_s).reshape(-1, d)
            denom = target.pow(2).mean().clamp_min(1e-20)
            stride = max(1, len(inp) // 4096)  # a fixed sample of the tokens for the numbers reported
            probe, probe_target = inp[::stride], target[::stride]
            a0, y0 = model.ffn(i, probe)
            act_scale = a0.abs().mean().clamp_min(1e-20)
            mse_before = float((y0 - probe_target).pow(2).mean() / denom)
            sp_before = float((a0 == 0).float().mean())
        blk = model.blocks[i]
        params = [blk[n] for n in _FFN_TENSORS]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        ctl = SparsityController(target_sparsity, 0.02, 0.3, hi=3.0) if target_sparsity is not None else None
        lam = ctl.lam if ctl else 0.0
        sp = sp_before
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = _cosine(lr, step, steps, max(1, steps // 20))
            idx = torch.randint(0, len(inp), (batch_tokens,), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a, y = model.ffn(i, inp[idx])
                mse = (y.float() - target[idx]).pow(2).mean() / denom
                l1 = a.float().abs().mean() / act_scale
                loss = mse + lam * l1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sp = float((a == 0).float().mean())
            if ctl:
                lam = ctl.update(sp)
            bar.update(i * steps + step + 1, f"layer {i}: mse {mse.item():.4f} (from {mse_before:.4f}) "
                       f"sparsity {sp:.1%} lam {lam:.3g} {time.time() - t0:.0f} s")
        with torch.no_grad():
            for c in range(0, n_seq, chunk):
                x_s[c : c + chunk] = a_s[c : c + chunk] + model.ffn(i, a_s[c : c + chunk])[1]
            x_t = y_t
            a1, y1 = model.ffn(i, probe)
            mse_after = float((y1 - probe_target).pow(2).mean() / denom)
            drift = float((x_s - x_t).pow(2).mean() / x_t.pow(2).mean().clamp_min(1e-20))
        layers.append({"layer": i, "mse_before": mse_before, "mse_after": mse_after, "sparsity_before": sp_before,
                       "sparsity_after": float((a1 == 0).float().mean()), "lambda": lam, "residual_drift": drift})
        for p in params:
            p.grad = None
    bar.close()
    return {"steps_per_layer": steps, "n_seq": n_seq, "seq_len": seq_len, "batch_tokens": batch_tokens, "lr": lr,
            "target_sparsity": target_sparsity, "wall_s": time.time() - t0, "layers": layers}


def _layerwise_stage(torch, model, teacher, tokens, lw_meta: Dict, checkpoint_dir: Optional[str], progress: bool) -> Dict:
    """Runs layerwise_distill, or loads its result from CHECKPOINT_DIR/relufy-layerwise.pt when
    that was made with the same settings (the stage is deterministic given them)."""
    path = Path(checkpoint_dir) / "relufy-layerwise.pt" if checkpoint_dir else None
    names = [f"blocks.{i}.{n}" for i in range(model.hp["n_layer"]) for n in _FFN_TENSORS]
    named = dict(model.named_parameters())
    if path is not None and path.is_file():
        state = torch.load(path, weights_only=False)
        if state.get("meta") == lw_meta:
            with torch.no_grad():
                for k in names:
                    named[k].copy_(state["params"][k])
            print(f"relufy: layerwise stage loaded from {path}", file=sys.stderr)
            return dict(state["report"], loaded_from=str(path))
    rep = layerwise_distill(model, teacher, tokens, steps=lw_meta["steps"], n_seq=lw_meta["n_seq"],
                            seq_len=lw_meta["seq_len"], lr=lw_meta["lr"], target_sparsity=lw_meta["target_sparsity"],
                            seed=lw_meta["seed"], progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:
            torch.save({"meta": lw_meta, "report": rep, "params": {k: named[k].detach().clone() for k in names}}, tmp)
    return rep


def relufy(model_path: str, corpus: Sequence[str], out: str, act: str = "relu", l1: float = 1e-2,
           shift: float = 0.0, steps: int = 200, seq_len: int = 256, batch: int = 4, lr: float = 2e-4,
           outtype: str = "f16", checkpoint_dir: Optional[str] = None, checkpoint_every: int = 50,
           resume: bool = False, n_tokens: Optional[int] = None, seed: int = 0, threads: int = 0,
           progress: bool = True, check: bool = False, distill: float = 0.0, temperature: float = 1.0,
           layerwise_steps: int = 0, layerwise_seqs: int = 128, layerwise_lr: float = 3e-4,
           target_sparsity: Optional[float] = None) -> Dict:
    torch = _torch()
    if act not in ("relu", "drelu"):
        raise PipelineError(f"--act must be relu or drelu, not {act!r}")
    if same_file(model_path, out):
        raise PipelineError("--out must differ from the input model")
    check_output(out)
    if outtype not in ("f16", "q8_0", "f32"):
        raise PipelineError(f"--outtype must be f16, q8_0 or f32, not {outtype!r}")
    if steps < 0 or seq_len < 2 or batch < 1:
        raise PipelineError("--steps must be >= 0, --seq-len >= 2, --batch >= 1")
    if not 0.0 <= distill <= 1.0 or not temperature > 0:
        raise PipelineError("--distill must be in [0, 1] and --temperature > 0")
    if layerwise_steps < 0 or layerwise_seqs < 1 or not layerwise_lr > 0:
        raise PipelineError("--layerwise-steps must be >= 0, --layerwise-seqs >= 1 and --layerwise-lr > 0")
    if target_sparsity is not None and not 0.0 < target_sparsity < 1.0:
        raise PipelineError(f"--target-sparsity must be in (0, 1), not {target_sparsity}")
    if threads > 0:
        torch.set_num_threads(threads)
    hp, weights, reader = load_weights(model_path)
    texts = read_corpus(corpus)
    tokens = tokenize_texts(model_path, texts, n_tokens)
    if len(tokens) < seq_len + 2:
        raise PipelineError(f"the corpus has {len(tokens)} tokens; need more than --seq-len {seq_len}")
    report: Dict = {"n_corpus_tokens": int(len(tokens))}
    torch.manual_seed(seed)
    np.random.seed(seed)
    model = build_model(hp, weights, act=act, shift=shift)
    # The teacher: the original model, frozen (distillation keeps the student close to it on
    # any text, not only on what the corpus covers).
    teacher = None
    if distill > 0 or layerwise_steps > 0:
        teacher = build_model(hp, weights, act=hp["activation"] if hp["activation"] in ACTS else "silu")
        teacher.eval()
        for q in teacher.parameters():
            q.requires_grad_(False)
    del weights
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    meta = {"model": os.path.abspath(model_path), "act": act, "shift": shift, "seq_len": seq_len, "batch": batch}
    if distill > 0:  # only then, so that checkpoints made before distillation existed still resume
        meta.update(distill=distill, temperature=temperature)
    lw_meta = None
    if layerwise_steps > 0:
        lw_meta = {"model": meta["model"], "act": act, "shift": shift, "steps": layerwise_steps, "n_seq": layerwise_seqs,
                   "seq_len": seq_len, "lr": layerwise_lr, "target_sparsity": target_sparsity, "seed": seed,
                   "n_corpus_tokens": int(len(tokens))}
        meta["layerwise"] = lw_meta
    if target_sparsity is not None:
        meta["target_sparsity"] = target_sparsity
    ckpt = Path(checkpoint_dir) / "relufy-checkpoint.pt" if checkpoint_dir else None
    start = 0
    lam_state = None
    if lw_meta is not None and not resume:
        report["layerwise"] = _layerwise_stage(torch, model, teacher, tokens, lw_meta, checkpoint_dir, progress)
    if resume:
        if ckpt is None or not ckpt.is_file():
            raise PipelineError(f"--resume: no checkpoint in {checkpoint_dir!r}")
        state = torch.load(ckpt, weights_only=False)
        if state["meta"] != meta:
            raise PipelineError(f"--resume: the checkpoint was made with {state['meta']}, not {meta}")
        with torch.no_grad():
            named = dict(model.named_parameters())
            for k, v in state["params"].items():
                named[k].copy_(v)
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
        np.random.set_state(state["np_rng"])
        start = int(state["step"])
        lam_state = state.get("lam")
        if state.get("layerwise") is not None:  # the stage this run started from, for the report
            report["layerwise"] = state["layerwise"]
        print(f"relufy: resumed at step {start}", file=sys.stderr)
    if distill <= 0:
        teacher = None  # only the layerwise stage needed it
    else:  # the end-to-end steps run the teacher under autocast: its matrices in bf16 once,
        # not cast at every step (the residual stream, norms and embeddings stay fp32)
        for blk in teacher.blocks:
            for n in _LAYER_TENSORS:
                if blk[n].dim() == 2:
                    blk[n].data = blk[n].data.to(torch.bfloat16)
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    warm = max(1, steps // 20)

    def lr_at(s):
        return _cosine(lr, s, steps, warm)

    # With a target sparsity the L1 coefficient starts at --l1 and is steered towards it;
    # without, it ramps up to --l1 over the first quarter of the steps (ProSparse).
    ctl = SparsityController(target_sparsity, lam_state if lam_state is not None else l1, 0.2) \
        if target_sparsity is not None else None

    kl_fn = distill_kl(torch)
    t0 = time.time()
    bar = Progress("relufy", steps - start, progress and steps > start)
    seen = 0
    tok_t = torch.from_numpy(tokens.astype(np.int64))
    hist = []
    model.train()
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        lam = ctl.lam if ctl else l1 * min(1.0, step / max(1, steps // 4))  # progressive L1 (ProSparse)
        starts = np.random.randint(0, len(tokens) - seq_len - 1, size=batch)
        xb = torch.stack([tok_t[s : s + seq_len + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, acts = model(xb[:, :-1], collect=True)
            flat = logits.float().reshape(-1, logits.shape[-1])
            targets = xb[:, 1:].reshape(-1)
            if teacher is None or distill < 1.0:
                ce = torch.nn.functional.cross_entropy(flat, targets)
                task = ce
            if teacher is not None:
                with torch.no_grad():
                    t_logits, _ = teacher(xb[:, :-1])
                    t_logits = t_logits.float().reshape(-1, flat.shape[-1])
                    t_logp = torch.log_softmax(t_logits / temperature if temperature != 1.0 else t_logits, -1)
                    del t_logits
                # KL(teacher || student) per token, scaled by T^2 (Hinton et al.) so its
                # gradient does not shrink with the temperature
                kl, s_logp = kl_fn(flat / temperature if temperature != 1.0 else flat, t_logp)
                kl = kl * temperature**2
                if distill >= 1.0:  # the corpus's cross-entropy only reported (exact at T = 1)
                    with torch.no_grad():
                        ce = -(s_logp if temperature == 1.0 else torch.log_softmax(flat, -1)).gather(
                            1, targets[:, None]).mean()
                    task = kl
                else:
                    task = (1.0 - distill) * ce + distill * kl
                del t_logp, s_logp
            # per token: sum over a layer's neurons (all >= 0: relu, drelu and the shifted
            # relu are, so no abs), averaged over layers and tokens
            l1_term = torch.stack([a.float().sum(-1).mean() for a in acts]).mean()
            loss = task + lam * l1_term
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += batch * seq_len
        sp = sparsity_of(acts)
        if ctl:
            ctl.update(sp)
        hist.append((float(ce.detach()), sp, float(kl.detach()) if teacher is not None else None))
        bar.update(step + 1 - start, f"step {step + 1}: loss {loss.item():.3f} ce {ce.item():.3f} "
                   + (f"kl {kl.item():.3f} " if teacher is not None else "") +
                   f"l1 {l1_term.item():.3f} lam {lam:.3g} sparsity {sp:.1%} {seen / (time.time() - t0):.0f} tok/s")
        if ckpt is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
            _save_checkpoint(torch, ckpt, model, opt, step + 1, meta, lam=ctl.lam if ctl else None,
                             layerwise=report.get("layerwise"))
    bar.close()
    model.eval()
    wall = time.time() - t0
    tail = hist[-max(1, len(hist) // 10):]
    report.update({"steps": steps, "start_step": start, "train_wall_s": wall, "tokens_trained": seen,
                   "final_ce": float(np.mean([h[0] for h in tail])) if tail else None,
                   "final_sparsity": float(np.mean([h[1] for h in tail])) if tail else None})
    if teacher is not None:
        report.update({"distill": distill, "temperature": temperature,
                       "final_kl": float(np.mean([h[2] for h in tail])) if tail else None})
        del teacher
    export_gguf(reader, model, out, outtype, progress=False)
    report["out"] = out
    if check:  # after training: running the engine in this process first slows torch's training threads down
        del model, opt
        c = check_against_engine(model_path, tokens[:32].tolist())
        report["check_original"] = c
        print(f"relufy: torch vs engine on the original model, 32 tokens: max |dlogit| {c['max_abs_diff']:.4g} "
              f"({c['rel_diff']:.2%} of the logit range), top-1 agreement {c['top1_agree']:.0%}", file=sys.stderr)
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer relufy", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="llama-architecture GGUF (standard, with ffn_down)")
    p.add_argument("--corpus", nargs="+", required=True, help="training text files")
    p.add_argument("--out", required=True, help="output GGUF")
    p.add_argument("--act", choices=("relu", "drelu"), default="relu")
    p.add_argument("--l1", type=float, default=1e-2, help="L1 coefficient on the FFN activations (default 1e-2)")
    p.add_argument("--fatrelu-shift", type=float, default=0.0, help="zero gate values below this (default 0)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--n-tokens", type=int, default=None, help="use at most this many corpus tokens")
    p.add_argument("--outtype", choices=("f16", "q8_0", "f32"), default="f16")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="after training, compare the torch forward pass of the ORIGINAL model with our engine's logits")
    p.add_argument("--report", help="write the run's numbers as JSON here")
    p.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="distill from the original: loss = (1-W) * cross-entropy + W * KL(original || model) "
                        "(default 0: cross-entropy only)")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    p.add_argument("--layerwise-steps", type=int, default=0, metavar="N",
                   help="first fit each layer's relufied FFN to the original's residual stream, layer by layer, "
                        "N steps each (default 0: no such stage)")
    p.add_argument("--layerwise-seqs", type=int, default=128, help="sequences of --seq-len tokens that stage fits on")
    p.add_argument("--layerwise-lr", type=float, default=3e-4, help="that stage's learning rate (default 3e-4)")
    p.add_argument("--target-sparsity", type=float, default=None, metavar="S",
                   help="steer the L1 coefficient (starting from --l1) so that a share S of the FFN activations "
                        "is zero, in both stages (default: a fixed --l1, ramped up)")

    def run(a):
        rep = relufy(a.model, a.corpus, a.out, act=a.act, l1=a.l1, shift=a.fatrelu_shift, steps=a.steps,
                     seq_len=a.seq_len, batch=a.batch, lr=a.lr, outtype=a.outtype, checkpoint_dir=a.checkpoint_dir,
                     checkpoint_every=a.checkpoint_every, resume=a.resume, n_tokens=a.n_tokens, seed=a.seed,
                     threads=a.threads, check=a.check, distill=a.distill, temperature=a.temperature,
                     layerwise_steps=a.layerwise_steps, layerwise_seqs=a.layerwise_seqs, layerwise_lr=a.layerwise_lr,
                     target_sparsity=a.target_sparsity)
        if a.report:
            write_text(a.report, json.dumps(rep, indent=1))
        print(json.dumps(rep, indent=1))
        return 0

    def paths(a):
        outputs = [("--out", a.out, files(a.out)), ("--report", a.report, files(a.report)),
                   ("--checkpoint-dir", a.checkpoint_dir,  # its files: the directory may hold the inputs
                    files(a.checkpoint_dir, "relufy-checkpoint.pt", "relufy-layerwise.pt")[1:])]
        return outputs, [("the model", a.model, files(a.model))] + [("--corpus", f, files(f)) for f in a.corpus]

    return run_cli(run, argv, p, paths)


if __name__ == "__main__":
    sys.exit(main())
