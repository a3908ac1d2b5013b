"""CUDA graphs for decode passes: the engine's, since graphs are about launching on a device,
not about the model's math (which stays plain eager PyTorch in model/transformer.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.kv.cache import Batch, KVCache
from kvferry.model.transformer import Transformer


class DecodeGraphs:
    """CUDA graphs for decode passes of N tokens (one per sequence): eager PyTorch spends
    more host time launching a layer's ~25 small kernels than the GPU spends running them,
    so the fixed-shape parts are captured once and replayed. Segment 0 is the embedding,
    the RoPE lookup and layer 0's `_pre`; segment i is layer i-1's `_post` and layer i's
    `_pre`; the last is the final `_post` and the head. Between segments, eager code does
    what changes shape every step: the cache write, the chunked attention over the window
    (and with it the transport's copies and events), writing its output into the next
    segment's static input. Every placement runs the same graphs, so output
    bits still do not depend on where the cache lives.

    The static K/V code outputs of a segment are overwritten when it is replayed in the
    next pass; the host cache's write-backs read them, so a host cache makes each pass
    wait for the previous pass's write-backs (transport/host_cache.py, begin)."""

    def __init__(self, model: Transformer, n: int, kv_type: str, max_pos: int):
        self.model, self.max_pos = model, max_pos
        dev, dt, L = model.device, model.dtype, model.cfg.num_layers
        model.rope.tables(slice(0, 1), max_pos, dt)  # grow the tables now: graphs hold their addresses
        self.inp = torch.zeros(2, n, dtype=torch.long, device=dev)  # token ids, positions
        self.attn_in = [torch.zeros(n, model.num_q_local * model.cfg.head_dim, dtype=dt, device=dev) for _ in range(L)]

        def seg0():
            cos, sin = model.rope.tables(self.inp[1], max_pos, dt)
            x = F.embedding(self.inp[0], model.w["embed"])
            return (cos, sin, x) + model.pre(0, x, cos, sin, kv_type)

        def seg(i):
            def f():
                cos, sin = self.outs[0][0], self.outs[0][1]
                x = model.post(i - 1, self.outs[i - 1][-4], self.attn_in[i - 1])
                if i == L:
                    return (model.head(x),)
                return (x,) + model.pre(i, x, cos, sin, kv_type)
            return f

        fns = [seg0] + [seg(i) for i in range(1, L + 1)]
        torch.cuda.synchronize(dev)
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):  # warm-up (lazy library init) outside capture
            self.outs = []
            for f in fns:
                self.outs.append(f())
        torch.cuda.synchronize(dev)
        pool = torch.cuda.graph_pool_handle()
        self.graphs, self.outs = [], []
        for f in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                out = f()
            self.graphs.append(g)
            self.outs.append(out)
        torch.cuda.synchronize(dev)

    def run(self, tokens, batch: Batch, cache: KVCache) -> torch.Tensor:
        model = self.model
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        self.inp.copy_(torch.tensor([ids, batch.positions()], dtype=torch.long).pin_memory(), non_blocking=True)
        cache.begin(batch)
        try:
            att = model.attention_pass(batch, cache)
            self.graphs[0].replay()
            for i in range(model.cfg.num_layers):
                q, kq, vq = self.outs[i][-3:]
                cache.write_codes(i, kq, vq, static=True)
                model.attend(i, q, att, out=self.attn_in[i])
                self.graphs[i + 1].replay()
        finally:
            cache.end()
        return self.outs[-1][0].clone()  # the static output is overwritten by the next pass
