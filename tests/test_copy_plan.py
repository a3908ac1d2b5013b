"""A ring unit is one plain copy per sequence: the host cache and the slots keep each row's K
codes and V codes side by side, (ctx, 2, H, row_bytes) per sequence, so a chunk's rows of K and
V are one run of bytes, one cudaMemcpyAsync on the pinned queue, one pair on the staged ones."""

import ctypes

import pytest
import torch

from kvferry.config import KVConfig
from kvferry.kv.cache import Batch, KVSpec
from kvferry.transport import cudart
from kvferry.transport.host_cache import HostKVCache

CUDA = torch.cuda.is_available()


def _spec(num_seqs=2):
    return KVSpec(num_layers=2, num_seqs=num_seqs, ctx=256, num_kv_heads=2, head_dim=16, kv_type="f16",
                  chunk_rows=64)


def _submitted(cache, batch):
    """The pairs of every delivery job the first decode pass submits."""
    seen = []
    submit = cache.deliver.submit

    def spy(pairs, *a, **k):
        seen.append(list(pairs))
        return submit(pairs, *a, **k)
    cache.deliver.submit = spy
    try:
        cache.begin(batch)
    finally:
        cache.deliver.submit = submit
    return seen


@pytest.mark.parametrize("pinned", [True, False])
def test_a_unit_is_one_copy_per_sequence(pinned):
    spec = _spec()
    cache = HostKVCache(spec, KVConfig(offload=True, pinned=pinned, depth=1), torch.device("cpu"), torch.float32,
                        progress=False)
    try:
        # K and V of a layer are one allocation: a row's V codes follow its K codes
        row = spec.num_kv_heads * spec.row_bytes
        for layer in range(spec.num_layers):
            k, v = cache.host_k[layer], cache.host_v[layer]
            assert v.data_ptr() - k.data_ptr() == row and k.stride(1) == 2 * row
        for s in range(2):
            cache.seq_lens[s] = 100
        jobs = _submitted(cache, Batch([0, 1], [100, 100], [1, 1]))
        assert jobs, "no delivery was issued"
        sizes = []
        for pairs in jobs:
            assert len(pairs) == 2, "a unit of two sequences is not one copy per sequence"
            for dst, src in pairs:
                assert dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape
                sizes.append(src.nbytes)
        assert set(sizes) == {64 * 2 * row}  # the first unit: chunk 0's 64 rows, K and V
    finally:
        cache.end()
        cache.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("max_pitch", [None, 0])
def test_memcpy_rows_on_cuda(max_pitch):
    # one 2D copy, and the row-by-row fallback where a pitch is over the device's limit
    mc = cudart.Memcpy()
    if max_pitch is not None:
        mc.max_pitch = max_pitch
    host = torch.randint(0, 255, (1000, 24), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(300, 2, 24, dtype=torch.uint8, device="cuda")  # rows of a slot: K, V
    stream = torch.cuda.current_stream()
    mc.rows(dev[10].data_ptr(), 48, host[500].data_ptr(), 24, 24, 250, stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(dev[10:260, 0].cpu(), host[500:750])
    assert not dev[:, 1].any() and not dev[:10].any() and not dev[260:].any(), "the copy wrote past its rows"
    mc(dev[:200].view(-1), host[100:500].view(-1), stream.cuda_stream)  # contiguous: one plain copy
    stream.synchronize()
    assert torch.equal(dev[:200].cpu().view(-1), host[100:500].view(-1))
    with pytest.raises(ValueError, match="contiguous operands of one size"):
        mc(dev[:, 0], host[:300], stream.cuda_stream)


class _HostMemcpy:
    """cudart.Memcpy.linear and .rows on CPU memory (ctypes.memmove): the late writes' address
    arithmetic (HostKVCache._copy_late, CUDA only) checked where CI runs. `skew` bytes off
    the source: the negative control."""

    def __init__(self, skew=0):
        self.skew, self.calls = skew, 0

    def linear(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src + self.skew, nbytes)
        self.calls += 1

    def rows(self, dst, dpitch, src, spitch, width, height, stream):
        for i in range(height):
            ctypes.memmove(dst + i * dpitch, src + self.skew + i * spitch, width)
        self.calls += 1


@pytest.mark.parametrize("np_", [1, 2])
def test_late_writes_from_addresses_match_the_slice_copies(np_):
    import conftest
    from conftest import make_engine
    from kvferry.config import SamplingConfig

    def run(memcpy):
        eng = make_engine(ctx_size=160, num_seqs=np_, kv=dict(offload=True, depth=1, chunk_rows=24))
        old = eng.cache
        eng.cache = HostKVCache(eng.kv_spec, eng.cfg.kv, eng.device, eng.dtype, progress=False)
        eng.cache._memcpy = memcpy
        try:
            prompts = [eng.tokenizer.encode(f"Name {n} rivers and a bird:") for n in ("three", "five")[:np_]]
            steps = list(eng.generate_batch(prompts, 12, SamplingConfig(temperature=0), stop_at_eog=False))
        finally:
            eng.cache.close()
            eng.cache = old
        return steps

    ref = run(None)  # write_rows' slice copies
    if CUDA and conftest.DEVICE == "cuda":  # the runtime's copies on the compute stream
        assert run(cudart.Memcpy()) == ref
        return
    fake = _HostMemcpy()
    assert run(fake) == ref and fake.calls >= 2 * 11 * np_, "the late writes did not go through the addresses"
    assert run(_HostMemcpy(skew=16)) != ref, "a late write from the wrong address went unnoticed"
