"""Token sampling: greedy, or top-k -> top-p -> min-p -> temperature (llama.cpp's chain
order), drawn from a seeded generator on the host so a seed fixes the output."""

from __future__ import annotations

import random

import torch

from kvferry.config import SamplingConfig


class Sampler:
    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
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
        probs = torch.softmax(vals / cfg.temperature, -1)
        return int(idx[torch.multinomial(probs, 1, generator=self.gen)])
