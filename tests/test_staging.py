"""The staging queues (kvferry/transport/staging.py): the compiled worker and the Python loop,
on CPU (where the Python loop's "DMA" runs on a stand-in copy thread) and on CUDA when present.

Each protection has a negative control that turns it off and shows the same check then fails:
the per-half wait, the gates that order a job after the events it depends on.
"""

import threading
import time

import pytest
import torch

from kvferry.transport import staging
from kvferry.transport.pump import load_pump
from kvferry.transport.staging import NativeQueue, PyStagedQueue, StagedQueues, StagingBuffer, chunk_bytes

CPU = torch.device("cpu")
CAP = 64 << 10
OFF = 4096 + 12  # unaligned byte offset of the copied range inside a larger buffer
GUARD = 4096 + 100
DEVICES = [CPU] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
KINDS = ["native", "python"]


def _queues(kind, device=CPU, cap=CAP, min_chunk=None):
    if kind == "native" and load_pump(device.type == "cuda") is None:
        pytest.skip("the compiled copy worker could not be built here (no C compiler?)")
    q = StagedQueues(device, cap, python=kind == "python")
    if min_chunk:
        for x in (q.h2d, q.d2h):
            x.min_chunk = min_chunk
    return q


def _random_bytes(n: int, seed: int, device=CPU) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _framed(n, seed, device=CPU):
    outer = _random_bytes(OFF + n + GUARD, seed, device)
    return outer, outer[OFF:OFF + n]


def _round_trip(q: StagedQueues, n: int, seed: int) -> bool:
    """Host -> device -> host through the queues; guard bytes around each range must stay."""
    src_outer, src = _framed(n, seed)
    dev_outer, dev = _framed(n, seed + 1, q.device)
    back_outer, back = _framed(n, seed + 2)
    before = [x.clone() for x in (src_outer, dev_outer, back_outer)]
    q.upload(dev, src)
    done = q.d2h.event("back")
    q.d2h.submit([(back, dev)], signal=done)
    done.wait_host(done.armed)
    q.fence()
    assert q.buffer.pinned_bytes <= q.buffer.cap_bytes and q.buffer.peak_bytes <= q.buffer.cap_bytes
    assert torch.equal(src_outer, before[0]), "the source was modified"
    for outer, b in ((dev_outer, before[1]), (back_outer, before[2])):
        assert torch.equal(outer[:OFF], b[:OFF]) and torch.equal(outer[OFF + n:], b[OFF + n:]), "a guard byte changed"
    return torch.equal(dev.cpu(), src) and torch.equal(back, src)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [CAP, CAP + 1, 2 * CAP + 12_345])
def test_round_trip_at_any_size_stays_within_the_cap(kind, device, n):
    q = _queues(kind, device, min_chunk=4096)  # small chunks: many of them through small halves
    try:
        assert _round_trip(q, n, seed=n)
    finally:
        q.close()


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_large_chunks_split_over_memcpy_threads_keep_every_byte(device):
    """Chunks of MiBs: the compiled worker cuts each into per-thread pieces (non-temporal
    stores, an unaligned head and tail), in both directions."""
    q = _queues("native", device, cap=16 << 20)
    try:
        assert _round_trip(q, (5 << 20) + 12_345, seed=7)
    finally:
        q.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_small_copy_does_not_allocate_the_cap(kind):
    q = _queues(kind, cap=64 << 20)
    try:
        assert _round_trip(q, 5000, seed=1)
        assert 0 < q.buffer.pinned_bytes <= 4 * 8192
    finally:
        q.close()


def test_chunk_plan():
    MiB = 1 << 20
    assert chunk_bytes(1 * MiB, 24 * MiB) == 1 * MiB  # one chunk: never more than the copy
    assert chunk_bytes(64 * MiB, 24 * MiB) == staging.MIN_CHUNK  # at least SPLIT chunks of MIN_CHUNK
    assert chunk_bytes(4096 * MiB, 24 * MiB) == 24 * MiB  # at most a half
    assert chunk_bytes(10_000, 24 * MiB, 4096) == 4096  # whole pages
    buf = StagingBuffer(CPU, 64 * MiB)
    assert buf.h2d.half_cap == 24 * MiB and buf.d2h.half_cap == 8 * MiB
    for cap in (0, -2, 4097, 1.5, True):
        with pytest.raises(ValueError):
            StagingBuffer(CPU, cap)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_pairs_are_refused_before_anything_is_queued(kind):
    q = _queues(kind)
    try:
        a, b = torch.zeros(100, dtype=torch.uint8), torch.zeros(101, dtype=torch.uint8)
        with pytest.raises(ValueError, match="size mismatch"):
            q.h2d.submit([(a, b)])
        with pytest.raises(ValueError, match="contiguous"):
            q.h2d.submit([(torch.zeros(10, 10, dtype=torch.uint8).t(), torch.zeros(100, dtype=torch.uint8))])
        assert _round_trip(q, 3000, seed=3)  # the queue still works
    finally:
        q.close()


def test_the_python_half_wait_is_what_keeps_data_intact():
    n = 16 * 4096 + 77  # many chunks through the small halves

    def trip(skip: bool, seed: int) -> bool:
        buf = StagingBuffer(CPU, 4 * 8192)
        q = PyStagedQueue(buf.h2d, True, min_chunk=4096, _unsafe_skip_half_wait=skip)
        q._dma.delay_s = (0.0, 0.002)  # the stand-in copy engine runs late
        src, dst = _random_bytes(n, seed), torch.zeros(n, dtype=torch.uint8)
        try:
            q.submit([(dst, src)])
            q.fence()
        finally:
            q.close()
        return torch.equal(dst, src)

    assert any(not trip(True, seed) for seed in range(5)), "skipping the half wait went unnoticed"
    assert all(trip(False, seed) for seed in range(3))


@pytest.mark.parametrize("kind", KINDS)
def test_jobs_wait_for_their_gates_and_run_in_order(kind):
    """A job waits until the events it depends on are marked, jobs behind it wait too, and
    each job's signal is marked once it has run; the caller never blocks on submit."""
    q = _queues(kind)
    try:
        gate = q.h2d.event("gate")
        gen = gate.arm()  # promised, not yet marked: the copy must wait
        srcs = [_random_bytes(3000, s) for s in range(3)]
        dst = torch.zeros(3000, dtype=torch.uint8)
        sigs = [q.h2d.event(f"s{i}") for i in range(3)]
        t0 = time.perf_counter()
        q.h2d.submit([(dst, srcs[0])], waits=[gate], signal=sigs[0])
        for i in (1, 2):  # later copies into the same bytes: order decides what stays
            q.h2d.submit([(dst, srcs[i])], signal=sigs[i])
        assert time.perf_counter() - t0 < 0.5, "submit blocked"
        time.sleep(0.1)
        assert [s.done for s in sigs] == [0, 0, 0] and not dst.any(), "a job ran before its gate"
        gate.mark(gen)
        sigs[2].wait_host(1)
        assert [s.done for s in sigs] == [1, 1, 1] and torch.equal(dst, srcs[2])
    finally:
        q.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_gate_marked_from_another_thread_releases_the_job(kind):
    q = _queues(kind)
    try:
        gate = q.h2d.event("gate")
        gen = gate.arm()
        src, dst = _random_bytes(5000, 9), torch.zeros(5000, dtype=torch.uint8)
        sig = q.h2d.event("sig")
        q.h2d.submit([(dst, src)], waits=[gate], signal=sig)
        threading.Timer(0.05, gate.mark, args=(gen,)).start()
        sig.wait_host(1)
        assert torch.equal(dst, src)
    finally:
        q.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_copies_wait_for_the_events_they_depend_on(kind):
    """The copy stream waits for the producer's CUDA event: a write-back of a tensor that a slow
    kernel is still producing reads the finished values. Negative control: without the wait the
    copy reads the tensor early."""
    from kvferry.transport.events import Compute
    dev = torch.device("cuda", 0)

    def trip(wait: bool) -> bool:
        q = _queues(kind, dev, cap=8 << 20)
        try:
            x = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
            ev = q.d2h.event("produced")
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the values exist
            x.fill_(7)
            Compute(dev).record(ev)
            out = torch.zeros(1 << 20, dtype=torch.uint8)
            done = q.d2h.event("done")
            q.d2h.submit([(out, x)], waits=[ev] if wait else [], signal=done)
            done.wait_host(1)
            q.fence()
            return bool((out == 7).all())
        finally:
            q.close()

    assert trip(True)
    assert not trip(False), "the copy did not need the wait: the test shows nothing"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_native_and_python_queues_move_the_same_bytes():
    dev = torch.device("cuda", 0)
    src = _random_bytes((40 << 20) + 123, 4)
    outs = []
    for kind in KINDS:
        q = _queues(kind, dev)
        try:
            d = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
            q.upload(d, src)
            outs.append(d.cpu())
        finally:
            q.close()
    assert torch.equal(outs[0], src) and torch.equal(outs[1], src)


def test_native_queue_is_the_default_where_it_builds():
    q = StagedQueues(CPU, CAP)
    try:
        want = NativeQueue if load_pump(False) is not None else PyStagedQueue
        assert isinstance(q.h2d, want) and isinstance(q.d2h, want)
    finally:
        q.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ring_queue_copies_bytes_after_its_waits():
    """The pinned ring's queue (StreamQueue: runtime memcpys on its copy stream) moves unaligned
    ranges both ways and waits for the events it is given (negative control: without the wait
    it reads a tensor a slow kernel is still producing); a strided tensor is refused."""
    from kvferry.transport import hostmem
    from kvferry.transport.events import Compute
    from kvferry.transport.queues import StreamQueue
    dev = torch.device("cuda", 0)
    host = hostmem.alloc_host(4 << 20)
    unpin = hostmem.pin(host, "test")
    q = StreamQueue(dev)
    try:
        src = _random_bytes(1 << 20, 3)
        host[OFF:OFF + src.numel()].copy_(src)
        d = torch.zeros(2 << 20, dtype=torch.uint8, device=dev)
        done = q.event("done")
        q.submit([(d[OFF:OFF + src.numel()], host[OFF:OFF + src.numel()])], signal=done)
        q.fence()
        assert torch.equal(d[OFF:OFF + src.numel()].cpu(), src) and not d[:OFF].any()

        def trip(wait: bool) -> bool:
            x = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
            ev = q.event("produced")
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the values exist
            x.fill_(7)
            Compute(dev).record(ev)
            out = host[2 << 20:(2 << 20) + x.numel()]
            out.zero_()
            q.submit([(out, x)], waits=[ev] if wait else [], signal=done)
            q.fence()
            torch.cuda.synchronize()
            return bool((out == 7).all())

        assert trip(True)
        assert not trip(False), "the copy did not need the wait: the test shows nothing"
        with pytest.raises(ValueError, match="contiguous"):
            q.submit([(d[:1024:2], host[:512])])
    finally:
        q.close()
        unpin()
