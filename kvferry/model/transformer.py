"""Model math for the llama family (llama, mistral, qwen2, qwen3) on plain PyTorch ops.

The model never touches KV storage, streams or events: it hands new K/V rows to the
cache and reads the cache back chunk by chunk (kv/cache.py). Attention is computed per
chunk (max, sum of weights, weighted values) and the chunks are merged once per layer
with a log-sum-exp, in the same order for every placement, so output bits do not depend
on where the cache lives. Eager PyTorch pays per launched op, so the hot path keeps the
op count low: fused q/k/v and gate/up projections, one RoPE call for q and k together,
and per chunk only the ops that must see the chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.kv.cache import Batch, KVCache, index_tensor
from kvferry.model.arch import ModelConfig
from kvferry.model.rope import Rope, apply_rope


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # normalize in float32, scale in the compute dtype (as the reference implementations do)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


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
                 dtype: torch.dtype):
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        if "layers.0.wqkv" not in weights:
            _fuse(weights, cfg)
        self.lm_head = weights.get("lm_head", weights["embed"])
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device, weights.get("rope_freqs"))
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.num_kv_local = cfg.num_kv_heads
        self.num_q_local = cfg.num_heads
        self.scale = cfg.head_dim ** -0.5

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
        gate, up = F.linear(h, self.w[p + "w_gu"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w[p + "w_down"])

    def _attention(self, layer, p, h, cos, sin, batch: Batch, cache: KVCache) -> torch.Tensor:
        cfg, w, d = self.cfg, self.w, self.cfg.head_dim
        n, hq, hkv, g = h.shape[0], self.num_q_local, self.num_kv_local, self.group
        qkv = F.linear(h, w[p + "wqkv"], w.get(p + "bqkv")).view(n, hq + 2 * hkv, d)
        v = qkv[:, hq + hkv:]  # (N, Hkv, D)
        if cfg.spec.qk_norm:
            q = apply_rope(rms_norm(qkv[:, :hq], w[p + "q_norm"], cfg.rms_eps), cos, sin)
            k = apply_rope(rms_norm(qkv[:, hq:hq + hkv], w[p + "k_norm"], cfg.rms_eps), cos, sin)
        else:
            qk = apply_rope(qkv[:, :hq + hkv], cos, sin)  # q and k in one pass
            q, k = qk[:, :hq], qk[:, hq:]
        cache.write(layer, k, v)

        # per sequence: scaled queries as (Hkv, G*T, D), grouped under their kv head
        q = q * self.scale
        qs = []
        for o0, o1 in zip(batch.offsets[:-1], batch.offsets[1:]):
            t = o1 - o0
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
            o = _merge(ps).to(self.dtype)  # (Hkv, G*T, D)
            outs.append(o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hkv * g * d))
        attn = torch.cat(outs) if len(outs) > 1 else outs[0]
        return F.linear(attn, w[p + "wo"])

    def _chunk_attention(self, q, k, v, row0, start, count):
        """q (Hkv, G*T, D) pre-scaled; k, v (n, Hkv, D) rows [row0, row0+n). Returns the
        chunk's (row max, sum of weights, weighted values) in float32:
        (Hkv, G*T, 1), (Hkv, G*T, 1), (Hkv, G*T, D)."""
        n = k.shape[0]
        s = torch.matmul(q, k.permute(1, 2, 0)).float()  # (Hkv, G*T, n)
        if row0 + n > start:  # the chunk holds rows written this pass: causal mask
            key_pos = torch.arange(row0, row0 + n, device=q.device)
            q_pos = start + torch.arange(count, device=q.device).repeat(q.shape[1] // count)
            s = s.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            m = s.amax(-1, keepdim=True)
            # a query may see no row of a later chunk (prefill): its weights stay zero, and
            # its max stays -inf so the merge gives the chunk zero weight
            pw = s.sub_(torch.where(torch.isinf(m), torch.zeros_like(m), m)).exp_()
        else:
            m = s.amax(-1, keepdim=True)
            pw = s.sub_(m).exp_()
        o = torch.matmul(pw.to(v.dtype), v.permute(1, 0, 2))  # (Hkv, G*T, D)
        return m, pw.sum(-1, keepdim=True), o


def _merge(parts):
    """Log-sum-exp merge of chunk partials, once per layer -> (Hkv, G*T, D) float32."""
    if len(parts) == 1:
        m, l, o = parts[0]
        return o.float() / l
    m = torch.stack([p[0] for p in parts])  # (C, Hkv, G*T, 1)
    l = torch.stack([p[1] for p in parts])
    o = torch.stack([p[2] for p in parts]).float()
    # chunk 0 holds row 0, which every query sees, so the max is finite
    w = torch.exp(m - m.amax(0, keepdim=True))
    return (o * w).sum(0) / (l * w).sum(0)
