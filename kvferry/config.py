"""Frozen run configuration. The CLI maps flags onto these in one place (args.py);
__post_init__ validates, raising KvferryError with a message that says what to change.

Must not import torch: the CLI validates flags through these before any slow import."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvferry import KvferryError

# KV encodings by name; kv/quant.py implements each (a test keeps the two lists equal)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "fp8")
SPLIT_MODES = ("none", "tensor", "layer")


@dataclass(frozen=True)
class KVConfig:
    kv_type: str = "auto"  # auto = the compute dtype; f32 f16 bf16 q8_0 q4_0 fp8
    offload: bool = False  # -nkvo: keep the KV cache in host memory
    pinned: bool = True  # host cache in pinned (page-locked) memory
    # -kvpd: look-ahead of the pipelined transport, 0 = ordered. 2, not 1: with one unit queued
    # ahead, any pause of the host (an HTTP loop, Python) between issuing copies idles the link.
    # H100, 8B shape, batch 1, `kvferry bench -nkvo 1 -kvpd 1,2` in one process: 4k 92.6/94.1%
    # -> 95.3/96.3% of the link bound; 16k q4_0 92.4 -> 95.2%, fp8 94.9 -> 96.8% (2026-12-06).
    # The ring then has 4 slots, not 3; where only 3 fit, ring_plan runs depth 1.
    depth: int = 2
    # -kvpb: cap on the ring's device memory in MiB, 0 = no cap, or "auto" (a share of the
    # device's memory, transport/ring.RING_SHARE)
    budget_mib: float | str = "auto"
    # rows of one attention/delivery chunk (bounds the ring); "auto": kv/quant.chunk_rows
    chunk_rows: int | str = "auto"
    debug: int = 0  # --kv-debug 0/1/2
    staging_cap_mib: int = 64  # cap of the pinned staging buffer for pageable copies
    # --kv-device-budget: device MiB for the oldest chunks of a host cache (read in place,
    # never ferried), or "auto" (what is free after weights, ring and headroom); 0 = none
    device_budget_mib: float | str = 0.0

    def __post_init__(self):
        if self.kv_type != "auto" and self.kv_type not in KV_TYPES:
            raise KvferryError(f"unknown KV type '{self.kv_type}' (choose one of: auto, {', '.join(KV_TYPES)})")
        if self.depth < 0:
            raise KvferryError(f"-kvpd must be >= 0 (0 = ordered), got {self.depth}")
        b = self.budget_mib
        if b != "auto" and (isinstance(b, str) or not math.isfinite(b) or b < 0):
            raise KvferryError(f"-kvpb must be MiB >= 0 (0 = no cap) or auto, got '{b}'")
        if self.chunk_rows != "auto" and (isinstance(self.chunk_rows, str) or self.chunk_rows < 1):
            raise KvferryError(f"--kv-chunk must be >= 1 row or auto, got '{self.chunk_rows}'")
        if self.debug not in (0, 1, 2):
            raise KvferryError(f"--kv-debug must be 0, 1 or 2, got {self.debug}")
        b = self.device_budget_mib
        if b != "auto" and (isinstance(b, str) or not math.isfinite(b) or b < 0):
            raise KvferryError(f"--kv-device-budget must be MiB >= 0 or auto, got '{b}'")
        if b != 0 and not self.offload:
            raise KvferryError("--kv-device-budget keeps part of a host KV cache on the device: add -nkvo "
                               "(without it the whole cache is on the device)")
        if self.staging_cap_mib < 1:
            raise KvferryError(f"--staging-cap must be >= 1 MiB, got {self.staging_cap_mib}")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: a random seed

    def __post_init__(self):
        for name, v in (("--temp", self.temperature), ("--top-p", self.top_p), ("--min-p", self.min_p)):
            if not math.isfinite(v):
                raise KvferryError(f"{name} must be a finite number, got {v}")
        if not -1 <= self.seed < 2**63:
            raise KvferryError(f"-s/--seed must be -1 (random) or in [0, 2^63), got {self.seed}")
        if self.temperature < 0:
            raise KvferryError(f"--temp must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise KvferryError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvferryError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise KvferryError(f"--min-p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path to a .gguf file or an HF model directory; None = default
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (bf16 on cuda, f32 on cpu), f32, f16, bf16
    ctx_size: int = 4096  # -c: positions per sequence
    num_seqs: int = 1  # -np: sequences decoded together
    ubatch: int = 512  # prompt tokens per forward pass during prefill
    flash_attn: bool = True  # -fa: fused attention kernel per KV chunk where the device has one
    cuda_graphs: bool = True  # --cuda-graphs: decode replays CUDA graphs for the fixed-shape parts
    kv: KVConfig = KVConfig()
    split_mode: str = "none"  # -sm: none (one device), tensor (by KV head) or layer (by layer range)
    split_ratios: tuple[float, ...] = ()  # -ts: one share per rank; () = as even as the heads/layers allow

    def __post_init__(self):
        if self.split_mode not in SPLIT_MODES:
            raise KvferryError(f"-sm must be one of {', '.join(SPLIT_MODES)}; got '{self.split_mode}'")
        if self.split_ratios and (any(not math.isfinite(r) or r < 0 for r in self.split_ratios)
                                  or not sum(self.split_ratios) > 0):
            raise KvferryError(f"-ts expects non-negative shares with a positive sum, got "
                               f"{','.join(f'{r:g}' for r in self.split_ratios)}")
        if self.split_ratios and self.split_mode == "none":
            raise KvferryError("-ts sets the shares of a split run: add -sm tensor or -sm layer")
        if self.ctx_size < 1:
            raise KvferryError(f"-c/--ctx-size must be >= 1, got {self.ctx_size}")
        if self.num_seqs < 1:
            raise KvferryError(f"-np must be >= 1, got {self.num_seqs}")
        if self.ubatch < 1:
            raise KvferryError(f"--ubatch must be >= 1, got {self.ubatch}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise KvferryError(f"--device must be cpu, cuda or cuda:N; got '{self.device}'")
        if self.dtype not in ("auto", "f32", "f16", "bf16"):
            raise KvferryError(f"--dtype must be one of auto, f32, f16, bf16; got '{self.dtype}'")
