"""A ring unit's K and V travel as one copy: the host cache and the slots keep a layer's K and V
rows of a sequence in one allocation, two rows at a pitch (cudart.pitched), which the pinned
queue issues as one cudaMemcpy2DAsync and the staged queues split into contiguous rows."""

import ctypes

import pytest
import torch

from kvferry.config import KVConfig
from kvferry.kv.cache import Batch, KVSpec
from kvferry.transport import cudart
from kvferry.transport.host_cache import HostKVCache
from kvferry.transport.queues import split_rows

CUDA = torch.cuda.is_available()


def _spec(num_seqs=2):
    return KVSpec(num_layers=2, num_seqs=num_seqs, ctx=256, num_kv_heads=2, head_dim=16, kv_type="f16",
                  chunk_rows=64)


def test_pitched_reads_rows_at_a_pitch():
    kv = torch.zeros(3, 2, 10, 4, 8, dtype=torch.uint8)  # (seqs, K/V, rows, H, row bytes)
    assert cudart.pitched(kv[1]) == (kv[1].data_ptr(), 10 * 32, 10 * 32, 2)  # contiguous: pitch = width
    assert cudart.pitched(kv[1].view(-1)) == (kv[1].data_ptr(), 2 * 10 * 32, 2 * 10 * 32, 1)
    unit = kv[1][:, :6]  # six rows of K and of V
    assert cudart.pitched(unit) == (unit.data_ptr(), 10 * 32, 6 * 32, 2)
    with pytest.raises(ValueError, match="rows along dim 0"):
        cudart.pitched(kv[1][:, :, :, ::2])  # no contiguous row


def test_split_rows_gives_contiguous_pairs():
    a = torch.arange(2 * 10 * 8, dtype=torch.uint8).view(2, 10, 8)
    b = torch.zeros(2, 6, 8, dtype=torch.uint8)
    pairs = split_rows([(b[:, :4], a[:, 2:6]), (b[0, 4:], a[0, :2])])
    assert len(pairs) == 3 and all(d.is_contiguous() and s.is_contiguous() for d, s in pairs)
    for d, s in pairs:
        d.copy_(s)
    assert torch.equal(b[:, :4], a[:, 2:6]) and torch.equal(b[0, 4:], a[0, :2])


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
        # K and V of a layer are one allocation: V's rows of a sequence follow its K rows
        per_seq = spec.ctx * spec.num_kv_heads * spec.row_bytes
        for layer in range(spec.num_layers):
            k, v = cache.host_k[layer], cache.host_v[layer]
            assert v.data_ptr() - k.data_ptr() == per_seq and k.stride(0) == 2 * k[0].numel()
        for s in range(2):
            cache.seq_lens[s] = 100
        jobs = _submitted(cache, Batch([0, 1], [100, 100], [1, 1]))
        assert jobs, "no delivery was issued"
        for pairs in jobs:
            assert len(pairs) == 2, "a unit of two sequences is not one copy per sequence"
            for dst, src in pairs:
                _, spitch, width, height = cudart.pitched(src)
                assert height == 2 and spitch == per_seq and width == 64 * spec.num_kv_heads * spec.row_bytes
                assert dst.shape == src.shape  # a whole slot's rows: contiguous, one plain copy on CUDA
    finally:
        cache.end()
        cache.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("max_pitch", [None, 0])
def test_memcpy_pitched_on_cuda(max_pitch):
    # one 2D copy, and the row-by-row fallback where a pitch is over the device's limit
    mc = cudart.Memcpy()
    if max_pitch is not None:
        mc.max_pitch = max_pitch
    host = torch.randint(0, 255, (2, 1000, 24), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(2, 300, 24, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    mc(dev[:, :250], host[:, 500:750], stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(dev[:, :250].cpu(), host[:, 500:750])
    assert not dev[:, 250:].any(), "the copy wrote past its rows"
    mc(dev, host[:, 100:400], stream.cuda_stream)  # a whole slot (contiguous) from rows at a pitch
    stream.synchronize()
    assert torch.equal(dev.cpu(), host[:, 100:400])
    with pytest.raises(ValueError, match="one size"):
        mc(dev[:, :250], host[:, :249], stream.cuda_stream)


class _HostMemcpy:
    """cudart.Memcpy.linear on CPU memory (ctypes.memmove): the late writes' address
    arithmetic (HostKVCache._copy_late, CUDA only) checked where CI runs. `skew` bytes off
    the source: the negative control."""

    def __init__(self, skew=0):
        self.skew, self.calls = skew, 0

    def linear(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src + self.skew, nbytes)
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
