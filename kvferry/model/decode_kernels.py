"""The two Triton kernels of split-KV decode attention ("flash-decoding") over KV codes.

Owns: dequantizing every KV encoding in registers (the layouts of kv/quant.py, rounded to the
compute dtype exactly as quant.dequantize rounds), the online softmax of one split of one
chunk (`partials_kernel`), and the fixed-order log-sum-exp merge of a layer's partials
(`merge_kernel`). Must not: allocate, choose tile sizes, check inputs (decode_attention.py
does all three), or know about the transport.

Why the arithmetic cannot depend on the caller: a program's work is fixed by (sequence,
head, chunk, split) alone. Its rows, its tiles and their order follow from the sequence's
end and the chunk capacity, never from the grid or from where the chunk's bytes live, and
the integers that locate the bytes (strides, first row, first chunk) are not specialized,
so the device cache's one launch per layer and the host ring's one launch per chunk run the
same compiled code on the same values. No atomics: every partial has one writer.

Imported lazily (decode_attention.DecodeAttention): Triton decides when a kernel is
decorated whether it is compiled or run by its CPU interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# KV encodings as kernel constants (kv/quant.py names them)
KV_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "fp8": 5}
_F32 = tl.constexpr(0)
_F16 = tl.constexpr(1)
_BF16 = tl.constexpr(2)
_Q8_0 = tl.constexpr(3)
_Q4_0 = tl.constexpr(4)
_FP8 = tl.constexpr(5)
_LN2 = tl.constexpr(0.6931471805599453)
# The interpreter truncates float32 -> bfloat16 casts (the GPU rounds to nearest even) and
# multiplies bfloat16 dot operands by their bit patterns; under it, the kernels round by
# hand and run dots in float32 (exact products of 16-bit values, as on tensor cores).
_INTERPRET = tl.constexpr(INTERPRETED)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 -> DTYPE, rounding to nearest even."""
    if DTYPE != tl.float32:
        if _INTERPRET and DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            x = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            x = x.to(DTYPE)
    return x


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a (M, K) @ b (K, N) -> float32 (M, N). F32 (float32 operands): three tf32 products
    per term (tf32x3), within about 1e-6 of float32 on tensor cores; the plain float32 (ieee)
    path runs on FMA units and spills registers at these tile sizes."""
    if _INTERPRET:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif F32:
        c = tl.dot(a, b, input_precision="tf32x3")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _load_rows(rows, valid, KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """rows (BLOCK_N,) uint8 pointers, each to one head's row of codes -> values (BLOCK_N, D)
    in DTYPE; rows that are not `valid` read nothing and give zeros."""
    d = tl.arange(0, D)
    mask = valid[:, None]
    if KV == _F32:
        x = _round(tl.load(rows.to(tl.pointer_type(tl.float32))[:, None] + d[None, :], mask=mask, other=0.0), DTYPE)
    elif KV == _F16:
        x = tl.load(rows.to(tl.pointer_type(tl.float16))[:, None] + d[None, :], mask=mask, other=0.0)
        if DTYPE != tl.float16:
            x = _round(x.to(tl.float32), DTYPE)
    elif KV == _BF16:
        x = tl.load(rows.to(tl.pointer_type(tl.bfloat16))[:, None] + d[None, :], mask=mask, other=0.0)
        if DTYPE != tl.bfloat16:
            x = _round(x.to(tl.float32), DTYPE)
    elif KV == _FP8:
        # e4m3fn -> the f16 with the same sign, exponent and mantissa bits is the value * 2^-8
        # (biases 7 and 15), subnormals included; exact, and no fp8 hardware needed
        b = tl.load(rows[:, None] + d[None, :], mask=mask, other=0).to(tl.uint16)
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        x = _round(bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0, DTYPE)
    else:
        # blocks of 32 values with one f16 scale each; the scales follow the codes
        if KV == _Q8_0:
            codes = tl.load(rows[:, None] + d[None, :], mask=mask, other=0)
            vals = codes.to(tl.int8, bitcast=True).to(tl.float32)
            scales = rows + D
        else:  # q4_0: byte j of a block holds value j (low nibble) and value j + 16 (high)
            byte = tl.load(rows[:, None] + ((d // 32) * 16 + d % 16)[None, :], mask=mask, other=0)
            shift = ((d // 16) % 2) * 4
            vals = ((byte.to(tl.int32) >> shift[None, :]) & 0xF).to(tl.float32) - 8.0
            scales = rows + D // 2
        s = tl.load(scales.to(tl.pointer_type(tl.float16))[:, None] + tl.arange(0, D // 32)[None, :],
                    mask=mask, other=0.0).to(tl.float32)  # (BLOCK_N, D // 32)
        x = _round(tl.reshape(tl.reshape(vals, (BLOCK_N, D // 32, 32)) * s[:, :, None], (BLOCK_N, D)), DTYPE)
    return x


@triton.jit(do_not_specialize=["q_stride", "seq_stride", "row_stride", "row0", "chunk0"])
def partials_kernel(Q, K, V, SEQ, ENDS, O_PART, LSE_PART,
                    q_stride, seq_stride, row_stride, row0, chunk0, qk_scale,
                    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                    KV: tl.constexpr, ROW_BYTES: tl.constexpr, ALIGN: tl.constexpr,
                    CHUNK: tl.constexpr, SPLIT_ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    MAX_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    """Program (b * HKV + h, j * NUM_SPLITS + s): split s of chunk chunk0 + j of sequence b,
    kv head h, for the G query heads of h.

    Q (B, HKV * G, D) compute dtype, batch stride q_stride, the rest contiguous.
    K, V uint8 (S, R, HKV, ROW_BYTES); seq_stride and row_stride in units of ALIGN bytes
    (ALIGN divides both, so the compiler knows how far loads can be vectorized).
    SEQ (B,) int32: sequence b's index along dim 0. ENDS (B,) int32: its rows in all.
    Chunk c holds rows [c * CHUNK, (c + 1) * CHUNK) of a sequence; chunk chunk0 + j starts
    at row row0 + j * CHUNK of K/V. Writes the split's output, normalized within the split,
    O_PART[b*HKV + h, c*NUM_SPLITS + s] (G, D) f32, and its natural log-sum-exp
    LSE_PART[..] (G,) f32. A split without rows (past the sequence's end) writes nothing.
    qk_scale = softmax scale * log2(e): scores live in base 2 until the end."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    j = part // NUM_SPLITS
    split = part % NUM_SPLITS
    chunk = chunk0 + j
    rows = tl.minimum(tl.maximum(tl.load(ENDS + b) - chunk * CHUNK, 0), CHUNK)  # this chunk's rows of b
    n = tl.minimum(rows - split * SPLIT_ROWS, SPLIT_ROWS)  # this split's rows
    if n <= 0:
        return  # past the sequence's rows: the merge stops before this partial

    seq = tl.load(SEQ + b).to(tl.int64)
    first = (row0 + j * CHUNK + split * SPLIT_ROWS).to(tl.int64)
    off = (seq * seq_stride + first * row_stride) * ALIGN + h * ROW_BYTES
    k_rows = K + off
    v_rows = V + off
    step = row_stride * ALIGN  # bytes from one row to the next

    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * q_stride + (h * G + g)[:, None] * D + d[None, :],
                mask=(g < G)[:, None], other=0.0)  # (GP, D); rows past G are padding
    DTYPE = Q.dtype.element_ty
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for start in range(0, n, BLOCK_N):
        r = start + tl.arange(0, BLOCK_N)
        valid = r < n
        k = _load_rows(k_rows + r * step, valid, KV, D, BLOCK_N, DTYPE)
        s = _dot(q, tl.trans(k), F32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # (GP, BLOCK_N)
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile has a valid row
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = _load_rows(v_rows + r * step, valid, KV, D, BLOCK_N, DTYPE)
        acc = acc * alpha[:, None] + _dot(_round(p, DTYPE), v, F32)
        m = m_new

    o = acc / l[:, None]  # l > 0: the split has rows (padding heads are not stored)
    lse = (m + tl.log2(l)) * _LN2
    idx = pid.to(tl.int64) * MAX_PARTS + chunk * NUM_SPLITS + split
    keep = g < G
    tl.store(O_PART + (idx * G + g)[:, None] * D + d[None, :], o, mask=keep[:, None])
    tl.store(LSE_PART + idx * G + g, lse, mask=keep)


@triton.jit(do_not_specialize=["num_parts"])
def merge_kernel(O_PART, LSE_PART, ENDS, OUT, num_parts,
                 HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                 SPLIT_ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, MAX_PARTS: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ((b * HKV + h) * G + g, j): merges the partials of query head h * G + g of
    sequence b, always in index order, into dims j * BLOCK_D .. + BLOCK_D of
    OUT[b, (h*G + g)*D : +D], i.e. of row pid of OUT viewed as (B * HKV * G, D).

    It reads partials 0 .. min(num_parts, own) - 1, where own counts the splits that hold
    rows of b (ENDS (B,) int32: its rows; decode_attention.parts_with_rows): every split before b's last one holds rows, and
    none after it was written. Partial 0 holds row 0, which every query sees, so the largest
    log-sum-exp is finite. A partial with no rows would add exactly zero, so the bits are
    those of merging any number of parts >= own: a caller may pass MAX_PARTS (a CUDA graph
    does, whatever the step's rows)."""
    pid = tl.program_id(0)
    bh = pid // G
    g = pid % G
    last = tl.load(ENDS + bh // HKV) - 1  # b's last row
    own = (last // CHUNK) * NUM_SPLITS + (last % CHUNK) // SPLIT_ROWS + 1
    num_parts = tl.minimum(num_parts, own)
    p = tl.arange(0, BLOCK_P)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_row = LSE_PART + bh.to(tl.int64) * MAX_PARTS * G + g
    o_row = O_PART + (bh.to(tl.int64) * MAX_PARTS * G + g) * D

    top = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    for i in range(0, num_parts, BLOCK_P):
        idx = i + p
        top = tl.maximum(top, tl.load(lse_row + idx * G, mask=idx < num_parts, other=float("-inf")))
    top_all = tl.max(top, 0)

    acc = tl.zeros((BLOCK_P, BLOCK_D), tl.float32)
    den = tl.zeros((BLOCK_P,), tl.float32)
    for i in range(0, num_parts, BLOCK_P):
        idx = i + p
        inside = idx < num_parts
        w = tl.exp(tl.load(lse_row + idx * G, mask=inside, other=float("-inf")) - top_all)
        o = tl.load(o_row + (idx * G * D)[:, None] + d[None, :], mask=inside[:, None], other=0.0)
        acc += w[:, None] * o
        den += w
    out = tl.sum(acc, 0) / tl.sum(den, 0)
    tl.store(OUT + pid.to(tl.int64) * D + d, _round(out, OUT.dtype.element_ty))
