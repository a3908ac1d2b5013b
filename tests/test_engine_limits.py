"""The engine's limits, checked before anything is allocated: a context longer than the
model was trained on runs with one warning; a KV cache that host memory cannot hold is
refused with its size, the machine's memory and what to lower."""

import logging

import pytest
import torch

from gguf_factory import CTX, write_spm_llama
from kvferry import KvferryError
from kvferry.config import EngineConfig, KVConfig


def test_context_beyond_training_warns_once_and_runs(tmp_path, caplog):
    from kvferry.engine.generation import Engine
    path = write_spm_llama(tmp_path / "tiny.gguf")
    for ctx, warned in ((CTX, False), (CTX + 1, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvferry"):
            eng = Engine(EngineConfig(model=path, device="cpu", ctx_size=ctx), progress=False)
        eng.close()
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == warned, lines
        if warned:
            assert f"-c {CTX + 1}" in lines[0] and f"the {CTX} positions" in lines[0]


def test_kv_cache_beyond_host_memory_is_refused_before_allocation(monkeypatch):
    from kvferry.engine import runner
    from kvferry.transport import hostmem
    from kvferry.kv.cache import KVSpec
    gib = 2**30
    monkeypatch.setattr(hostmem, "memory_bytes", lambda: (4 * gib, gib // 2))
    # 2 layers x 1M rows x 2 heads x (64 f16 values = 128 bytes) x K and V: 1 GiB
    big = KVSpec(num_layers=2, num_seqs=1, ctx=1 << 20, num_kv_heads=2, head_dim=64, kv_type="f16", chunk_rows=8192)
    assert big.total_bytes == gib
    run = runner.ModelRunner.__new__(runner.ModelRunner)  # placement only: no model needed
    run.device, run.dtype, run._staged, run._staging_cap = torch.device("cpu"), torch.float32, None, 1 << 20
    for offload in (True, False):  # host cache, and a device-resident cache whose device is the CPU
        with pytest.raises(KvferryError, match=r"needs 1.0 GiB \(1073741824 bytes.* 4.0 GiB of memory, 0.5 GiB of it available: lower -c"):
            run.make_cache(big, KVConfig(offload=offload))
    small = KVSpec(num_layers=2, num_seqs=1, ctx=16, num_kv_heads=2, head_dim=64, kv_type="f16", chunk_rows=8)
    run.make_cache(small, KVConfig())  # fits: made
    runner.check_host_memory(big, KVConfig(), torch.device("cuda"))  # GPU memory: not host memory's business
