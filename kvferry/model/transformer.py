"""Model math for the llama family (llama, mistral, qwen2, qwen3) on plain PyTorch ops.

The model never touches KV storage, streams or events: it hands new K/V rows to the
cache and reads the cache back chunk by chunk (kv/cache.py). Attention is computed per
chunk and merged with a log-sum-exp, in the same order for every placement, so output
bits do not depend on where the cache lives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.kv.cache import Batch, KVCache, index_tensor
from kvferry.model.arch import ModelConfig
from kvferry.model.rope import Rope, apply_rope


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, head_range: tuple[int, int] | None = None):
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        self.lm_head = weights.get("lm_head", weights["embed"])
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device, weights.get("rope_freqs"))
        self.group = cfg.num_heads // cfg.num_kv_heads
        # local heads of a tensor-parallel rank: kv heads [h0, h1)
        h0, h1 = head_range or (0, cfg.num_kv_heads)
        self.num_kv_local = h1 - h0
        self.scale = cfg.head_dim ** -0.5
        self.all_reduce = None  # set by the tensor-parallel wrapper

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """tokens (N,) on device -> logits (B, vocab) float32 at each sequence's last new token."""
        cfg, w = self.cfg, self.w
        positions = index_tensor(batch.positions(), self.device)
        cos, sin = self.rope.tables(positions, max(batch.ends) - 1, self.dtype)
        x = F.embedding(tokens, w["embed"])  # (N, hidden)
        cache.begin(batch)
        try:
            for i in range(cfg.num_layers):
                p = f"layers.{i}."
                h = rms_norm(x, w[p + "attn_norm"], cfg.rms_eps)
                x = x + self._attention(i, p, h, cos, sin, batch, cache)
                h = rms_norm(x, w[p + "ffn_norm"], cfg.rms_eps)
                x = x + self._mlp(p, h)
        finally:
            cache.end()
        last = index_tensor([o - 1 for o in batch.offsets[1:]], self.device)
        x = rms_norm(x[last], w["norm"], cfg.rms_eps)
        return F.linear(x, self.lm_head).float()

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        out = F.linear(F.silu(F.linear(h, w[p + "w_gate"])) * F.linear(h, w[p + "w_up"]), w[p + "w_down"])
        return self._reduce(out)

    def _reduce(self, x):
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x

    def _attention(self, layer, p, h, cos, sin, batch: Batch, cache: KVCache) -> torch.Tensor:
        cfg, w, d = self.cfg, self.w, self.cfg.head_dim
        n = h.shape[0]
        q = F.linear(h, w[p + "wq"], w.get(p + "bq")).view(n, -1, d)  # (N, Hq_local, D)
        k = F.linear(h, w[p + "wk"], w.get(p + "bk")).view(n, -1, d)  # (N, Hkv_local, D)
        v = F.linear(h, w[p + "wv"], w.get(p + "bv")).view(n, -1, d)
        if cfg.spec.qk_norm:
            q = rms_norm(q, w[p + "q_norm"], cfg.rms_eps)
            k = rms_norm(k, w[p + "k_norm"], cfg.rms_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, k, v)

        hkv, g = self.num_kv_local, self.group
        # per sequence: queries as (Hkv, G*T, D), grouped under their kv head
        qs = []
        for j, (o0, o1) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:])):
            t = o1 - o0
            qs.append(q[o0:o1].view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d))
        state: list = [None] * len(qs)
        for chunk in cache.window(layer):
            for j, (kc, vc) in enumerate(zip(chunk.k, chunk.v)):
                if kc is None:
                    continue
                part = self._chunk_attention(qs[j], cache.dequant(kc), cache.dequant(vc), chunk.row0,
                                             batch.starts[j], batch.counts[j])
                state[j] = part if state[j] is None else _merge(state[j], part)
        outs = []
        for j, (m, l, o) in enumerate(state):
            t = batch.counts[j]
            o = (o / l[..., None]).to(self.dtype)  # (Hkv, G*T, D)
            outs.append(o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hkv * g * d))
        attn = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self._reduce(F.linear(attn, w[p + "wo"]))

    def _chunk_attention(self, q, k, v, row0, start, count):
        """q (Hkv, G*T, D); k, v (n, Hkv, D) rows [row0, row0+n). Returns the chunk's
        (max, sum, weighted values) in float32: (Hkv, G*T), (Hkv, G*T), (Hkv, G*T, D)."""
        n = k.shape[0]
        s = torch.matmul(q, k.permute(1, 2, 0)).float() * self.scale  # (Hkv, G*T, n)
        if row0 + n > start:  # chunk holds rows written this pass: causal mask
            key_pos = torch.arange(row0, row0 + n, device=q.device)
            q_pos = start + torch.arange(count, device=q.device).repeat(q.shape[1] // count)
            s = s.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        m = s.amax(-1)
        # a query may see no row of a later chunk (prefill): keep its weights at zero
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        pw = torch.exp(s - m_safe[..., None])
        o = torch.matmul(pw.to(v.dtype), v.permute(1, 0, 2)).float()  # (Hkv, G*T, D)
        return m, pw.sum(-1), o


def _merge(a, b):
    (ma, la, oa), (mb, lb, ob) = a, b
    m = torch.maximum(ma, mb)  # ma is finite: chunk 0 holds row 0, seen by every query
    ca, cb = torch.exp(ma - m), torch.exp(mb - m)
    return m, la * ca + lb * cb, oa * ca[..., None] + ob * cb[..., None]
