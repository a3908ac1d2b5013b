"""Token sampling: greedy, or top-k -> top-p -> min-p -> temperature (llama.cpp's chain
order), drawn from a seeded generator on the host so a seed fixes the output."""

from __future__ import annotations

import math
import random

import torch

from kvferry import KvferryError
from kvferry.config import SamplingConfig

_SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value


class Sampler:
    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        # SamplingConfig checks ranges; NaN and inf slip through comparisons, so check here
        for flag, v in (("--temp", cfg.temperature), ("--top-p", cfg.top_p), ("--min-p", cfg.min_p)):
            if not math.isfinite(v):
                raise KvferryError(f"{flag} must be a finite number, got {v}")
        if cfg.seed > _SEED_MAX:
            raise KvferryError(f"--seed must be at most {_SEED_MAX} (or -1 for a random seed), got {cfg.seed}")
        seed = cfg.seed if cfg.seed >= 0 else random.SystemRandom().randrange(2**31)
        self.seed = seed
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (vocab,) float32 on any device."""
        cfg = self.cfg
        if cfg.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu()
        if cfg.top_k > 0 and cfg.top_k < logits.numel():
            vals, idx = torch.topk(logits, cfg.top_k)
        else:
            vals, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(vals, -1)
        keep = probs.numel()
        if cfg.top_p < 1.0:
            cum = torch.cumsum(probs, -1)
            keep = min(keep, int(torch.searchsorted(cum, torch.tensor([cfg.top_p])).item()) + 1)
        if cfg.min_p > 0.0:
            keep = min(keep, max(1, int((probs >= cfg.min_p * probs[0]).sum())))
        vals, idx = vals[:keep], idx[:keep]
        # temperature on the gaps below the top logit, in float64: any temperature > 0 then
        # gives finite values (a tiny one leaves 0 for the top tokens and -inf for the rest)
        probs = torch.softmax((vals.double() - vals[0].double()) / cfg.temperature, -1)
        return int(idx[torch.multinomial(probs, 1, generator=self.gen)])
