"""The model runner: where and how the model runs.

Owns the device and compute dtype, the device's staging queues (weight uploads and the
pageable host KV cache's copies all go through them: transport/staging.py), the weights'
placement (the upload function it hands the loader), the transformer, its CUDA graphs for
decode passes, and making KV caches for it. In a split run (-sm tensor / layer) it also
holds this rank's place (engine/distributed.py): the rank's device, its share of the
weights, the model's collectives, and the agreement on each cache's ring and resident
chunks. The model package knows none of this: it is plain math on tensors that are already
where they belong.
"""

from __future__ import annotations

import logging

import torch

from kvferry import KvferryError
from kvferry.config import EngineConfig, KVConfig
from kvferry.kv.cache import Batch, DeviceKVCache, KVCache, KVSpec
from kvferry.model.arch import ModelConfig
from kvferry.model.loader import LoadedModel, load_model, random_weights
from kvferry.model.transformer import Transformer
from kvferry.transport import hostmem
from kvferry.transport.staging import StagedQueues

log = logging.getLogger(__name__)
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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


class ModelRunner:
    """`path` a model file or directory; or `model_cfg` for random weights of that shape.
    `share`: another runner on the same device and dtype whose weights and staging to reuse."""

    def __init__(self, cfg: EngineConfig, path: str | None = None, *, model_cfg: ModelConfig | None = None,
                 progress: bool = True, share: "ModelRunner | None" = None):
        self.dist = None
        if share is not None:
            self.dist = share.dist
        elif cfg.split_mode != "none":
            from kvferry.engine.distributed import Dist
            self.dist = Dist(cfg)
        self.device = self.dist.device if self.dist else resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self._staged, self._owns_staged = None, share is None
        self._staging_cap = cfg.kv.staging_cap_mib << 20
        if share is not None:
            if (share.device, share.dtype) != (self.device, self.dtype):
                raise KvferryError("a shared model needs the same device and dtype")
            self.loaded, self._staged = share.loaded, share.staged
        elif model_cfg is not None:
            self.loaded: LoadedModel = random_weights(model_cfg, self.device, self.dtype, progress=progress,
                                                      shard=self.dist.plan(model_cfg) if self.dist else None)
        else:
            log.info("loading %s", path)
            self.loaded = load_model(path, self.dtype, self._upload_fn(), progress,
                                     self.dist.plan if self.dist else None)
        shard = self.loaded.shard
        self.model = Transformer(shard.local_config(self.loaded.cfg) if shard else self.loaded.cfg, self.loaded.weights,
                                 self.device, self.dtype, cfg.flash_attn, comm=self.dist)
        if shard:
            log.info("rank %d of %d (-sm %s): KV heads %d-%d, MLP rows %d-%d, layers %d-%d", shard.rank,
                     shard.world_size, shard.mode, shard.kv_heads[0], shard.kv_heads[1] - 1, shard.ffn_rows[0],
                     shard.ffn_rows[1] - 1, shard.layers[0], shard.layers[1] - 1)
        self._graphs_ok = self.dist is None  # a split pass's collectives stay outside captured graphs
        self.use_graphs = cfg.cuda_graphs and self.device.type == "cuda" and self._graphs_ok
        self._graphs: dict = {}

    @property
    def staged(self) -> StagedQueues:
        """The device's staging buffer and its queues (made on first use)."""
        if self._staged is None:
            self._staged = StagedQueues(self.device, self._staging_cap)
        return self._staged

    @property
    def staging_pinned_bytes(self) -> int:
        """Bytes the staging buffer holds now (0 before its first use)."""
        return self._staged.buffer.pinned_bytes if self._staged is not None else 0

    def _upload_fn(self):
        if self.device.type != "cuda":
            return None  # the weights stay where the loader made them

        def upload(w: torch.Tensor) -> torch.Tensor:
            dst = torch.empty(w.shape, dtype=w.dtype, device=self.device)
            self.staged.upload(dst, w)
            return dst
        return upload

    def set_options(self, flash_attn: bool, cuda_graphs: bool) -> None:
        self.model.set_flash_attn(flash_attn)
        self.use_graphs = cuda_graphs and self.device.type == "cuda" and self._graphs_ok

    def agree_tokens(self, ids: list[int]) -> list[int]:
        """The tokens every rank continues with: rank 0's (as sampled here on one device)."""
        return self.dist.tokens(ids) if self.dist is not None and self.dist.world_size > 1 else ids

    # -- passes ------------------------------------------------------------------------------
    def forward(self, tokens, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Logits (B, vocab) at each sequence's last new token; decode passes (one token per
        sequence) replay CUDA graphs where they are on."""
        if self.use_graphs and all(c == 1 for c in batch.counts):
            return self._decode_graphs(batch.num_tokens, cache).run(tokens, batch, cache)
        return self.model.forward(tokens, batch, cache)

    def _decode_graphs(self, n: int, cache: KVCache):
        """A device-resident cache read by the decode kernel: one graph for the whole pass,
        captured per cache and batch size. Otherwise (a host cache, or -fa off) the
        segmented graphs, per batch size and KV type."""
        from kvferry.engine.graphs import DecodeGraphs, ResidentDecodeGraph
        resident = isinstance(cache, DeviceKVCache) and self.model.decode_kernel
        key = (n, cache.spec.kv_type, resident)
        g = self._graphs.get(key)
        if g is not None and resident and g.cache_ref() is not cache:
            # captured for an earlier cache: drop every graph of it (they hold no reference)
            self._graphs = {k: v for k, v in self._graphs.items() if not k[2]}
            g = None
        if g is None or g.max_pos < cache.spec.ctx - 1:
            if g is not None:  # a longer context needs longer RoPE tables: capture again
                self._graphs.clear()
            g = self._graphs[key] = (ResidentDecodeGraph(self.model, n, cache, cache.spec.ctx - 1) if resident else
                                     DecodeGraphs(self.model, n, cache.spec.kv_type, cache.spec.ctx - 1))
        return g

    # -- KV caches ----------------------------------------------------------------------------
    def make_cache(self, spec: KVSpec, kv: KVConfig, progress: bool = True) -> KVCache:
        check_host_memory(spec, kv, self.device)
        if not kv.offload:
            return DeviceKVCache(spec, self.device, self.dtype)
        from kvferry.transport.host_cache import HostKVCache
        # pageable copies go through the device's staging queues (also where pinning fails)
        return HostKVCache(spec, kv, self.device, self.dtype, progress=progress, staged=self.staged,
                           agree=self.agree)

    @property
    def agree(self):
        """A split run's ranks take placement decisions together (None on one device)."""
        return self.dist.agree if self.dist is not None and self.dist.world_size > 1 else None

    def close(self) -> None:
        if self._owns_staged and self._staged is not None:
            self._staged.close()
            self._staged = None
        if self._owns_staged and self.dist is not None:  # the runner that made the group ends it
            self.dist.close()


# ---------------------------------------------------------------------------- limits, checked before use
def check_host_memory(spec: KVSpec, kv: KVConfig, device) -> None:
    """Refuse a KV cache that host memory cannot hold, before allocating it (the allocator
    would fail with its own message, or the OOM killer end the process). A host cache lives
    there, and so does a device-resident one when the device is the CPU."""
    if not kv.offload and device.type != "cpu":
        return
    need = spec.total_bytes
    total, available = hostmem.memory_bytes()
    if need <= available:
        return
    gib = 2**30
    hint = "lower -c or -np" + (", or use a smaller -ctk (e.g. q8_0, q4_0)" if spec.kv_type != "q4_0" else "")
    raise KvferryError(
        f"the KV cache needs {need / gib:.1f} GiB ({need} bytes: -c {spec.ctx} x -np {spec.num_seqs} x "
        f"{spec.num_layers} layers x {spec.token_bytes} bytes of {spec.kv_type} K and V per token), but this "
        f"machine has {total / gib:.1f} GiB of memory, {available / gib:.1f} GiB of it available: {hint}")

