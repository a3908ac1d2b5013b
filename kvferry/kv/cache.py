"""The narrow interface between model math and KV storage, and the device-resident store.

The model calls, per forward pass: `begin(batch)`, then per layer `write_codes(layer, kq, vq)`
(append this pass's new rows, encoded by `encode_kv`) and `window(layer)` (iterate the layer's rows chunk by
chunk; or `code_spans(layer)`, the same chunks as whole code tensors for a decode kernel), then
`end()`. Every placement yields the same chunks (same rows, same shapes,
same bytes), and the model computes attention chunk by chunk with a log-sum-exp merge,
so where the cache lives cannot change output bits.

Layout, per layer, for K and for V: uint8 (num_seqs, ctx, H_local, row_bytes). A
sequence's rows are contiguous, so any row range of one sequence is one contiguous copy;
heads are a dimension, so a tensor-parallel rank holds only its heads.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from kvferry import KvferryError
from kvferry.kv import quant


# Up to this many sequences in a pass, new rows are written with one slice copy per
# sequence; beyond it, with one indexed write for the whole batch (fewer launches).
SLICE_COPY_MAX_SEQS = 2


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor on `device` without a host sync: a plain .to("cuda") from
    pageable memory synchronizes the stream, which would stall the pipelined transport."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def encode_kv(k: torch.Tensor, v: torch.Tensor, kv_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """New K/V rows (N, H, D) in the compute dtype -> their cache codes (N, H, row_bytes),
    on the device that computed them (the encoding itself lives in quant.py). q8_0 and q4_0
    on CUDA go through one Triton launch for both (quant_kernels.py, the same bits)."""
    if k.is_cuda and kv_type in ("q8_0", "q4_0"):
        return importlib.import_module("kvferry.kv.quant_kernels").encode(k, v, kv_type)
    return quant.quantize(k, kv_type), quant.quantize(v, kv_type)


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_seqs: int
    ctx: int  # rows per sequence
    num_kv_heads: int  # local heads (a TP rank's share)
    head_dim: int
    kv_type: str
    chunk_rows: int

    def __post_init__(self):
        quant.check_kv_type(self.kv_type, self.head_dim)

    @property
    def row_bytes(self) -> int:
        return quant.row_bytes(self.kv_type, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """K + V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.row_bytes

    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_seqs, self.ctx, self.num_kv_heads, self.row_bytes)

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_seqs * self.ctx * self.token_bytes


@dataclass
class Batch:
    """Sequences in one forward pass; their new tokens are concatenated in this order."""
    seq_ids: list[int]
    starts: list[int]  # position of each sequence's first new token
    counts: list[int]  # new tokens per sequence
    offsets: list[int] = field(init=False)

    def __post_init__(self):
        self.offsets = [0]
        for c in self.counts:
            self.offsets.append(self.offsets[-1] + c)

    @property
    def ends(self) -> list[int]:
        return [s + c for s, c in zip(self.starts, self.counts)]

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def positions(self) -> list[int]:
        return [p for s, c in zip(self.starts, self.counts) for p in range(s, s + c)]

    def num_chunks(self, chunk_rows: int) -> int:
        return max(-(-e // chunk_rows) for e in self.ends)


@dataclass
class Chunk:
    """Rows [row0, row0 + n_j) of the current layer for each batch entry j (None if the
    sequence has no rows in this chunk). `k[j]`, `v[j]` are uint8 (n_j, H, row_bytes)."""
    index: int
    row0: int
    k: list[torch.Tensor | None]
    v: list[torch.Tensor | None]


@dataclass
class CodeSpan:
    """Chunks chunk0 .. chunk0 + num_chunks - 1 of a layer as whole code tensors, for a kernel
    that reads the codes itself: k, v uint8 (S, R, H, row_bytes), chunk chunk0 + j of batch
    entry b starting at row j * chunk_rows of entry `seq_index[b]`, where seq_index is the
    batch's sequence ids (`by_seq`, the device cache's layer tensors) or its batch indices
    (a ring slot, which holds one chunk of every batch entry)."""
    chunk0: int
    num_chunks: int
    k: torch.Tensor
    v: torch.Tensor
    by_seq: bool


# -- rows of a pass in a store: shared by the device cache, the ring's slots and the resident chunks
def plan_writes(batch: Batch, lo: int, hi: int, by_seq: bool, device: torch.device):
    """Where this pass's new rows that fall in sequence rows [lo, hi) land, for `write_rows`:
    per batch entry with any, (d, a, b, o): rows [a, b) (counted from lo) of entry d of the
    store (its sequence id where `by_seq`, else its batch index) take rows [o, o + b - a) of
    the pass. Over SLICE_COPY_MAX_SEQS entries, three index tensors (d, row, src) for one
    indexed write instead (src None where every row of the pass lands, in order). None where
    no row falls in [lo, hi)."""
    ranges = []
    for j, (s, start, end, o) in enumerate(zip(batch.seq_ids, batch.starts, batch.ends, batch.offsets)):
        a, b = max(start, lo), min(end, hi)
        if a < b:
            ranges.append((s if by_seq else j, a - lo, b - lo, o + a - start))
    if len(ranges) <= SLICE_COPY_MAX_SEQS:
        return ranges or None
    dst = [d for d, a, b, o in ranges for _ in range(b - a)]
    row = [r for d, a, b, o in ranges for r in range(a, b)]
    src = None if len(row) == batch.num_tokens else index_tensor([o + r for d, a, b, o in ranges for r in range(b - a)],
                                                                  device)
    return index_tensor(dst, device), index_tensor(row, device), src


def write_rows(k: torch.Tensor, v: torch.Tensor, writes, kq: torch.Tensor, vq: torch.Tensor) -> int:
    """Write a `plan_writes` plan: k, v the store (entries, rows, H, row_bytes), kq, vq the
    pass's new rows (N, H, row_bytes). Returns the rows written."""
    if writes is None:
        return 0
    if isinstance(writes, tuple):  # one indexed write for the whole batch
        d, r, src = writes
        k[d, r] = kq if src is None else kq[src]
        v[d, r] = vq if src is None else vq[src]
        return int(r.numel())
    for d, a, b, o in writes:  # a plain slice copy per sequence: fewer launches
        whole = o == 0 and b - a == kq.shape[0]  # all of the pass's rows: no source slice
        k[d, a:b].copy_(kq if whole else kq[o:o + b - a])
        v[d, a:b].copy_(vq if whole else vq[o:o + b - a])
    return sum(b - a for d, a, b, o in writes)


def chunk_view(k: torch.Tensor, v: torch.Tensor, keys, ends: list[int], i: int, chunk_rows: int,
               row0: int = 0) -> Chunk:
    """Chunk i of the batch: entry j's rows of it (up to its end) from store entry keys[j],
    whose row 0 is sequence row `row0` (0 for a whole sequence, i * chunk_rows for a slot)."""
    ks, vs = [], []
    for key, end in zip(keys, ends):
        n = min(chunk_rows, end - i * chunk_rows)
        r0 = i * chunk_rows - row0
        ks.append(k[key, r0:r0 + n] if n > 0 else None)
        vs.append(v[key, r0:r0 + n] if n > 0 else None)
    return Chunk(i, i * chunk_rows, ks, vs)


class KVCache:
    """Base: tracks the batch and the rows per sequence. Subclasses own storage."""

    def __init__(self, spec: KVSpec, device: torch.device, dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.batch: Batch | None = None
        self.seq_lens = [0] * spec.num_seqs  # rows committed per sequence

    # -- the model-facing interface --------------------------------------------------
    def begin(self, batch: Batch) -> None:
        for s, start, end in zip(batch.seq_ids, batch.starts, batch.ends):
            if not 0 <= s < self.spec.num_seqs:
                raise KvferryError(f"sequence id {s} is outside the cache's {self.spec.num_seqs} sequences")
            if end > self.spec.ctx:
                raise KvferryError(f"sequence {s} needs {end} positions but the context is {self.spec.ctx} (raise -c)")
            if start > self.seq_lens[s]:
                raise KvferryError(f"sequence {s} has {self.seq_lens[s]} rows; cannot start at {start}")
        self.batch = batch

    def write_codes(self, layer: int, kq: torch.Tensor, vq: torch.Tensor, static: bool = False) -> None:
        """Append this pass's new rows, already encoded by `encode_kv`. `static`: kq/vq are
        buffers that outlive the pass (CUDA graph outputs), so copies need not keep them."""
        self._store(layer, kq, vq, static)

    def window(self, layer: int) -> Iterator[Chunk]:
        raise NotImplementedError

    def code_spans(self, layer: int) -> Iterator[CodeSpan]:
        """The same rows as `window`, as whole code tensors (decode kernels; see CodeSpan)."""
        raise NotImplementedError

    def end(self) -> None:
        for s, e in zip(self.batch.seq_ids, self.batch.ends):
            self.seq_lens[s] = e
        self.batch = None

    def dequant(self, codes: torch.Tensor) -> torch.Tensor:
        return quant.dequantize(codes, self.spec.kv_type, self.spec.head_dim, self.dtype)

    def reset(self, seq_id: int) -> None:
        """Forget a sequence's rows; its cells are reused by the next prompt."""
        self.seq_lens[seq_id] = 0

    def truncate(self, seq_id: int, n: int) -> None:
        self.seq_lens[seq_id] = min(self.seq_lens[seq_id], n)

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    # -- storage hooks -----------------------------------------------------------------
    def _store(self, layer: int, kq: torch.Tensor, vq: torch.Tensor, static: bool = False) -> None:
        raise NotImplementedError


class DeviceKVCache(KVCache):
    """The baseline: every layer's K/V resident in device memory."""

    def __init__(self, spec: KVSpec, device, dtype):
        super().__init__(spec, device, dtype)
        shape = spec.layer_shape()
        try:
            self.k = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(spec.num_layers)]
            self.v = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(spec.num_layers)]
        except torch.OutOfMemoryError:
            raise KvferryError(
                f"the KV cache ({spec.total_bytes / 2**30:.2f} GiB) does not fit in device memory: "
                "lower -c/-np, use a smaller --kv-type, or keep it in host memory with -nkvo") from None

    def begin(self, batch):
        super().begin(batch)
        self._writes = None  # planned at the first write: a pass replayed as one CUDA graph has none

    def _store(self, layer, kq, vq, static=False):
        if self._writes is None:
            self._writes = plan_writes(self.batch, 0, self.spec.ctx, True, self.device)  # every new row lands
        write_rows(self.k[layer], self.v[layer], self._writes, kq, vq)

    def write_at(self, layer: int, seq_index: torch.Tensor, rows: torch.Tensor, kq, vq) -> None:
        """Row rows[j] of sequence seq_index[j] takes new row j (int64 device tensors): the
        same bytes as write_codes for a decode pass, with no host values, so a CUDA graph
        can hold it."""
        write_rows(self.k[layer], self.v[layer], (seq_index, rows, None), kq, vq)

    def window(self, layer):
        b, c = self.batch, self.spec.chunk_rows
        for i in range(b.num_chunks(c)):
            yield chunk_view(self.k[layer], self.v[layer], b.seq_ids, b.ends, i, c)

    def code_spans(self, layer):
        # every chunk of the layer lives in one tensor: one span, one kernel launch. It spans
        # the whole context, whatever the pass's rows (the kernel skips the splits past each
        # sequence's rows), so it is the same every step and a CUDA graph can hold it
        yield CodeSpan(0, -(-self.spec.ctx // self.spec.chunk_rows), self.k[layer], self.v[layer], True)
