"""CUDA graphs for decode passes: the engine's, since graphs are about launching on a device,
not about the model's math (which stays plain eager PyTorch in model/transformer.py)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kvferry.kv.cache import Batch, DeviceKVCache, KVCache
from kvferry.model.transformer import AttentionPass, Transformer


def _capture(fns, dev, outs: list) -> list:
    """One CUDA graph per function, sharing one memory pool -> the graphs; each one's output
    is appended to `outs` as soon as it is captured, because a later function may read an
    earlier one's output through that list (and must read the captured buffer, not a
    warm-up tensor that is freed afterwards). The caller has run each function once outside
    capture (library and kernel initialization)."""
    torch.cuda.synchronize(dev)
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            outs.append(f())
        graphs.append(g)
    torch.cuda.synchronize(dev)
    return graphs


def _put_inputs(inp: torch.Tensor, tokens, *rows) -> None:
    """Copy a pass's host values (the token ids, then `rows`) into a graph's static input."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    inp.copy_(torch.tensor([ids, *rows], dtype=torch.long).pin_memory(), non_blocking=True)


class DecodeGraphs:
    """CUDA graphs for decode passes of N tokens (one per sequence): eager PyTorch spends
    more host time launching a layer's ~25 small kernels than the GPU spends running them,
    so the fixed-shape parts are captured once and replayed. Segment 0 is the embedding,
    the RoPE lookup and layer 0's `_pre`; segment i is layer i-1's `_post` and layer i's
    `_pre`; the last is the final `_post` and the head. Between segments, eager code does
    what changes shape every step: the cache write, the chunked attention over the window
    (and with it the transport's copies and events), writing its output into the next
    segment's static input. Every host placement runs the same graphs, and a device-resident
    cache's whole-pass graph (ResidentDecodeGraph) makes the same launches, so output bits
    still do not depend on where the cache lives.

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
        torch.cuda.synchronize(dev)  # the side stream below does not wait for the current one
        with torch.cuda.stream(torch.cuda.Stream(dev)):  # warm-up (lazy library init) outside capture
            self.outs = []
            for f in fns:
                self.outs.append(f())
        self.outs = []  # the segments read each other's captured outputs from here
        self.graphs = _capture(fns, dev, self.outs)

    def run(self, tokens, batch: Batch, cache: KVCache) -> torch.Tensor:
        model = self.model
        _put_inputs(self.inp, tokens, batch.positions())
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


class ResidentDecodeGraph:
    """One CUDA graph for a whole decode pass of N sequences over a device-resident cache with
    the split-KV kernel: the cache write (rows given as device tensors), each layer's
    attention launched over the whole context (the kernel skips the splits past each
    sequence's rows; the merge stops at each sequence's last split) and everything between.
    Nothing in it depends on a host value, so no host work or launch gap is left between
    the layers: at 4k context the segmented graphs spent a third of the step enqueueing.
    The launches and their values are those of the eager pass, so the bits are the same as
    the segmented graphs' and every host placement's.

    It holds the cache's tensors: `run` takes only the cache it was captured for
    (`cache_ref`, weak, so a dropped cache is freed and the runner captures again)."""

    def __init__(self, model: Transformer, n: int, cache: DeviceKVCache, max_pos: int):
        self.max_pos = max_pos
        self.cache_ref = weakref.ref(cache)
        dev, dt, kv_type = model.device, model.dtype, cache.spec.kv_type
        model.rope.tables(slice(0, 1), max_pos, dt)  # grow the tables now: the graph holds their addresses
        self.kernel = model.decode_attention(n, cache.spec)  # held: the graph uses its buffers
        self.inp = torch.zeros(3, n, dtype=torch.long, device=dev)  # token ids, positions, sequence ids

        def step():
            ids, pos, seq = self.inp
            att = AttentionPass(None, cache, self.kernel, seq.to(torch.int32), (pos + 1).to(torch.int32))
            cos, sin = model.rope.tables(pos, max_pos, dt)
            x = F.embedding(ids, model.w["embed"])
            for i in range(model.cfg.num_layers):
                q, kq, vq = model.pre(i, x, cos, sin, kv_type)
                cache.write_at(i, seq, pos, kq, vq)
                x = model.post(i, x, model.attend(i, q, att))
            return model.head(x)

        # the warm-up writes row 0 of sequence 0 in every layer: put it back afterwards
        saved = [(k[0, 0].clone(), v[0, 0].clone()) for k, v in zip(cache.k, cache.v)]
        torch.cuda.synchronize(dev)  # the side stream below does not wait for the current one
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            step()
        torch.cuda.synchronize(dev)
        for (k0, v0), k, v in zip(saved, cache.k, cache.v):
            k[0, 0], v[0, 0] = k0, v0
        outs = []
        self.graph, self.logits = _capture([step], dev, outs)[0], outs[0]

    def run(self, tokens, batch: Batch, cache: DeviceKVCache) -> torch.Tensor:
        if self.cache_ref() is not cache:
            raise ValueError("this decode graph was captured for another cache")
        _put_inputs(self.inp, tokens, batch.positions(), batch.seq_ids)
        cache.begin(batch)
        try:
            self.graph.replay()
        finally:
            cache.end()
        return self.logits.clone()  # the static output is overwritten by the next pass
