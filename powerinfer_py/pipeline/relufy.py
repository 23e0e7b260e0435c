"""Make a SwiGLU llama model activation-sparse (ProSparse / TurboSparse style):

    powerinfer relufy MODEL.gguf --corpus FILE... --out OUT.gguf [--act relu|drelu]
        [--l1 COEF] [--fatrelu-shift S] [--steps N] [--seq-len L] [--batch B]
        [--checkpoint-dir D] [--resume] [--check]

The model (a llama-architecture GGUF, any weight type: dequantized with gguf) is
rebuilt in PyTorch exactly as the engine computes it: RMSNorm, RoPE in ggml's normal
mode (adjacent pairs: GGUF q/k weights are already permuted for it), grouped-query
attention, tied output. The FFN activation SiLU(gate)·up is replaced by ReLU(gate)·up
(or dReLU, ReLU(gate)·ReLU(up)); optionally a FATReLU shift zeroes gate values below
S. The model is then fine-tuned on the corpus with next-token cross-entropy plus an L1
penalty on the FFN activations (per token, the sum of |act| over a layer's neurons,
averaged over layers; its coefficient ramps up linearly over the first quarter of the
steps, as ProSparse does progressively), the token embedding (and the tied
output) frozen. With --distill W the task loss is (1-W)·cross-entropy + W·KL(original ||
model): the original model (its own activation), frozen, runs on the same batch as the teacher, which
keeps the model close to it on text the corpus does not cover. Progress (step, loss, sparsity, tokens/s) goes to stderr, a checkpoint
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
from .common import PipelineError, Progress, read_corpus, run_cli, same_file, tokenize_texts

ACTS = ("silu", "relu", "drelu")
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def _torch():
    try:
        import torch
    except ImportError:
        raise PipelineError("relufy needs PyTorch: pip install 'powerinfer-py[pipeline]' (or torch==2.13.0)") from None
    return torch


def llama_hparams(reader, path="model") -> Dict:
    """Hyper-parameters of a llama-architecture GGUF (what relufy needs)."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise PipelineError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    hp = {"arch": arch}
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
                self.blocks.append(blk)
            hd = hp["n_embd"] // hp["n_head"]
            self.head_dim = hd
            inv = hp["rope_base"] ** (-np.arange(0, hp["n_rot"], 2, dtype=np.float64) / hp["n_rot"])
            self.register_buffer("inv_freq", torch.tensor(inv, dtype=torch.float32), persistent=False)

        def _norm(self, x, w):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.hp["eps"])).to(x.dtype) * w

        def _rope(self, x, cos, sin):  # x [B, H, T, hd]; ggml NORMAL mode rotates adjacent pairs
            nr = self.hp["n_rot"]
            xr, xp = x[..., :nr], x[..., nr:]
            e, o = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2)
            return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out

        def ffn_act(self, g, u):
            if self.act == "silu":
                return F.silu(g), F.silu(g) * u
            if self.act == "drelu":
                a = F.relu(g) * F.relu(u)
                return a, a
            a = F.relu(g) if self.shift <= 0 else g * (g > self.shift)
            return a, a * u

        def forward(self, tokens, collect: bool = False):
            B, T = tokens.shape
            H, Hkv, hd = self.hp["n_head"], self.hp["n_head_kv"], self.head_dim
            x = self.tok_embd[tokens]
            pos = torch.arange(T, dtype=torch.float32, device=tokens.device)
            ang = pos[:, None] * self.inv_freq[None, :]
            cos, sin = ang.cos(), ang.sin()
            acts = []
            for blk in self.blocks:
                h = self._norm(x, blk["attn_norm"])
                q = (h @ blk["attn_q"].t()).view(B, T, H, hd).transpose(1, 2)
                k = (h @ blk["attn_k"].t()).view(B, T, Hkv, hd).transpose(1, 2)
                v = (h @ blk["attn_v"].t()).view(B, T, Hkv, hd).transpose(1, 2)
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
                if Hkv != H:
                    k = k.repeat_interleave(H // Hkv, dim=1)
                    v = v.repeat_interleave(H // Hkv, dim=1)
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + att.transpose(1, 2).reshape(B, T, H * hd) @ blk["attn_output"].t()
                h = self._norm(x, blk["ffn_norm"])
                a, y = self.ffn_act(h @ blk["ffn_gate"].t(), h @ blk["ffn_up"].t())
                if collect:
                    acts.append(a)
                x = x + y @ blk["ffn_down"].t()
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
    """Writes the fine-tuned weights as a standard llama GGUF with the input's keys."""
    act = model.act
    w = new_writer(out, "llama")
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
    finish(w, out, progress=progress)


def _save_checkpoint(torch, path: Path, model, opt, step: int, meta: Dict) -> None:
    state = {"step": step, "meta": meta, "opt": opt.state_dict(),
             "params": {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad},
             "rng": torch.get_rng_state(), "np_rng": np.random.get_state()}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def sparsity_of(acts) -> float:
    return float(np.mean([(a == 0).float().mean().item() for a in acts]))


def relufy(model_path: str, corpus: Sequence[str], out: str, act: str = "relu", l1: float = 1e-2,
           shift: float = 0.0, steps: int = 200, seq_len: int = 256, batch: int = 4, lr: float = 2e-4,
           outtype: str = "f16", checkpoint_dir: Optional[str] = None, checkpoint_every: int = 50,
           resume: bool = False, n_tokens: Optional[int] = None, seed: int = 0, threads: int = 0,
           progress: bool = True, check: bool = False, distill: float = 0.0, temperature: float = 1.0) -> Dict:
    torch = _torch()
    if act not in ("relu", "drelu"):
        raise PipelineError(f"--act must be relu or drelu, not {act!r}")
    if same_file(model_path, out):
        raise PipelineError("--out must differ from the input model")
    if outtype not in ("f16", "q8_0", "f32"):
        raise PipelineError(f"--outtype must be f16, q8_0 or f32, not {outtype!r}")
    if steps < 0 or seq_len < 2 or batch < 1:
        raise PipelineError("--steps must be >= 0, --seq-len >= 2, --batch >= 1")
    if not 0.0 <= distill <= 1.0 or not temperature > 0:
        raise PipelineError("--distill must be in [0, 1] and --temperature > 0")
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
    if distill > 0:
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
    ckpt = Path(checkpoint_dir) / "relufy-checkpoint.pt" if checkpoint_dir else None
    start = 0
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
        print(f"relufy: resumed at step {start}", file=sys.stderr)
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    warm = max(1, steps // 20)

    def lr_at(s):
        return lr * min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(steps, 1))))

    t0 = time.time()
    bar = Progress("relufy", steps - start, progress and steps > start)
    seen = 0
    tok_t = torch.from_numpy(tokens.astype(np.int64))
    hist = []
    model.train()
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        lam = l1 * min(1.0, step / max(1, steps // 4))  # progressive L1 (ProSparse)
        starts = np.random.randint(0, len(tokens) - seq_len - 1, size=batch)
        xb = torch.stack([tok_t[s : s + seq_len + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, acts = model(xb[:, :-1], collect=True)
            flat = logits.float().reshape(-1, logits.shape[-1])
            ce = torch.nn.functional.cross_entropy(flat, xb[:, 1:].reshape(-1))
            task = ce
            if teacher is not None:
                with torch.no_grad():
                    t_logits, _ = teacher(xb[:, :-1])
                    t_logp = torch.log_softmax(t_logits.float().reshape(-1, flat.shape[-1]) / temperature, -1)
                # KL(teacher || student) per token, scaled by T^2 (Hinton et al.) so its
                # gradient does not shrink with the temperature
                kl = torch.nn.functional.kl_div(torch.log_softmax(flat / temperature, -1), t_logp, log_target=True,
                                                reduction="batchmean") * temperature**2
                task = (1.0 - distill) * ce + distill * kl
            # per token: sum over a layer's neurons, averaged over layers and tokens
            l1_term = torch.stack([a.float().abs().sum(-1).mean() for a in acts]).mean()
            loss = task + lam * l1_term
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += batch * seq_len
        sp = sparsity_of(acts)
        hist.append((float(ce.detach()), sp, float(kl.detach()) if teacher is not None else None))
        bar.update(step + 1 - start, f"step {step + 1}: loss {loss.item():.3f} ce {ce.item():.3f} "
                   + (f"kl {kl.item():.3f} " if teacher is not None else "") +
                   f"l1 {l1_term.item():.3f} sparsity {sp:.1%} {seen / (time.time() - t0):.0f} tok/s")
        if ckpt is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
            _save_checkpoint(torch, ckpt, model, opt, step + 1, meta)
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

    def run(argv):
        a = p.parse_args(argv)
        rep = relufy(a.model, a.corpus, a.out, act=a.act, l1=a.l1, shift=a.fatrelu_shift, steps=a.steps,
                     seq_len=a.seq_len, batch=a.batch, lr=a.lr, outtype=a.outtype, checkpoint_dir=a.checkpoint_dir,
                     checkpoint_every=a.checkpoint_every, resume=a.resume, n_tokens=a.n_tokens, seed=a.seed,
                     threads=a.threads, check=a.check, distill=a.distill, temperature=a.temperature)
        if a.report:
            Path(a.report).write_text(json.dumps(rep, indent=1))
        print(json.dumps(rep, indent=1))
        return 0

    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
