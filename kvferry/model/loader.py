"""Weight loading: GGUF (through the `gguf` package) and Hugging Face safetensors
directories, plus random weights of a preset shape for speed runs.

Each tensor is read (memory-mapped), dequantized to the compute dtype and handed to the
caller's upload function (the engine's, which places it on the device) before the next one
is touched, so the host never holds a second full copy of the
model. In a split run each tensor is cut to the rank's share (model/shard.py) before the
upload, and tensors of other ranks' layers are not read. Internal names: embed, norm, lm_head, rope_freqs, layers.{i}.{attn_norm, wq, wk,
wv, bq, bk, bv, wo, q_norm, k_norm, ffn_norm, w_gate, w_up, w_down}.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from kvferry import KvferryError
from kvferry.model.arch import ModelConfig, arch_spec, load_hf_config
from kvferry.model.shard import Shard

log = logging.getLogger(__name__)

GGUF_NAMES = {
    "token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head",
    "rope_freqs.weight": "rope_freqs",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_output.weight": "wo", "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
HF_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}
GGUF_SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                  "Q4_K", "Q5_K", "Q6_K")


Upload = Callable[[torch.Tensor], torch.Tensor] | None  # host tensor -> the same on the device
ShardFor = Callable[[ModelConfig], Shard] | None  # the model's shape -> this rank's share of it


@dataclass
class LoadedModel:
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    source: str  # path
    file_bytes: int
    gguf_reader: object = None  # kept for tokenizer metadata (GGUF only)
    shard: Shard | None = None  # this rank's share in a split run (cfg stays the whole model's shape)


def _map_name(name: str, top: dict, per_layer: dict, layer_re: str) -> str | None:
    if name in top:
        return top[name]
    m = re.fullmatch(layer_re, name)
    if m and m.group(2) in per_layer:
        return f"layers.{m.group(1)}.{per_layer[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # undo llama.cpp's row permutation of q/k (interleaved-pair RoPE -> half split)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=None)


# ---------------------------------------------------------------------------- GGUF
def open_gguf(path: str):
    import gguf
    if not os.path.isfile(path):
        raise KvferryError(f"model file not found: {path}")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise KvferryError(f"cannot open {path}: {e.strerror or e}") from None
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises many types on a bad file
        raise KvferryError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                           f"{type(e).__name__}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader, path: str) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if not arch:
        raise KvferryError(f"{path}: GGUF metadata lacks 'general.architecture'")
    try:
        arch_spec(arch)
    except KvferryError as e:
        raise KvferryError(f"{path}: {e}") from None

    def get(key, default=None):
        v = gguf_field(reader, f"{arch}.{key}", default)
        if v is None:
            raise KvferryError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        kv_heads = kv_heads[0]
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens") or [])
    if not vocab:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise KvferryError(f"{path}: the file has neither a vocabulary nor a token_embd.weight tensor")
        vocab = int(embd.shape.tolist()[-1])  # GGUF lists dims innermost first
    scaling = None
    stype = gguf_field(reader, f"{arch}.rope.scaling.type")
    if stype and stype not in ("none",) and "rope_freqs.weight" not in names:
        scaling = {"rope_type": stype, "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": int(gguf_field(
                       reader, f"{arch}.rope.scaling.original_context_length", 4096))}
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden, num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(kv_heads), head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling, max_position=int(get("context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        name=str(gguf_field(reader, "general.name", os.path.basename(path))),
    )


def _gguf_tensors(reader, cfg: ModelConfig, path: str = "model") -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    import gguf
    for t in reader.tensors:
        name = _map_name(t.name, GGUF_NAMES, GGUF_LAYER_NAMES, r"blk\.(\d+)\.(.+)")
        if name is None:
            log.debug("skipping tensor %s", t.name)
            continue
        qtype = t.tensor_type.name
        if qtype not in GGUF_SUPPORTED:
            raise KvferryError(f"{path}: tensor {t.name} has quant type {qtype}, which kvferry does not load "
                               f"(supported: {', '.join(GGUF_SUPPORTED)})")

        def read(t=t, name=name):
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
            try:
                if t.tensor_type.name in ("F32", "F16"):
                    arr = np.array(t.data)  # a writable copy of this one tensor (the memmap is read-only)
                else:
                    arr = gguf.quants.dequantize(t.data, t.tensor_type)
                arr = np.ascontiguousarray(arr).reshape(shape)
            except (ValueError, IndexError, TypeError, OSError, AssertionError) as e:
                # a short memmap (file cut off) or bytes that do not decode
                raise KvferryError(f"{path}: cannot read tensor {t.name} ({t.tensor_type.name}, shape {list(shape)}); "
                                   f"the file is truncated or corrupt: {type(e).__name__}: {_one_line(e)}") from None
            w = torch.from_numpy(arr)
            if cfg.spec.gguf_permuted_qk and name.endswith((".wq", ".wk", ".bq", ".bk")):
                heads = cfg.num_heads if name.endswith(("wq", "bq")) else cfg.num_kv_heads
                w = _unpermute(w, heads)
            return w
        yield name, read


def load_gguf(path: str, dtype, upload: Upload = None, progress=True, shard_for: ShardFor = None) -> LoadedModel:
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    shard = shard_for(cfg) if shard_for else None  # a share that cannot be met fails before any weight is read
    # listing the tensors first rejects an unsupported type before any weight is read
    weights = _materialize(list(_gguf_tensors(reader, cfg, path)), cfg, dtype, upload,
                           "load " + os.path.basename(path), progress, shard)
    return LoadedModel(cfg, weights, path, os.path.getsize(path), reader, shard)


# ---------------------------------------------------------------------------- safetensors
def load_hf_dir(path: str, dtype, upload: Upload = None, progress=True, shard_for: ShardFor = None) -> LoadedModel:
    from safetensors import safe_open
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise KvferryError(f"{path} has no config.json (expected a Hugging Face model directory or a .gguf file)")
    cfg = load_hf_config(cfg_path)
    shard = shard_for(cfg) if shard_for else None
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise KvferryError(f"{path} has no *.safetensors files")
    items, size = [], 0
    for fn in files:
        full = os.path.join(path, fn)
        size += os.path.getsize(full)
        try:
            handle = safe_open(full, framework="pt")
        except Exception as e:
            raise KvferryError(f"{full} is not a readable safetensors file: {e}") from None
        for key in handle.keys():
            name = _map_name(key, HF_NAMES, HF_LAYER_NAMES, r"model\.layers\.(\d+)\.(.+)")
            if name is not None:
                items.append((name, lambda h=handle, k=key: h.get_tensor(k)))
    weights = _materialize(items, cfg, dtype, upload, "load " + os.path.basename(path.rstrip("/")), progress, shard)
    return LoadedModel(cfg, weights, path, size, shard=shard)


def _materialize(items, cfg: ModelConfig, dtype, upload: Upload, desc, progress,
                 shard: Shard | None = None) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    bar = _progress(len(items), desc) if progress else None
    for name, read in items:
        local = shard.local_name(name) if shard else name
        if local is not None:  # another rank's layer is never read
            w = read()
            if shard:
                w = shard.take(name, w, cfg)  # dequantized whole, cut to the share before the upload
            keep_f32 = name == "rope_freqs"
            w = w.to(torch.float32 if keep_f32 else dtype).contiguous()
            weights[local] = upload(w) if upload is not None else w
            del w
        if bar:
            bar.update()
    if bar:
        bar.close()
    _check_complete(weights, shard.local_config(cfg) if shard else cfg)
    return weights


def _check_complete(weights, cfg: ModelConfig):
    need = ["embed", "norm"]
    per = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if cfg.spec.qk_norm:
        per += ["q_norm", "k_norm"]
    need += [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in per]
    missing = [n for n in need if n not in weights]
    if missing:
        raise KvferryError(f"model is missing {len(missing)} tensors, e.g. {missing[:3]}")


# ---------------------------------------------------------------------------- random
def random_weights(cfg: ModelConfig, device, dtype, seed=0, progress=True, shard: Shard | None = None) -> LoadedModel:
    """Random weights of a real shape, made on the device (speed runs only). A split run
    draws every tensor whole, in the same order, and keeps its share: the same weights as
    one device, and one whole tensor at a time on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (h,), p + "wq": (cfg.num_heads * d, h), p + "wk": (cfg.num_kv_heads * d, h),
                       p + "wv": (cfg.num_kv_heads * d, h), p + "wo": (h, cfg.num_heads * d),
                       p + "ffn_norm": (h,), p + "w_gate": (f, h), p + "w_up": (f, h), p + "w_down": (h, f)})
        if cfg.spec.qkv_bias:
            shapes.update({p + "bq": (cfg.num_heads * d,), p + "bk": (cfg.num_kv_heads * d,), p + "bv": (cfg.num_kv_heads * d,)})
        if cfg.spec.qk_norm:
            shapes.update({p + "q_norm": (d,), p + "k_norm": (d,)})
    weights = {}
    bar = _progress(len(shapes), "random weights") if progress else None
    for name, shape in shapes.items():
        if len(shape) == 1 and not name.split(".")[-1].startswith("b"):
            w = torch.ones(shape, device=device, dtype=dtype)
        else:
            std = 0.02 if len(shape) == 2 else 0.01
            w = (torch.randn(shape, device=device, generator=g, dtype=torch.float32) * std).to(dtype)
        local = shard.local_name(name) if shard else name
        if local is not None:
            weights[local] = shard.take(name, w, cfg) if shard else w
        del w
        if bar:
            bar.update()
    if bar:
        bar.close()
    return LoadedModel(cfg, weights, "random", sum(w.numel() * w.element_size() for w in weights.values()),
                       shard=shard)


def load_model(path: str, dtype, upload: Upload = None, progress=True, shard_for: ShardFor = None) -> LoadedModel:
    """Load a .gguf file or a Hugging Face directory; `upload` places each host tensor (already
    in its dtype) where the model runs (None: it stays in host memory)."""
    if os.path.isdir(path):
        return load_hf_dir(path, dtype, upload, progress, shard_for)
    if not os.path.exists(path):
        raise KvferryError(f"model file not found: {path}")
    if not path.endswith(".gguf"):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise KvferryError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    return load_gguf(path, dtype, upload, progress, shard_for)
