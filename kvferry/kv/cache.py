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
        self._cells = None  # (N,) sequence and position index tensors of the new rows, made on first use

    def _new_cells(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cells is None:
            b = self.batch
            self._cells = (index_tensor([s for s, c in zip(b.seq_ids, b.counts) for _ in range(c)], self.device),
                           index_tensor(b.positions(), self.device))
        return self._cells

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

    def _chunk_ranges(self, i: int) -> list[tuple[int, int] | None]:
        """Per batch entry: (row0, n) of chunk i, or None."""
        c = self.spec.chunk_rows
        out = []
        for end in self.batch.ends:
            n = min(c, end - i * c)
            out.append((i * c, n) if n > 0 else None)
        return out


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

    def _store(self, layer, kq, vq, static=False):
        b = self.batch
        if len(b.seq_ids) <= SLICE_COPY_MAX_SEQS:  # a plain slice copy per sequence: fewer launches
            for j, (s, start, end) in enumerate(zip(b.seq_ids, b.starts, b.ends)):
                o0, o1 = b.offsets[j], b.offsets[j + 1]
                self.k[layer][s, start:end].copy_(kq[o0:o1])
                self.v[layer][s, start:end].copy_(vq[o0:o1])
            return
        seq, pos = self._new_cells()
        self.k[layer][seq, pos] = kq
        self.v[layer][seq, pos] = vq

    def window(self, layer):
        for i in range(self.batch.num_chunks(self.spec.chunk_rows)):
            ks, vs = [], []
            for s, rng in zip(self.batch.seq_ids, self._chunk_ranges(i)):
                if rng is None:
                    ks.append(None), vs.append(None)
                    continue
                r0, n = rng
                ks.append(self.k[layer][s, r0:r0 + n])
                vs.append(self.v[layer][s, r0:r0 + n])
            yield Chunk(i, i * self.spec.chunk_rows, ks, vs)

    def code_spans(self, layer):
        # every chunk of the layer lives in one tensor: one span, one kernel launch
        yield CodeSpan(0, self.batch.num_chunks(self.spec.chunk_rows), self.k[layer], self.v[layer], True)
