"""Convert a model to PowerInfer's format:

    powerinfer convert INPUT --out OUT.powerinfer.gguf [--predictors DIR] [--stats DIR_OR_FILE]
        [--outtype f16|q8_0|q4_0]

INPUT is a Hugging Face llama-family directory (config.json, *.safetensors read by our
own parser: F32/F16/BF16, no torch; tokenizer.json with a byte-level BPE, or
tokenizer.model when sentencepiece is installed) or a GGUF (standard or PWRI) of
architecture llama or qwen2. The output is a GGUF with the `PWRI` magic:

- `blk.N.ffn_down_t.weight` (down transposed; `ffn_down` is dropped);
- with --predictors (a `powerinfer train-predictor` output, or PowerInfer's predictor
  dir of model_{i}.pt + config.json): `blk.N.fc1.weight`, `blk.N.fc2.weight`,
  `powerinfer.sparse_threshold` and, from thresholds.json, `powerinfer.sparse_thresholds`;
- with --stats (a `powerinfer profile` dir, its stats.gguf, or an activation/ dir of
  activation_{i}.pt): `blk.N.ffn_act_count` and `powerinfer.stats.n_tokens`;
- `powerinfer.ffn_activation` always written (from the input, or --activation).

2-D weights are stored at --outtype (F16, Q8_0 or Q4_0; rows that do not fill whole
32-value blocks fall back to F16), 1-D tensors as F32. Without --predictors the file
runs in gate mode (ReLU models) or dense. The output is written to a temporary file and
renamed; the input is never modified. With --card FILE..., held-out text, it ends with
the output's trust card (`powerinfer eval`; against --card-reference, the original).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..formats import pt_io
from . import evaluate
from ..formats.gguf_io import (KEY_ACTIVATION, KEY_STATS_N_TOKENS, KEY_THRESHOLD, KEY_THRESHOLDS, OUTTYPES,
                               PWRI_MAGIC, STATS_TENSOR, add_weight, copy_kv, field, file_type, finish, new_writer,
                               open_gguf, read_stats, tensor_f32)
from .common import PipelineError, check_output, files, run_cli, same_file

HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}
GGUF_ARCHS = ("llama", "qwen2")
_HF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_HF_ACT = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu",
           "gelu_pytorch_tanh": "gelu"}


# ---------------------------------------------------------------- safetensors

def read_safetensors(path) -> Dict[str, np.ndarray]:
    """{name: float32 array} of a .safetensors file (F32, F16 or BF16), memory-mapped."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise PipelineError(f"{path}: truncated safetensors file")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > min(size - 8, 100 << 20):
            raise PipelineError(f"{path}: bad safetensors header length {hlen}")
        try:
            header = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PipelineError(f"{path}: bad safetensors header ({e})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + hlen) if size > 8 + hlen else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PipelineError(f"{path}: bad header entry for {name}") from None
        if dt not in _ST_DTYPES:
            raise PipelineError(f"{path}: tensor {name} has dtype {dt}; only F32, F16 and BF16 are supported")
        n = int(np.prod(shape)) if shape else 1
        if not (0 <= b <= e <= len(data)) or e - b != n * _ST_DTYPES[dt].itemsize:
            raise PipelineError(f"{path}: tensor {name} lies outside the file or has the wrong size")
        a = data[b:e].view(_ST_DTYPES[dt])
        a = (a.astype(np.uint32) << 16).view(np.float32) if dt == "BF16" else a.astype(np.float32)
        out[name] = a.reshape(shape)
    return out


def write_safetensors(path, tensors: Dict[str, np.ndarray]) -> None:
    """Writes float32/float16 arrays as a .safetensors file (used by tests and tools)."""
    header, off, blobs = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dt = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}[a.dtype]
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotary layout (halves) -> GGUF/ggml normal-mode layout (adjacent pairs), per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_qk (GGUF -> HF)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_source(d: Path, tokenizer_pre: str = "default"):
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise PipelineError(f"{d}: no config.json (not a Hugging Face model directory)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if archs[0] not in HF_ARCHS:
        raise PipelineError(f"{d}: architecture {archs[0]} is not supported (supported: {', '.join(HF_ARCHS)})")
    if cfg.get("rope_scaling"):
        raise PipelineError(f"{d}: rope_scaling {cfg['rope_scaling']} is not supported")
    try:
        n_embd, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        hp = {"n_embd": n_embd, "n_layer": int(cfg["num_hidden_layers"]), "n_ff": int(cfg["intermediate_size"]),
              "n_head": n_head, "n_head_kv": int(cfg.get("num_key_value_heads") or n_head),
              "eps": float(cfg.get("rms_norm_eps", 1e-5)), "rope_base": float(cfg.get("rope_theta", 10000.0)),
              "n_ctx": int(cfg.get("max_position_embeddings", 2048)), "head_dim": int(cfg.get("head_dim") or n_embd // n_head)}
    except KeyError as e:
        raise PipelineError(f"{d}/config.json: missing {e.args[0]}") from None
    act = cfg.get("hidden_act", "silu")
    if act not in _HF_ACT:
        raise PipelineError(f"{d}: hidden_act {act!r} is not supported")
    hp["activation"] = _HF_ACT[act]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{d}: no .safetensors files (PyTorch .bin checkpoints are not read; convert them first)")
    tensors: Dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))

    def gen() -> Iterator[Tuple[str, np.ndarray]]:
        for name, a in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "model.embed_tokens.weight":
                yield "token_embd.weight", a
            elif name == "model.norm.weight":
                yield "output_norm.weight", a
            elif name == "lm_head.weight":
                if not cfg.get("tie_word_embeddings", False):
                    yield "output.weight", a
            elif name.startswith("model.layers."):
                parts = name.split(".")
                il, rest = int(parts[2]), ".".join(parts[3:-1])
                if rest not in _HF_LAYER or parts[-1] != "weight":
                    raise PipelineError(f"{d}: unexpected tensor {name} for a llama model")
                g = _HF_LAYER[rest]
                if g == "attn_q":
                    a = permute_qk(a, hp["n_head"])
                elif g == "attn_k":
                    a = permute_qk(a, hp["n_head_kv"])
                yield f"blk.{il}.{g}.weight", a
            else:
                raise PipelineError(f"{d}: unexpected tensor {name} for a llama model")

    def keys(w):
        import gguf

        w.add_name(cfg.get("_name_or_path") or d.name)
        w.add_context_length(hp["n_ctx"])
        w.add_embedding_length(hp["n_embd"])
        w.add_block_count(hp["n_layer"])
        w.add_feed_forward_length(hp["n_ff"])
        w.add_head_count(hp["n_head"])
        w.add_head_count_kv(hp["n_head_kv"])
        w.add_rope_dimension_count(hp["head_dim"])
        w.add_rope_freq_base(hp["rope_base"])
        w.add_layer_norm_rms_eps(hp["eps"])
        n_vocab = tensors["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in tensors else None
        _add_hf_tokenizer(w, d, n_vocab, gguf, tokenizer_pre)

    return "llama", hp, gen, keys


def _add_hf_tokenizer(w, d: Path, n_vocab: Optional[int], gguf, pre: str = "default") -> None:
    from gguf.vocab import BpeVocab, SentencePieceVocab, SpecialVocab

    vocab = None
    try:
        vocab = BpeVocab(d)
    except (FileNotFoundError, KeyError):
        if (d / "tokenizer.model").is_file():
            try:
                vocab = SentencePieceVocab(d)
            except (ImportError, NameError, FileNotFoundError) as e:
                raise PipelineError(f"{d}: tokenizer.model needs the sentencepiece package ({e})") from None
    if vocab is None:
        raise PipelineError(f"{d}: no supported tokenizer (tokenizer.json with a byte-level BPE model, "
                            "or tokenizer.model with sentencepiece installed)")
    toks, scores, types = [], [], []
    for t, s, ty in vocab.all_tokens():
        toks.append(t)
        scores.append(s)
        types.append(ty)
    if n_vocab is not None:
        if len(toks) > n_vocab:
            raise PipelineError(f"{d}: the tokenizer has {len(toks)} tokens, the embedding only {n_vocab}")
        for i in range(len(toks), n_vocab):
            toks.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            types.append(gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model(vocab.tokenizer_model)
    if vocab.tokenizer_model == "gpt2":
        w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    SpecialVocab(d, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=len(toks)).add_to_gguf(w, quiet=True)


def _gguf_source(path: str):
    r = open_gguf(path)
    arch = field(r, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise PipelineError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    hp = {"n_embd": field(r, f"{arch}.embedding_length"), "n_layer": field(r, f"{arch}.block_count"),
          "n_ff": field(r, f"{arch}.feed_forward_length")}
    if None in hp.values():
        raise PipelineError(f"{path}: missing {arch}.embedding_length/block_count/feed_forward_length")
    with open(path, "rb") as f:
        default_act = "relu" if (arch == "llama" and f.read(4) == PWRI_MAGIC) else "silu"
    hp["activation"] = field(r, KEY_ACTIVATION, default_act)

    def gen():
        for t in r.tensors:
            yield t.name, tensor_f32(t)

    def keys(w, skip):
        copy_kv(r, w, skip=skip)

    return arch, hp, gen, keys


# ---------------------------------------------------------------- convert

def convert(src: str, out: str, predictors: Optional[str] = None, stats: Optional[str] = None, outtype: str = "f16",
            activation: Optional[str] = None, tokenizer_pre: str = "default", progress: bool = False) -> Dict:
    if outtype not in OUTTYPES:
        raise PipelineError(f"--outtype must be one of {OUTTYPES}, not {outtype!r}")
    if not os.path.exists(src):
        raise PipelineError(f"{src}: no such file or directory")
    if same_file(src, out) or (os.path.isdir(out)):
        raise PipelineError(f"--out {out} must be a new file name, not the input or a directory")
    check_output(out)
    if os.path.isdir(src):
        arch, hp, gen, keys = _hf_source(Path(src), tokenizer_pre)
    else:
        arch, hp, gen, keys = _gguf_source(src)
    L, E, Fn = hp["n_layer"], hp["n_embd"], hp["n_ff"]
    act = activation or hp["activation"]
    if act not in ("silu", "relu", "gelu", "drelu"):
        raise PipelineError(f"activation {act!r} is not one the engine runs (silu, relu, gelu, drelu)")

    preds, thr, thrs = None, None, None
    if predictors:
        preds = pt_io.read_predictor_dir(predictors, L)
        for i, (fc1, fc2) in enumerate(preds):
            if fc1.shape[1] != E or fc2.shape[0] != Fn:
                raise PipelineError(f"{predictors}: predictor {i} is [{fc1.shape}, {fc2.shape}], the model needs "
                                    f"fc1 [r, {E}] and fc2 [{Fn}, r]")
        pd = Path(predictors)
        if (pd / "thresholds.json").is_file():
            tj = json.loads((pd / "thresholds.json").read_text())
            thr, thrs = float(tj["sparse_threshold"]), [float(t) for t in tj.get("sparse_thresholds", [])] or None
            if thrs is not None and len(thrs) != L:
                raise PipelineError(f"{pd}/thresholds.json: {len(thrs)} per-layer thresholds for {L} layers")
        elif (pd / "config.json").is_file():
            thr = float(json.loads((pd / "config.json").read_text()).get("sparse_threshold", 0.0))
        else:
            thr = 0.0
    counts, n_tok = None, None
    if stats:
        counts, n_tok = read_stats(stats, L)
        if any(len(c) != Fn for c in counts):
            raise PipelineError(f"{stats}: statistics have {len(counts[0])} neurons per layer, the model {Fn}")
        if n_tok is None:
            n_tok = int(max(float(c.max()) for c in counts))
            print(f"warning: {stats} does not say how many tokens were profiled; using the largest count {n_tok}",
                  file=sys.stderr)

    w = new_writer(out, arch)
    skip = {"general.file_type", KEY_ACTIVATION}
    if preds is not None:
        skip |= {KEY_THRESHOLD, KEY_THRESHOLDS}
    if counts is not None:
        skip |= {KEY_STATS_N_TOKENS}
    if os.path.isdir(src):
        keys(w)
    else:
        keys(w, skip)
    w.add_file_type(file_type(outtype))
    w.add_string(KEY_ACTIVATION, act)
    if preds is not None:
        w.add_float32(KEY_THRESHOLD, thr)
        if thrs is not None:
            w.add_array(KEY_THRESHOLDS, thrs)
    if counts is not None:
        w.add_uint64(KEY_STATS_N_TOKENS, int(n_tok))

    names = set()
    for name, a in gen():
        if preds is not None and (name.endswith(".fc1.weight") or name.endswith(".fc2.weight")):
            continue
        if counts is not None and name.endswith(".ffn_act_count"):
            continue
        if name.endswith(".ffn_down.weight"):
            name, a = name.replace(".ffn_down.", ".ffn_down_t."), np.ascontiguousarray(a.T)
        if name.endswith(".ffn_act_count"):
            w.add_tensor(name, np.asarray(a, np.float32))
        else:
            add_weight(w, name, a, outtype)
        names.add(name)
    missing = [f"blk.{i}.{n}.weight" for i in range(L) for n in ("ffn_gate", "ffn_up", "ffn_down_t")
               if f"blk.{i}.{n}.weight" not in names]
    if "token_embd.weight" not in names:
        missing.insert(0, "token_embd.weight")
    if missing:
        w.close()
        if os.path.exists(out + ".tmp"):
            os.remove(out + ".tmp")
        raise PipelineError(f"{src}: missing tensors {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if preds is not None:
        for i, (fc1, fc2) in enumerate(preds):
            add_weight(w, f"blk.{i}.fc1.weight", fc1, outtype)
            add_weight(w, f"blk.{i}.fc2.weight", fc2, outtype)
    if counts is not None:
        for i, c in enumerate(counts):
            w.add_tensor(STATS_TENSOR.format(i), np.asarray(c, np.float32))
    finish(w, out, pwri=True, progress=progress, inputs=[src] if os.path.isfile(src) else [])
    return {"out": out, "arch": arch, "n_layer": L, "outtype": outtype, "activation": act,
            "predictors": preds is not None, "stats": counts is not None, "sparse_threshold": thr,
            "bytes": os.path.getsize(out)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="powerinfer convert", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="Hugging Face model directory or GGUF file")
    p.add_argument("--out", required=True, help="output .powerinfer.gguf")
    p.add_argument("--predictors", help="predictor directory (model_{i}.pt)")
    p.add_argument("--stats", help="profile output dir, stats.gguf or activation/ dir")
    p.add_argument("--outtype", choices=("f16", "q8_0", "q4_0", "f32"), default="f16")
    p.add_argument("--activation", choices=("silu", "relu", "gelu", "drelu"), help="override the FFN activation key")
    p.add_argument("--tokenizer-pre", default="default",
                   help="llama.cpp pre-tokenizer name for a BPE tokenizer.json (default: 'default')")
    p.add_argument("--card", nargs="+", metavar="[NAME=]FILE",
                   help="held-out text, one file per domain: end with a trust card of the output (powerinfer eval), "
                        "written to OUT's name with .card.md/.card.json")
    p.add_argument("--card-reference", metavar="GGUF",
                   help="the original model the card compares with (llama-cpp-python runs it; not INPUT by default: "
                        "llama.cpp would run a relufied GGUF with its original activation)")
    evaluate.add_arguments(p, prefix="card-")

    def card_base(out: str) -> str:
        return (out[: -len(".gguf")] if out.endswith(".gguf") else out) + ".card"

    def run(a):
        domains = evaluate.parse_domains(a.card) if a.card else None  # bad --card text fails before converting
        reference = a.card_reference
        if domains and a.card_batch != 1 and a.predictors:  # the card would refuse it after converting
            raise PipelineError("--card-batch: the card of a file with predictors scores predictor mode, "
                                "which takes --card-batch 1")
        if domains:
            evaluate.check_options(a.card_passages, a.card_n_tokens, a.card_n_gen, a.card_n_prompt, a.card_batch, [],
                                   prefix="card-")
        rep = convert(a.input, a.out, predictors=a.predictors, stats=a.stats, outtype=a.outtype,
                      activation=a.activation, tokenizer_pre=a.tokenizer_pre)
        print(json.dumps(rep, indent=1))
        if domains:
            card = evaluate.evaluate(a.out, domains, reference, n_passages=a.card_passages, n_tokens=a.card_n_tokens,
                                     n_gen=a.card_n_gen, n_prompt=a.card_n_prompt, batch=a.card_batch)
            md, js = evaluate.write_card(card, card_base(a.out))
            print(evaluate.render(card))
            print(f"card: {md}, {js}", file=sys.stderr)
        return 0

    def paths(a):
        written = files(a.out) + [f for c in (evaluate.card_files(card_base(a.out)) if a.card else ())
                                  for f in files(c)]
        # what convert reads of a Hugging Face directory (an earlier output beside it may be replaced)
        hf = ("config.json", "generation_config.json", "*.safetensors", "tokenizer.json", "tokenizer.model",
              "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")
        inputs = [("the input", a.input, files(a.input, *hf)),
                  ("--predictors", a.predictors, files(a.predictors, "model_*.pt", "config.json", "thresholds.json")),
                  ("--stats", a.stats, files(a.stats, "stats.gguf", "activation_*.pt", "activation/activation_*.pt"))]
        inputs += evaluate.card_inputs(a.card, a.card_reference, ("--card", "--card-reference"))
        return [("--out", a.out, written)], inputs

    return run_cli(run, argv, p, paths)


if __name__ == "__main__":
    sys.exit(main())
