"""KV row encodings: the ONE place where K/V values are quantized and dequantized.

A cache row is one token's K (or V) for all local heads, stored as bytes: shape
(..., H, row_bytes). Quantization runs on the device that computed K/V, so where a row
later lives (device or host) never changes its bytes. Quantized types work on blocks of
32 values along the head dimension, with one f16 scale per block:
  q8_0: 32 int8 + scale (34 bytes per 32 values)
  q4_0: 32 4-bit values packed in 16 bytes + scale (18 bytes per 32 values)
  fp8:  float8 e4m3 per value, no scale
Within a row the codes come first and the scales after them (our own layout; it keeps
codes and scales each contiguous so (de)quantization is a few vector ops).
"""

from __future__ import annotations

import math

import torch

from kvferry import KvferryError

FLOAT_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QUANT_TYPES = ("q8_0", "q4_0", "fp8")
KV_TYPES = tuple(FLOAT_TYPES) + QUANT_TYPES
QBLOCK = 32
# --kv-chunk auto: a chunk holds about this many bytes of one head's K (and as many of V).
# 8192 rows of bf16 at head dim 128, the chunk the ring measured at 99-100% of the link from
# 16k to 128k (H200). With 8192 rows at every type, a q4_0 chunk of an 8B shape was 10 MiB
# of K + V for all heads and decode at 32k was host-bound at 76% of the bound (four chunk
# launches per layer, H200, 2026-12-06); with the same bytes per chunk it is one.
CHUNK_HEAD_BYTES = 2 << 20


def check_kv_type(kv_type: str, head_dim: int) -> None:
    if kv_type not in KV_TYPES:
        raise KvferryError(f"unknown KV type '{kv_type}' (choose one of: {', '.join(KV_TYPES)})")
    if kv_type in ("q8_0", "q4_0") and head_dim % QBLOCK:
        raise KvferryError(f"KV type {kv_type} needs a head dim that is a multiple of {QBLOCK}, got {head_dim}")


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes of one head's row."""
    if kv_type in FLOAT_TYPES:
        return head_dim * FLOAT_TYPES[kv_type].itemsize
    if kv_type == "q8_0":
        return head_dim + 2 * (head_dim // QBLOCK)
    if kv_type == "q4_0":
        return head_dim // 2 + 2 * (head_dim // QBLOCK)
    return head_dim  # fp8


def chunk_rows(kv_type: str, head_dim: int, asked: int | str = "auto") -> int:
    """Rows of one KV chunk: `asked`, or for "auto" the power of two nearest to CHUNK_HEAD_BYTES
    of one head's codes, so a chunk carries about the same bytes whatever the KV type."""
    if asked != "auto":
        return int(asked)
    return 1 << max(0, round(math.log2(CHUNK_HEAD_BYTES / row_bytes(kv_type, head_dim))))


def quantize(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """x (..., D) float -> uint8 (..., row_bytes)."""
    if kv_type in FLOAT_TYPES:
        return x.to(FLOAT_TYPES[kv_type]).contiguous().view(torch.uint8)
    if kv_type == "fp8":
        return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    d_head = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d_head // QBLOCK, QBLOCK)
    if kv_type == "q8_0":
        # times the float32 reciprocal, not / 127: CUDA divides a tensor by a scalar that way
        # and CPU does not, so this is the one form every device (and the kernel) rounds alike
        scale = (blocks.abs().amax(-1) * (1.0 / 127.0)).half()
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        codes = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        codes = codes.reshape(*x.shape[:-1], d_head)
    else:  # q4_0: scale from the signed value of largest magnitude, codes in [0, 15]
        idx = blocks.abs().argmax(-1, keepdim=True)
        peak = blocks.gather(-1, idx).squeeze(-1)
        scale = (peak / -8.0).half()
        inv = torch.where(scale != 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        q = (blocks * inv[..., None] + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        codes = (q[..., :QBLOCK // 2] | (q[..., QBLOCK // 2:] << 4)).reshape(*x.shape[:-1], d_head // 2)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantize(b: torch.Tensor, kv_type: str, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 (..., row_bytes) -> (..., D) in dtype. `b` must be contiguous in its last dim."""
    if kv_type in FLOAT_TYPES:
        x = b.view(FLOAT_TYPES[kv_type])
        return x if x.dtype == dtype else x.to(dtype)
    if kv_type == "fp8":
        return b.view(torch.float8_e4m3fn).to(dtype)
    nblk = head_dim // QBLOCK
    ncode = head_dim if kv_type == "q8_0" else head_dim // 2
    scale = b[..., ncode:].contiguous().view(torch.float16).float()  # (..., nblk)
    codes = b[..., :ncode]
    if kv_type == "q8_0":
        vals = codes.contiguous().view(torch.int8).float().reshape(*b.shape[:-1], nblk, QBLOCK)
    else:
        packed = codes.reshape(*b.shape[:-1], nblk, QBLOCK // 2)
        vals = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float() - 8.0
    return (vals * scale[..., None]).reshape(*b.shape[:-1], head_dim).to(dtype)
