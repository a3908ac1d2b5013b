"""Rotary position embedding: inverse frequencies for the scaling a checkpoint declares,
and the half-split (NeoX-style) rotation applied to q and k."""

from __future__ import annotations

import math

import torch

from kvferry import KvferryError


def inv_freq(head_dim: int, theta: float, scaling: dict | None,
             freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq (head_dim/2,) float32, attention scale multiplier for cos/sin)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    mscale = 1.0
    if freq_factors is not None:  # llama3 GGUFs carry the scaled factors as a tensor
        base = base / freq_factors.double()
    elif scaling:
        rtype = scaling["rope_type"]
        factor = float(scaling.get("factor", 1.0))
        if rtype == "linear":
            base = base / factor
        elif rtype == "llama3":
            base = _llama3(base, factor, scaling)
        elif rtype == "yarn":
            base, mscale = _yarn(base, head_dim, theta, factor, scaling)
        elif rtype == "dynamic":
            pass  # dynamic NTK only changes past the original context; we keep base there
        else:
            raise KvferryError(f"unsupported rope scaling '{rtype}' (supported: linear, llama3, yarn)")
    return base.float(), mscale


def _llama3(base: torch.Tensor, factor: float, s: dict) -> torch.Tensor:
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / factor, base)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn(base, head_dim, theta, factor, s):
    old_ctx = float(s.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

    def dim_for(rot):
        return (head_dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo = max(math.floor(dim_for(beta_fast)), 0)
    hi = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrap = 1 - ramp
    out = (base / factor) * (1 - extrap) + base * extrap
    mscale = float(s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
    return out, mscale


class Rope:
    """cos/sin tables on the compute device, grown on demand."""

    def __init__(self, head_dim, theta, scaling, device, freq_factors=None):
        self.inv_freq, self.mscale = inv_freq(head_dim, theta, scaling, freq_factors)
        self.inv_freq = self.inv_freq.to(device)
        self.device = device
        self.cos = self.sin = None
        self._grow(4096)

    def _grow(self, n):
        t = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # (n, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos() * self.mscale, emb.sin() * self.mscale
        self._cast = {}  # dtype -> (cos, signed sin) in that dtype, made on first use

    def tables(self, positions: torch.Tensor | slice, max_pos: int, dtype):
        """positions: (N,) int64 on the device, or a slice when they are one run; max_pos
        known on the host -> cos, signed sin (N, 1, D) in `dtype` (computed in float32, then
        cast, as the reference implementations do; the cast tables are kept)."""
        need = max_pos + 1
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))
        if dtype not in self._cast:
            # sin with the rotation's sign folded in (first half negated), see apply_rope
            half = self.sin.shape[-1] // 2
            signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)
            self._cast[dtype] = (self.cos.to(dtype), signed.to(dtype))
        cos, sin = self._cast[dtype]
        return cos[positions, None], sin[positions, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + cat(-x2, x1) * sin, as x * cos + roll(x) * sin_signed
    (the sign lives in the table), three kernels instead of five.
    x: (N, H, D); cos/sin_signed: (N, 1, D)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)
