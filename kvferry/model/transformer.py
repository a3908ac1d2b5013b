"""Model math for the llama family (llama, mistral, qwen2, qwen3) on plain PyTorch ops.

The model never touches KV storage, streams or events: it hands new K/V rows to the
cache and reads the cache back chunk by chunk (kv/cache.py). Attention is computed per chunk
(output normalized within the chunk, and its log-sum-exp) and the chunks are merged once
per layer by log-sum-exp, in the same order for every placement, so output bits do not
depend on where the cache lives. Eager PyTorch pays per launched op, so the hot path
keeps the op count low: fused q/k/v and gate/up projections, one RoPE call for q and k
together, and per unmasked chunk one fused attention kernel (flash attention from the
library) instead of a dozen small ops. On CUDA the elementwise steps around them run as
Triton kernels (model/fused_kernels.py): the residual add with the norm after it, RoPE and
SiLU(gate) * up, one kernel each; CPU, the CI oracle, keeps the eager ops.

In a split run `cfg` is this rank's share (model/shard.py) and `comm` the engine's
collectives: `comm.reduce` sums the partial outputs of attention and of the MLP over the
ranks (tensor split), `comm.start` / `comm.finish` take the hidden states from the previous
rank and pass them on, and share the logits (layer split).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvferry.kv.cache import Batch, KVCache, encode_kv, index_tensor
from kvferry.model.arch import ModelConfig
from kvferry.model.rope import Rope, apply_rope

if TYPE_CHECKING:
    from kvferry.model.decode_attention import DecodeAttention


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused kernel where the library has one: accumulates in float32 and rounds once
    # (the reference rounds the normalized value, then again after the weight)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def fused_kernels(device: torch.device):
    """The Triton kernels of model/fused_kernels.py on CUDA where Triton imports, else None
    (the eager ops then run: CPU keeps them exactly)."""
    if device.type != "cuda":
        return None
    try:
        return importlib.import_module("kvferry.model.fused_kernels")
    except ImportError:
        return None


def _fuse(weights: dict, cfg: ModelConfig) -> None:
    """Concatenate q/k/v (and their biases) and gate/up, one layer at a time, in place."""
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        weights[p + "wqkv"] = torch.cat([weights.pop(p + n) for n in ("wq", "wk", "wv")])
        if p + "bq" in weights:
            weights[p + "bqkv"] = torch.cat([weights.pop(p + n) for n in ("bq", "bk", "bv")])
        weights[p + "w_gu"] = torch.cat([weights.pop(p + "w_gate"), weights.pop(p + "w_up")])


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, flash_attn: bool = True, comm=None):
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        self.comm = comm  # None on one device
        self.reduce = comm.reduce if comm is not None else None
        if "layers.0.wqkv" not in weights:
            _fuse(weights, cfg)
        self.lm_head = weights.get("lm_head", weights["embed"])
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device, weights.get("rope_freqs"))
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.num_kv_local = cfg.num_kv_heads
        self.num_q_local = cfg.num_heads
        self.scale = cfg.head_dim ** -0.5
        self.kernels = fused_kernels(device)  # the fused elementwise kernels, or None: eager ops
        self.set_flash_attn(flash_attn)

    def set_flash_attn(self, on: bool) -> None:
        """Fused attention per chunk (-fa on) or plain matmuls (-fa off). Either way every
        KV placement computes the same ops on the same shapes, so output bits do not depend
        on placement; the two settings differ from each other in rounding only."""
        self.fused = fused_attention(self.device, self.dtype) if on else None
        # decode (one query token per sequence) reads the KV codes with the split-KV kernel
        # (decode_attention.py) on CUDA; CPU (the CI oracle) and prefill keep the chunk path
        d = self.cfg.head_dim
        self.decode_kernel = on and self.device.type == "cuda" and d >= 16 and not d & (d - 1)
        self._decoders: dict = {}

    def forward(self, tokens: torch.Tensor | list[int], batch: Batch, cache: KVCache) -> torch.Tensor:
        """tokens (N,) ids (a device tensor or a list) -> logits (B, vocab) float32 at each
        sequence's last new token. Eager: the engine replays CUDA graphs of the same ops for
        decode (engine/graphs.py)."""
        cfg, w = self.cfg, self.w
        if not isinstance(tokens, torch.Tensor):
            tokens = index_tensor(tokens, self.device)
        one = len(batch.seq_ids) == 1  # one sequence: positions are one run, no index tensors
        positions = slice(batch.starts[0], batch.ends[0]) if one else index_tensor(batch.positions(), self.device)
        cos, sin = self.rope.tables(positions, max(batch.ends) - 1, self.dtype)
        cache.begin(batch)  # the first deliveries go out before any compute is enqueued
        try:
            # (N, hidden); a layer split's later ranks take it from the rank before
            x = F.embedding(tokens, w["embed"]) if self.comm is None else self.comm.start(tokens, w["embed"])
            att = self.attention_pass(batch, cache)
            for i in range(cfg.num_layers):
                q, kq, vq = self.pre(i, x, cos, sin, cache.spec.kv_type)
                cache.write_codes(i, kq, vq)
                x = self.post(i, x, self.attend(i, q, att))
        finally:
            cache.end()
        last = slice(-1, None) if one else index_tensor([o - 1 for o in batch.offsets[1:]], self.device)
        return self.head(x[last]) if self.comm is None else self.comm.finish(x, last, self.head)

    # -- the parts of a layer that do not touch the cache (CUDA graphs capture these) -------
    def pre(self, layer: int, x, cos, sin, kv_type: str):
        """attention norm, q/k/v projection, RoPE, and the new rows' KV encoding ->
        q (N, Hq, D), K and V codes (N, Hkv, row_bytes)."""
        cfg, w, d = self.cfg, self.w, self.cfg.head_dim
        p = f"layers.{layer}."
        h = self._norm(x, w[p + "attn_norm"])
        n, hq, hkv = h.shape[0], self.num_q_local, self.num_kv_local
        qkv = F.linear(h, w[p + "wqkv"], w.get(p + "bqkv")).view(n, hq + 2 * hkv, d)
        v = qkv[:, hq + hkv:]  # (N, Hkv, D)
        if cfg.spec.qk_norm:  # per-head norms of q and k before RoPE: the eager norm of strided heads
            q = self._rope(rms_norm(qkv[:, :hq], w[p + "q_norm"], cfg.rms_eps), cos, sin)
            k = self._rope(rms_norm(qkv[:, hq:hq + hkv], w[p + "k_norm"], cfg.rms_eps), cos, sin)
        else:
            qk = self._rope(qkv[:, :hq + hkv], cos, sin)  # q and k in one pass
            q, k = qk[:, :hq], qk[:, hq:]
        return (q,) + encode_kv(k, v, kv_type)

    def post(self, layer: int, x, attn):
        """output projection, residual, MLP norm, MLP, residual."""
        p, k = f"layers.{layer}.", self.kernels
        a = F.linear(attn, self.w[p + "wo"])
        if self.reduce is not None:
            a = self.reduce(a)  # a tensor split's ranks add their heads' parts
        if k is None:
            x = x + a
            h = rms_norm(x, self.w[p + "ffn_norm"], self.cfg.rms_eps)
            gate, up = F.linear(h, self.w[p + "w_gu"]).chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            x, h = k.add_rms_norm(x, a, self.w[p + "ffn_norm"], self.cfg.rms_eps)
            act = k.silu_mul(F.linear(h, self.w[p + "w_gu"]))
        m = F.linear(act, self.w[p + "w_down"])
        # kept a separate add: the next layer's pre (or the head) takes the sum, which keeps
        # the pre/post segments of engine/graphs.py and the split's reduce as they are
        return x + (m if self.reduce is None else self.reduce(m))

    def head(self, x):
        return F.linear(self._norm(x, self.w["norm"]), self.lm_head).float()

    def _norm(self, x, w):
        """rms_norm of whole rows (hidden states): the fused kernel where there is one."""
        if self.kernels is None:
            return rms_norm(x, w, self.cfg.rms_eps)
        return self.kernels.rms_norm(x, w, self.cfg.rms_eps)

    def _rope(self, x, cos, sin):
        return apply_rope(x, cos, sin) if self.kernels is None else self.kernels.rope(x, cos, sin)

    # -- attention over the cache (eager: its shapes change every step) ----------------------
    def attention_pass(self, batch: Batch, cache: KVCache) -> "AttentionPass":
        """What every layer's attention of one pass shares, made once per pass: for a decode
        pass on the split-KV kernel, the kernel object for this shape and the batch's index
        tensors on the device."""
        if not (self.decode_kernel and batch.num_tokens == len(batch.seq_ids)):
            return AttentionPass(batch, cache)
        kernel = self.decode_attention(len(batch.seq_ids), cache.spec)
        return AttentionPass(batch, cache, kernel, *kernel.index_tensors(batch.seq_ids, batch.ends))

    def decode_attention(self, num_seqs: int, spec) -> "DecodeAttention":
        """The split-KV kernel for decode passes of num_seqs sequences over a cache of `spec`
        (made once per shape: it owns the partials buffers)."""
        cap = min(spec.chunk_rows, spec.ctx)
        key = (num_seqs, spec.kv_type, cap, spec.ctx)
        kernel = self._decoders.get(key)
        if kernel is None:
            from kvferry.model.decode_attention import DecodeAttention
            kernel = self._decoders[key] = DecodeAttention(
                num_seqs, self.num_kv_local, self.group, self.cfg.head_dim, spec.kv_type, cap,
                -(-spec.ctx // cap), self.dtype, self.device, scale=self.scale)
        return kernel

    def attend(self, layer: int, q, att: "AttentionPass", out: torch.Tensor | None = None):
        """q (N, Hq, D) -> attention output (N, Hq * D) over the cache's window, written into
        `out` where given (the decode kernel's merge writes there directly)."""
        if att.kernel is not None:
            return self._attend_decode(layer, q, att, out)
        batch, cache = att.batch, att.cache
        d, hkv, g = self.cfg.head_dim, self.num_kv_local, self.group
        # per sequence: queries as (Hkv, G*T, D), grouped under their kv head
        qs = []
        for o0, o1 in zip(batch.offsets[:-1], batch.offsets[1:]):
            t = o1 - o0
            if t == 1:  # one token: (Hq, D) is already (Hkv, G, D) in memory
                qs.append((q if o0 == 0 and o1 == q.shape[0] else q[o0]).view(hkv, g, d))
            else:
                qs.append(q[o0:o1].view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d))
        parts: list[list] = [[] for _ in qs]
        for chunk in cache.window(layer):
            for j, (kc, vc) in enumerate(zip(chunk.k, chunk.v)):
                if kc is not None:
                    parts[j].append(self._chunk_attention(qs[j], cache.dequant(kc), cache.dequant(vc), chunk.row0,
                                                          batch.starts[j], batch.counts[j]))
        outs = []
        for j, ps in enumerate(parts):
            t = batch.counts[j]
            o = _merge(ps)  # (Hkv, G*T, D)
            if o.dtype != self.dtype:
                o = o.to(self.dtype)
            outs.append(o.reshape(1, hkv * g * d) if t == 1 else
                        o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hkv * g * d))
        res = torch.cat(outs) if len(outs) > 1 else outs[0]
        return res if out is None else out.copy_(res)

    def _attend_decode(self, layer: int, q, att: "AttentionPass", out):
        """Decode: the split-KV kernel over the cache's code spans, then its merge -> (B, Hq * D).
        The split plan depends on shapes only, so every placement gets the same bits."""
        kernel, n = att.kernel, 0
        for span in att.cache.code_spans(layer):
            kernel.partials(q, span.k, span.v, att.seq_ids if span.by_seq else kernel.slot_index, att.ends,
                            chunk0=span.chunk0, num_chunks=span.num_chunks, row0=0)
            n = span.chunk0 + span.num_chunks
        return kernel.merge(n, att.ends, out)

    def _chunk_attention(self, q, k, v, row0, start, count):
        """q (Hkv, G*T, D); k, v (n, Hkv, D) rows [row0, row0+n). Returns the chunk's
        attention output, normalized within the chunk, (Hkv, G*T, D), and its log-sum-exp
        (Hkv, G*T) in float32, for the merge."""
        n = k.shape[0]
        if row0 + n - 1 > start:  # the chunk holds rows some query must not see: causal mask
            key_pos = torch.arange(row0, row0 + n, device=q.device)
            q_pos = start + torch.arange(count, device=q.device).repeat(q.shape[1] // count)
            return self._matmul_attention(q, k, v, key_pos[None, None, :] > q_pos[None, :, None])
        if self.fused is not None:  # every query sees every row: one fused kernel
            o, lse = self.fused(q.unsqueeze(0), k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0),
                                self.scale)
            return o[0], lse[0]
        return self._matmul_attention(q, k, v)

    def _matmul_attention(self, q, k, v, mask=None):
        """Plain-matmul attention of one chunk, with an optional causal mask (True = hidden)."""
        s = torch.matmul(q * self.scale, k.permute(1, 2, 0)).float()  # (Hkv, G*T, n)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        if mask is None:
            pw = s.sub_(m).exp_()
        else:  # a query may see no row of a later chunk (prefill): its weights stay zero
            pw = s.sub_(torch.where(torch.isinf(m), torch.zeros_like(m), m)).exp_()
        l = pw.sum(-1, keepdim=True)
        o = torch.matmul(pw.to(v.dtype), v.permute(1, 0, 2)).float()
        if mask is None:
            o = o / l
        else:  # ... and its output zero and log-sum-exp -inf, so the merge gives the chunk zero weight
            o = torch.where(l > 0, o / l.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(o))
        return o, (m + l.log()).squeeze(-1)


@dataclass
class AttentionPass:
    """One forward pass's attention state, shared by its layers (Transformer.attention_pass)."""
    batch: Batch
    cache: KVCache
    kernel: "DecodeAttention | None" = None  # the split-KV decode kernel, where it runs
    seq_ids: torch.Tensor | None = None  # (B,) int32 on the device, for the kernel
    ends: torch.Tensor | None = None


def fused_attention(device: torch.device, dtype: torch.dtype):
    """The library's fused attention kernel for one unmasked chunk, as
    f(q, k, v, scale) -> (out, logsumexp) with q (1, H, Lq, D), k/v (1, H, n, D), or None
    where there is none (the caller then uses plain matmuls). On CUDA this is the
    flash-attention kernel (split over keys for short query counts), on CPU its CPU port."""
    if device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return lambda q, k, v, scale: op(q, k, v, 0.0, False, scale=scale)[:2]
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(device) >= (8, 0)):
        op = torch.ops.aten._scaled_dot_product_flash_attention
        return lambda q, k, v, scale: op(q, k, v, 0.0, False, False, scale=scale)[:2]
    return None


def _merge(parts):
    """Log-sum-exp merge of chunk results, once per layer -> (Hkv, G*T, D)."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([p[1] for p in parts])  # (C, Hkv, G*T)
    o = torch.stack([p[0].float() for p in parts])  # (C, Hkv, G*T, D)
    # chunk 0 holds row 0, which every query sees, so the max is finite
    w = torch.exp(lse - lse.amax(0, keepdim=True))
    return (o * w.unsqueeze(-1)).sum(0) / w.sum(0).unsqueeze(-1)
