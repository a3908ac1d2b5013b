"""Decode attention straight from KV codes: the split plan and the per-layer API of the
split-KV kernels (the kernels themselves are in decode_kernels.py).

Owns: the split plan (which rows each kernel program reads), input checks, the partials
buffers (allocated once, reused by every layer and step) and the two launches per layer.
Must not: touch KV storage or the transport (the caller hands over the tensors that hold a
layer's or a chunk's codes), or make host syncs (no .item(), no host copies per launch).

Decode means one query token per sequence. A chunk of capacity `chunk_cap` (the cache's
chunk size, min(chunk_rows, ctx)) is always cut into num_splits(chunk_cap) splits of
`split_rows` rows, whatever rows it actually holds: a split past a sequence's rows returns
without writing. So the grid, each program's rows and the merge order depend only on shapes,
and the device-resident cache (one launch per layer over the whole context, `layer`) and the
host ring (one launch per chunk from a slot, `chunk`) produce the same bits. The merge then
runs once per layer over each sequence's first parts_with_rows(end) partials (every split
before its last one holds rows), in index order, and writes (B, Hq * D) in the compute dtype.

Rows of chunk c for sequence b are [c * chunk_cap, c * chunk_cap + n) with
n = clamp(end_b - c * chunk_cap, 0, chunk_cap), where end_b is the sequence's row count
after this step's row is written (at least 1: row 0 is visible to every decode query).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch

from kvferry.kv import quant
from kvferry.model.launch import Launch

SPLIT_ROWS = 256  # rows per split: a tuning constant, see the sweep in the GPU script
BLOCK_N = 64  # rows per inner tile of a split
MERGE_BLOCK = 16  # partials merged per step of the merge loop
# dims of one merge program: one program per query head merged all D dims with 32 programs
# for one sequence of an 8B shape, 16 us for a 2 MiB read at 32k on an H200 (2026-12-06)
MERGE_DIMS = 32


@dataclass(frozen=True)
class Tiling:
    """How the kernels cut the work. Every field changes only speed, except that outputs
    are bitwise reproducible for one Tiling, not across Tilings. `default_tiling` picks one
    per compute dtype."""
    split_rows: int = SPLIT_ROWS
    block_n: int = BLOCK_N  # a power of two >= 16 that divides split_rows
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.split_rows < self.block_n or self.split_rows % self.block_n:
            raise ValueError(f"split_rows ({self.split_rows}) must be a multiple of block_n ({self.block_n})")


def default_tiling(dtype: torch.dtype) -> Tiling:
    """float32 operands take twice the registers of 16-bit ones: half the rows per tile."""
    return Tiling(block_n=32) if dtype == torch.float32 else Tiling()


def num_splits(chunk_cap: int, split_rows: int = SPLIT_ROWS) -> int:
    """Splits per chunk: fixed by the chunk's capacity, never by its rows."""
    return -(-chunk_cap // split_rows)


def split_range(end: int, chunk: int, split: int, chunk_cap: int, split_rows: int = SPLIT_ROWS) -> range:
    """Rows (of the sequence) that program (chunk, split) reads for a sequence of `end` rows;
    the kernel computes the same, and for an empty range it writes no partial."""
    n = min(max(end - chunk * chunk_cap, 0), chunk_cap)
    lo = chunk * chunk_cap + split * split_rows
    return range(lo, chunk * chunk_cap + min(n, (split + 1) * split_rows))


def parts_with_rows(end: int, chunk_cap: int, split_rows: int = SPLIT_ROWS) -> int:
    """How many partials (index chunk * num_splits + split) hold rows of a sequence of `end`
    rows: they are the first ones, and the merge kernel reads exactly these (it computes the
    same from the row counts)."""
    last = end - 1
    return (last // chunk_cap) * num_splits(chunk_cap, split_rows) + (last % chunk_cap) // split_rows + 1


def _alignment(row_bytes: int) -> int:
    """The largest power of two <= 16 that divides a row: the widest aligned load a row allows."""
    return math.gcd(row_bytes, 16)


class DecodeAttention:
    """Split-KV decode attention for one shape: num_seqs sequences of one query token each,
    num_kv_heads local kv heads with `group` query heads each, head_dim, kv_type, over at
    most max_chunks chunks of chunk_cap rows. Per layer: one or more partials launches
    (`layer`, or `chunk` once per chunk), then `merge`."""

    def __init__(self, num_seqs: int, num_kv_heads: int, group: int, head_dim: int, kv_type: str,
                 chunk_cap: int, max_chunks: int, dtype: torch.dtype, device: torch.device | str,
                 scale: float | None = None, tiling: Tiling | None = None):
        device = torch.device(device)
        tiling = tiling or default_tiling(dtype)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if kv_type not in quant.KV_TYPES:
            raise ValueError(f"unknown KV type '{kv_type}' (choose one of: {', '.join(quant.KV_TYPES)})")
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"the decode kernel needs a head dim that is a power of two >= 16, got {head_dim}")
        if kv_type in ("q8_0", "q4_0") and head_dim % quant.QBLOCK:
            raise ValueError(f"KV type {kv_type} needs a head dim that is a multiple of {quant.QBLOCK}, got {head_dim}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the compute dtype must be float32, float16 or bfloat16, got {dtype}")
        for name, v in (("num_seqs", num_seqs), ("num_kv_heads", num_kv_heads), ("group", group),
                        ("chunk_cap", chunk_cap), ("max_chunks", max_chunks)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        kernels = importlib.import_module("kvferry.model.decode_kernels")
        if device.type != "cuda" and not kernels.INTERPRETED:
            raise ValueError(f"the decode kernel runs on CUDA devices (on {device.type} only under the "
                             "Triton interpreter, TRITON_INTERPRET=1 before the kernels are imported)")
        self.kernels = kernels
        self.num_seqs, self.num_kv_heads, self.group, self.head_dim = num_seqs, num_kv_heads, group, head_dim
        self.kv_type, self.chunk_cap, self.max_chunks = kv_type, chunk_cap, max_chunks
        self.dtype, self.device, self.tiling = dtype, device, tiling
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.row_bytes = quant.row_bytes(kv_type, head_dim)
        self.align = _alignment(self.row_bytes)
        self.num_splits = num_splits(chunk_cap, tiling.split_rows)
        self.max_parts = max_chunks * self.num_splits
        bh = num_seqs * num_kv_heads
        # every launch of a layer writes its own partials, and merge reads only those
        self.o_part = torch.empty(bh, self.max_parts, group, head_dim, dtype=torch.float32, device=device)
        self.lse_part = torch.empty(bh, self.max_parts, group, dtype=torch.float32, device=device)
        self.out = torch.empty(num_seqs, num_kv_heads * group * head_dim, dtype=dtype, device=device)
        self.slot_index = torch.arange(num_seqs, dtype=torch.int32, device=device)  # ring slot b holds batch entry b
        self._partials = Launch(kernels.partials_kernel, device, dict(
            HKV=num_kv_heads, G=group, GP=max(16, 1 << (group - 1).bit_length()), D=head_dim,
            KV=kernels.KV_CODES[kv_type], ROW_BYTES=self.row_bytes, ALIGN=self.align, CHUNK=chunk_cap,
            SPLIT_ROWS=tiling.split_rows, NUM_SPLITS=self.num_splits, MAX_PARTS=self.max_parts,
            BLOCK_N=tiling.block_n, F32=dtype == torch.float32),
            dict(num_warps=tiling.num_warps, num_stages=tiling.num_stages), kernels.INTERPRETED)
        block_d = min(MERGE_DIMS, head_dim)
        self._merge_grid = (num_seqs * num_kv_heads * group, head_dim // block_d)
        self._merge = Launch(kernels.merge_kernel, device, dict(
            HKV=num_kv_heads, G=group, D=head_dim, CHUNK=chunk_cap, SPLIT_ROWS=tiling.split_rows,
            NUM_SPLITS=self.num_splits, MAX_PARTS=self.max_parts, BLOCK_P=MERGE_BLOCK, BLOCK_D=block_d),
            dict(num_warps=4), kernels.INTERPRETED)
        self._qk_scale = self.scale * math.log2(math.e)

    # -- per step ----------------------------------------------------------------------------
    def index_tensors(self, seq_ids: list[int], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_ids, ends) as int32 device tensors, once per step (outside the layer loop),
        copied without a host sync."""
        t = torch.tensor([seq_ids, ends], dtype=torch.int32)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t[0], t[1]

    # -- per layer ---------------------------------------------------------------------------
    def layer(self, q, k, v, seq_ids: torch.Tensor, ends: torch.Tensor, num_chunks: int) -> None:
        """The device-resident cache: chunks 0 .. num_chunks - 1 of a layer in one launch.
        k, v: the layer's codes, uint8 (num_seqs_cache, ctx, Hkv, row_bytes); seq_ids (B,)
        int32: each batch entry's index along dim 0; ends (B,) int32: rows per sequence."""
        self.partials(q, k, v, seq_ids, ends, chunk0=0, num_chunks=num_chunks, row0=0)

    def chunk(self, q, k, v, chunk_index: int, ends: torch.Tensor) -> None:
        """The host ring: one chunk from a slot, uint8 (B, slot_rows, Hkv, row_bytes) whose
        row 0 is the chunk's first row and whose entry b is batch entry b."""
        self.partials(q, k, v, self.slot_index, ends, chunk0=chunk_index, num_chunks=1, row0=0)

    def partials(self, q, k, v, seq_index, ends, chunk0: int, num_chunks: int, row0: int) -> None:
        """Chunks chunk0 .. chunk0 + num_chunks - 1; chunk chunk0 + j of batch entry b starts at
        k[seq_index[b], row0 + j * chunk_cap]. q (B, Hq, D) in the compute dtype, the head and
        dim axes contiguous (any batch stride)."""
        self._check(q, k, v, seq_index, ends)
        if chunk0 < 0 or num_chunks < 1 or chunk0 + num_chunks > self.max_chunks:
            raise ValueError(f"chunks {chunk0} .. {chunk0 + num_chunks - 1} are outside the "
                             f"{self.max_chunks} chunks this DecodeAttention was built for")
        sk = k.stride()
        grid = (self.num_seqs * self.num_kv_heads, num_chunks * self.num_splits)
        self._partials(grid, q, k, v, seq_index, ends, self.o_part, self.lse_part,
                       q.stride(0), sk[0] // self.align, sk[1] // self.align, row0, chunk0, self._qk_scale)

    def merge(self, num_chunks: int, ends: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Merge the partials of chunks 0 .. num_chunks - 1 -> (B, Hq * D) in the compute dtype,
        written into `out` if given (contiguous), else into a buffer this object owns and
        overwrites at the next merge. ends: the partials launches' (B,) int32 row counts; each
        sequence stops at its own last split, so any num_chunks that covers the rows gives
        the same bits (max_chunks lets a CUDA graph replay one merge for every step)."""
        if not 1 <= num_chunks <= self.max_chunks:
            raise ValueError(f"num_chunks must be in 1 .. {self.max_chunks}, got {num_chunks}")
        if out is None:
            out = self.out
        elif out.shape != self.out.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.dtype} tensor of shape {tuple(self.out.shape)}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        self._merge(self._merge_grid, self.o_part, self.lse_part, ends, out, num_chunks * self.num_splits)
        return out

    def _check(self, q, k, v, seq_index, ends) -> None:
        hq, d, rb = self.num_kv_heads * self.group, self.head_dim, self.row_bytes
        if q.shape != (self.num_seqs, hq, d) or q.dtype != self.dtype or q.stride()[1:] != (d, 1):
            raise ValueError(f"q must be {self.dtype} of shape ({self.num_seqs}, {hq}, {d}) with its last two "
                             f"dims contiguous, got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
        if k.dtype != torch.uint8 or k.dim() != 4 or k.shape[2:] != (self.num_kv_heads, rb) \
                or k.stride()[2:] != (rb, 1) or k.shape != v.shape or k.stride() != v.stride() or v.dtype != k.dtype:
            raise ValueError(f"k and v must be uint8 (S, R, {self.num_kv_heads}, {rb}) with the same shape and "
                             f"strides and their last two dims contiguous, got {k.dtype} {tuple(k.shape)} "
                             f"{k.stride()} and {v.dtype} {tuple(v.shape)} {v.stride()}")
        if k.stride(0) % self.align or k.stride(1) % self.align:
            raise ValueError(f"k/v strides {k.stride()[:2]} must be multiples of {self.align} bytes")
        for name, t in (("seq_index", seq_index), ("ends", ends)):
            if t.dtype != torch.int32 or t.shape != (self.num_seqs,):
                raise ValueError(f"{name} must be int32 of shape ({self.num_seqs},), got {t.dtype} {tuple(t.shape)}")
        if any(t.device != self.device for t in (q, k, v, seq_index, ends)):
            raise ValueError(f"q, k, v and the index tensors must be on {self.device}")
