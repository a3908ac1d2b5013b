"""Triton kernels that fuse the small elementwise steps of a layer on CUDA: the residual add
with the RMS norm after it, RoPE, and SiLU(gate) * up.

Owns: the kernels and their launches (one Launch per kernel, shape constants and dtype,
made on first use). Must not: know about layers, weights' names or the cache
(model/transformer.py calls these on CUDA; CPU, the CI oracle, keeps the eager ops).

Why hand-written: in a decode step of an 8B model these steps are ~1.2 ms of 6.9 ms (H100,
batch 1, 4k context, CUDA graphs on). The library's rms_norm is one 6 us kernel for a
single 4096-wide row and has no fused residual add; RoPE as x * cos + roll(x) * sin is
three kernels, SiLU(gate) * up two, and each residual add one more.

Rounding follows the eager ops, which compute in float32 and round to the compute dtype
once per op:
- the residual sum x + a is bitwise the eager sum;
- RoPE is bitwise the eager op (apply_rope): t = x * cos rounded, then t + roll(x) * sin
  as one fused multiply-add rounded once, as addcmul computes it (for 16-bit inputs the
  product is exact in float32, so fused or not gives the same bits; for float32 the eager
  op fuses it too);
- rms_norm is x * rsqrt(mean(x^2) + eps) * w in float32, rounded once, as F.rms_norm; the
  sum of squares is reduced in another order than the library's, so it is close (16-bit
  outputs within one unit in the last place, float32 within a few), not bitwise;
- silu_mul rounds silu(gate) to the compute dtype, then the product, as F.silu(gate) * up;
  exp is the backend's (Triton's fast exp on CUDA, numpy's in the interpreter), so silu's
  float32 value differs in its last bits: 16-bit outputs are within two units in the last
  place (and mostly equal), float32 ones within a few (tests/test_fused_kernels.py).

Imported lazily (transformer.py on CUDA, tests under the interpreter): Triton decides when a
kernel is decorated whether it is compiled or run by its CPU interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvferry.model.launch import Launch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter truncates float32 -> bfloat16 casts (the GPU rounds to nearest even), so
# under it the kernels round by hand (as decode_kernels.py does; its copy is bound to its own
# module's interpreter setting).
_INTERPRET = tl.constexpr(INTERPRETED)
# elementwise kernels cut a row into blocks of this many values: at batch 1 a decode step has
# one row, and one program per row would run it on one SM
ELEMENTWISE_BLOCK = 1024


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


@triton.jit(do_not_specialize=["x_stride", "a_stride"])
def norm_kernel(X, A, W, X_OUT, H_OUT, x_stride, a_stride, eps,
                WIDTH: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    """Program r: row r. ADD: x = X[r] + A[r] rounded to X's dtype, stored to X_OUT[r];
    else x = X[r]. Then H_OUT[r] = x * rsqrt(mean(x^2) + eps) * W in float32, rounded once.
    X, A: row strides x_stride, a_stride, values contiguous; X_OUT, H_OUT contiguous."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    inside = i < WIDTH
    DTYPE = X.dtype.element_ty
    x = tl.load(X + row * x_stride + i, mask=inside, other=0.0)
    if ADD:
        a = tl.load(A + row * a_stride + i, mask=inside, other=0.0)
        x = _round(x.to(tl.float32) + a.to(tl.float32), DTYPE)
        tl.store(X_OUT + row * WIDTH + i, x, mask=inside)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / WIDTH + eps)
    h = xf * r * tl.load(W + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(H_OUT + row * WIDTH + i, _round(h, DTYPE), mask=inside)


@triton.jit(do_not_specialize=["heads", "x_row", "x_head", "cos_row", "sin_row"])
def rope_kernel(X, COS, SIN, OUT, heads, x_row, x_head, cos_row, sin_row,
                D: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: token p // heads, head p % heads. OUT[n, h] = x * cos + roll(x, D/2) * sin
    with x = X[n, h] (strides x_row, x_head, values contiguous) and the tables' row n
    (row strides cos_row, sin_row); OUT contiguous (N, heads, D)."""
    pid = tl.program_id(0)
    n = (pid // heads).to(tl.int64)
    h = pid % heads
    d = tl.arange(0, BLOCK)
    inside = d < D
    src = X + n * x_row + h * x_head
    DTYPE = X.dtype.element_ty
    x = tl.load(src + d, mask=inside, other=0.0).to(tl.float32)
    # roll by D/2: value d comes from (d - D/2) mod D, the same as (d + D/2) mod D
    rolled = tl.load(src + (d + D // 2) % D, mask=inside, other=0.0).to(tl.float32)
    c = tl.load(COS + n * cos_row + d, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(SIN + n * sin_row + d, mask=inside, other=0.0).to(tl.float32)
    t = _round(x * c, DTYPE).to(tl.float32)  # eager rounds x * cos to its own tensor first
    out = _round(tl.fma(rolled, s, t), DTYPE)
    tl.store(OUT + pid.to(tl.int64) * D + d, out, mask=inside)


@triton.jit(do_not_specialize=["gu_stride"])
def silu_mul_kernel(GU, OUT, gu_stride, I: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, j): values j * BLOCK .. + BLOCK of row r. OUT[r] = silu(gate) * up with
    gate = GU[r, :I], up = GU[r, I:] (row stride gu_stride); OUT contiguous (N, I)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < I
    DTYPE = GU.dtype.element_ty
    g = tl.load(GU + row * gu_stride + i, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(GU + row * gu_stride + I + i, mask=inside, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), DTYPE).to(tl.float32)  # eager rounds silu's output
    tl.store(OUT + row * I + i, _round(s * u, DTYPE), mask=inside)


# -- launches -------------------------------------------------------------------------------
_launches: dict = {}


def _launch(kernel, dtype: torch.dtype, device: torch.device, consts: dict, num_warps: int) -> Launch:
    """The Launch of `kernel` for these constants, dtype and device, made once."""
    key = (kernel, dtype, device, tuple(consts.items()))
    launch = _launches.get(key)
    if launch is None:
        launch = _launches[key] = Launch(kernel, device, consts, dict(num_warps=num_warps), INTERPRETED)
    return launch


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as (rows, width) with contiguous values (a view where x allows one)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have contiguous values along its last dim, got strides {x.stride()}")
    return x


def _norm(x: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor, eps: float):
    shape, width = x.shape, x.shape[-1]
    x2 = _rows(x, "x")
    a2 = _rows(a, "a") if a is not None else x2
    if a is not None and (a.shape != shape or a.dtype != x.dtype):
        raise ValueError(f"a must match x: {x.dtype} {tuple(shape)}, got {a.dtype} {tuple(a.shape)}")
    if w.shape != (width,) or not w.is_contiguous():
        raise ValueError(f"w must be contiguous of shape ({width},), got {tuple(w.shape)}")
    h = torch.empty(shape, dtype=x.dtype, device=x.device)
    x_out = torch.empty(shape, dtype=x.dtype, device=x.device) if a is not None else h
    if x2.shape[0]:
        block = triton.next_power_of_2(width)
        launch = _launch(norm_kernel, x.dtype, x.device, dict(WIDTH=width, BLOCK=block, ADD=a is not None),
                         4 if block <= 4096 else 8)
        launch((x2.shape[0],), x2, a2, w, x_out, h, x2.stride(0), a2.stride(0), float(eps))
    return x_out, h


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float):
    """(x + a, rms_norm(x + a) * w) in x's dtype, as eager `x + a` and F.rms_norm: one kernel.
    x, a (..., W) with contiguous values; w (W,)."""
    return _norm(x, a, w, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (W,), w, eps) in one kernel; x (..., W) with contiguous values."""
    return _norm(x, None, w, eps)[1]


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rope (model/rope.py) in one kernel: qk (N, H, D), its last dim contiguous, any
    token and head strides; cos, sin_signed (N, 1, D) (Rope.tables) in qk's dtype ->
    a new contiguous (N, H, D)."""
    n, heads, d = qk.shape
    if qk.stride(-1) != 1 or d % 2:
        raise ValueError(f"qk must have an even, contiguous last dim, got {tuple(qk.shape)} strides {qk.stride()}")
    for name, t in (("cos", cos), ("sin_signed", sin_signed)):
        if t.shape != (n, 1, d) or t.stride(-1) != 1 or t.dtype != qk.dtype:
            raise ValueError(f"{name} must be {qk.dtype} ({n}, 1, {d}) with a contiguous last dim, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    out = torch.empty(n, heads, d, dtype=qk.dtype, device=qk.device)
    if n * heads:
        block = triton.next_power_of_2(d)
        launch = _launch(rope_kernel, qk.dtype, qk.device, dict(D=d, BLOCK=block), 1 if block <= 256 else 4)
        launch((n * heads,), qk, cos, sin_signed, out, heads, qk.stride(0), qk.stride(1),
               cos.stride(0), sin_signed.stride(0))
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate, up = gu.chunk(2, dim=-1), in one kernel: gu (N, 2I) with
    contiguous values -> a new contiguous (N, I)."""
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.stride(1) != 1:
        raise ValueError(f"gu must be (N, 2I) with contiguous values, got {tuple(gu.shape)} strides {gu.stride()}")
    n, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(n, inter, dtype=gu.dtype, device=gu.device)
    if n and inter:
        block = min(triton.next_power_of_2(inter), ELEMENTWISE_BLOCK)
        launch = _launch(silu_mul_kernel, gu.dtype, gu.device, dict(I=inter, BLOCK=block), 4)
        launch((n, triton.cdiv(inter, block)), gu, out, gu.stride(0))
    return out
