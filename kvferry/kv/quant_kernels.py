"""The Triton kernel that encodes a pass's new K and V rows as q8_0 or q4_0 in one launch.

Why a kernel: the eager encoding in quant.py is about a dozen elementwise and reduction ops
per tensor (block max, scale, round, clamp, pack, concatenate), 25 launches per layer for K
and V, which cost a q8_0 / q4_0 decode step 1.7 ms over bf16 on an H100 at every context
(32 layers). This kernel is the same arithmetic in one launch per layer.

Owns: the encoding on CUDA devices, bit for bit the eager `quant.quantize` (the oracle, and
the encoding on CPU): every rounding step happens in the same order in float32, and launches
turn fused multiply-add off so that `x * inv + 8.5` rounds twice as the eager ops do.
Must not: pick what to encode (kv/cache.encode_kv does) or know where the rows go.

Imported lazily: Triton decides when a kernel is decorated whether it is compiled or run by
its CPU interpreter (TRITON_INTERPRET=1, how the CPU tests run it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvferry.kv import quant

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
HALF = tl.constexpr(quant.QBLOCK // 2)
# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude < 2**22 to the nearest
# integer, ties to even (torch.round), with plain adds that the interpreter runs the same way.
_RNE = tl.constexpr(12582912.0)


@triton.jit
def _inverse(s, keep):
    """1 / s (rounded to nearest) where `keep`, else 0: the eager torch.where, dividing only there."""
    return tl.where(keep, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(keep, s, 1.0)), 0.0)


@triton.jit
def _encode_kernel(k_ptr, v_ptr, out_ptr, H, stride_kn, stride_kh, stride_vn, stride_vh,
                   inv127, D: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                   ROW_BYTES: tl.constexpr, Q4: tl.constexpr):
    """One program per (row n, head h) of K (axis 1 = 0) or V (= 1): the head's D values
    as NB blocks of 32, each held as its lower and upper 16 values (q4_0 packs value j with
    value j + 16 of its block into one byte)."""
    row = tl.program_id(0)
    which = tl.program_id(1)
    n = row // H
    h = row % H
    if which == 0:
        src = k_ptr + n * stride_kn + h * stride_kh
    else:
        src = v_ptr + n * stride_vn + h * stride_vh
    b = tl.arange(0, NBP)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = b < NB
    lo = tl.load(src + b * 32 + j, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + b * 32 + HALF + j, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))  # (NBP,)
    dst = out_ptr + (which * tl.num_programs(0) + row) * ROW_BYTES
    blk = tl.arange(0, NBP)
    if Q4:
        # the scale comes from the block's first value of largest magnitude, with its sign
        first = tl.minimum(tl.min(tl.where(tl.abs(lo) == amax[:, None], j, 32), axis=1),
                           tl.min(tl.where(tl.abs(hi) == amax[:, None], j + HALF, 32), axis=1))
        peak = tl.maximum(tl.max(tl.where(j == first[:, None], lo, float("-inf")), axis=1),
                          tl.max(tl.where(j + HALF == first[:, None], hi, float("-inf")), axis=1))
        scale = tl.math.div_rn(peak, -8.0).to(tl.float16)
        s = scale.to(tl.float32)
        inv = _inverse(s, s != 0)[:, None]
        ql = tl.minimum(tl.maximum((lo * inv + 8.5).to(tl.int32), 0), 15)
        qh = tl.minimum(tl.maximum((hi * inv + 8.5).to(tl.int32), 0), 15)
        tl.store(dst + b * HALF + j, (ql | (qh << 4)).to(tl.uint8), mask=mask)
        scales = dst + NB * HALF
    else:
        scale = (amax * inv127).to(tl.float16)
        s = scale.to(tl.float32)
        inv = _inverse(s, s > 0)[:, None]
        ql = tl.minimum(tl.maximum((lo * inv + _RNE) - _RNE, -127.0), 127.0)
        qh = tl.minimum(tl.maximum((hi * inv + _RNE) - _RNE, -127.0), 127.0)
        tl.store(dst + b * 32 + j, ql.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
        tl.store(dst + b * 32 + HALF + j, qh.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
        scales = dst + NB * 32
    tl.store(scales.to(tl.pointer_type(tl.float16)) + blk, scale, mask=blk < NB)


def encode(k: torch.Tensor, v: torch.Tensor, kv_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows (N, H, D), last dim contiguous, in one launch -> their codes, each
    (N, H, row_bytes) uint8 (two halves of one buffer)."""
    if kv_type not in ("q8_0", "q4_0"):
        raise ValueError(f"the encode kernel writes q8_0 and q4_0, not {kv_type}")
    if k.shape != v.shape or k.dim() != 3 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"K and V must be (N, H, D) with a contiguous last dim, got {tuple(k.shape)} "
                         f"strides {k.stride()} and {tuple(v.shape)} strides {v.stride()}")
    n, h, d = k.shape
    quant.check_kv_type(kv_type, d)
    nb = d // quant.QBLOCK
    rb = quant.row_bytes(kv_type, d)
    out = torch.empty(2, n, h, rb, dtype=torch.uint8, device=k.device)
    if n * h:
        _encode_kernel[(n * h, 2)](
            k, v, out, h, k.stride(0), k.stride(1), v.stride(0), v.stride(1), 1.0 / 127.0,
            D=d, NB=nb, NBP=triton.next_power_of_2(nb), ROW_BYTES=rb, Q4=kv_type == "q4_0",
            enable_fp_fusion=False, num_warps=1)
    return out[0], out[1]
