"""Tests for kvferry.transport.staging on CPU, where a worker thread plays the copy engine.

Every check here has a negative control that turns a protection off (the cap, the per-half
wait, the lock) and shows the same check then fails, so a green run means something.
"""

import contextlib
import threading

import pytest
import torch

from kvferry.transport.staging import (
    DEFAULT_H2D_SHARE,
    StagingBuffer,
    get_staging,
    release_staging,
    staging_pinned_bytes,
)

CPU = torch.device("cpu")
CAP = 64 << 10
OFF = 4096 + 12  # unaligned byte offset of the copied range inside a larger buffer
GUARD = 4096 + 100


@pytest.fixture(autouse=True)
def _fresh_registry():
    release_staging()
    yield
    release_staging()


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _framed(n: int, seed: int):
    """A buffer of random bytes and its n-byte view at OFF; bytes around it act as guards."""
    outer = _random_bytes(OFF + n + GUARD, seed)
    return outer, outer[OFF:OFF + n]


def _assert_capped(buf: StagingBuffer) -> None:
    assert buf.pinned_bytes <= buf.cap_bytes, (buf.pinned_bytes, buf.cap_bytes)
    assert buf.peak_bytes <= buf.cap_bytes, (buf.peak_bytes, buf.cap_bytes)


def _round_trip(buf: StagingBuffer, n: int, seed: int, check_cap: bool = True) -> bool:
    """Host -> "device" -> host through ``buf``; returns whether every byte arrived intact.

    Guard bytes and the source are checked with asserts: no variant may write outside the range.
    """
    src_outer, src = _framed(n, seed)
    dev_outer, dev = _framed(n, seed + 1)
    back_outer, back = _framed(n, seed + 2)
    src_before, dev_before, back_before = src_outer.clone(), dev_outer.clone(), back_outer.clone()

    buf.copy_to_device(dev, src)
    if check_cap:
        _assert_capped(buf)
    ok_dev = torch.equal(dev, src)
    assert torch.equal(src_outer, src_before), "the source was modified"
    assert torch.equal(dev_outer[:OFF], dev_before[:OFF])
    assert torch.equal(dev_outer[OFF + n:], dev_before[OFF + n:])

    buf.copy_to_host(back, dev)
    if check_cap:
        _assert_capped(buf)
    ok_back = torch.equal(back, dev)
    assert torch.equal(back_outer[:OFF], back_before[:OFF])
    assert torch.equal(back_outer[OFF + n:], back_before[OFF + n:])
    return ok_dev and ok_back and torch.equal(back, src)


@pytest.mark.parametrize("n", [CAP, CAP + 1, 2 * CAP + 12_345])
def test_round_trip_small_cap(n):
    buf = StagingBuffer(CPU, CAP)
    assert _round_trip(buf, n, seed=n)
    assert buf.pinned_bytes == CAP  # copies >= cap use exactly the cap


def test_cap_that_is_not_a_power_of_two():
    buf = StagingBuffer(CPU, 100_000)
    assert _round_trip(buf, 250_001, seed=11)
    assert buf.pinned_bytes == 100_000


def test_round_trip_real_cap_larger_than_cap():
    cap = 64 << 20
    buf = StagingBuffer(CPU, cap)
    assert _round_trip(buf, 2 * cap + 12_345, seed=7)
    assert buf.peak_bytes == cap


def test_round_trip_with_delays_and_mixed_dtypes():
    buf = StagingBuffer(CPU, 4096, _test_delay_s=0.001)
    src = torch.randn(3 * 1024 + 5, dtype=torch.float32)  # 12,308 bytes, several chunks
    raw = torch.zeros(16 + src.nbytes, dtype=torch.uint8)
    dev = raw[12:12 + src.nbytes].view(torch.int32)  # unaligned start, other dtype
    buf.copy_to_device(dev, src)
    assert torch.equal(dev.view(torch.float32), src)
    back = torch.empty_like(src)
    buf.copy_to_host(back, dev)
    assert torch.equal(back, src)
    assert torch.equal(raw[:12], torch.zeros(12, dtype=torch.uint8))


def test_small_copy_does_not_allocate_the_cap():
    buf = StagingBuffer(CPU, CAP)
    assert buf.pinned_bytes == 0  # lazy
    assert _round_trip(buf, 100, seed=1)
    assert buf.pinned_bytes == 2 * 2 * 4096 < CAP  # two directions of two 4 KiB halves
    assert _round_trip(buf, 5_000, seed=2)
    assert buf.pinned_bytes == 2 * 2 * 8192 < CAP
    assert _round_trip(buf, 100, seed=3)
    assert buf.pinned_bytes == 2 * 2 * 8192  # kept for reuse, not shrunk
    assert buf.peak_bytes == 2 * 2 * 8192


def test_one_direction_grows_alone():
    buf = StagingBuffer(CPU, CAP)
    buf.copy_to_device(torch.zeros(3 * CAP, dtype=torch.uint8), _random_bytes(3 * CAP, 4))
    assert buf.pinned_bytes == 2 * buf._half_cap(buf._h2d)  # only the host-to-device halves exist
    assert buf.pinned_bytes == 2 * (int(CAP * DEFAULT_H2D_SHARE) // 2)


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75, 0.9])
def test_direction_shares_stay_within_the_cap(share):
    buf = StagingBuffer(CPU, CAP, h2d_share=share)
    h2d, d2h = buf._half_cap(buf._h2d), buf._half_cap(buf._d2h)
    assert 2 * (h2d + d2h) <= CAP and h2d > 0 and d2h > 0
    assert _round_trip(buf, 2 * CAP + 12_345, seed=41)  # both directions, checks the cap too


@pytest.mark.parametrize("share", [0.0, 1.0, -0.5, 2])
def test_bad_share_is_refused(share):
    with pytest.raises(ValueError, match="h2d_share"):
        StagingBuffer(CPU, CAP, h2d_share=share)


def test_uncapped_variant_is_caught():
    # Red/green: the cap check used above must fail for a buffer that grows to the copy size.
    buf = StagingBuffer(CPU, CAP, _test_uncapped=True)
    with pytest.raises(AssertionError):
        _round_trip(buf, 2 * CAP + 12_345, seed=5)
    assert buf.pinned_bytes > CAP
    assert _round_trip(buf, 2 * CAP + 12_345, seed=6, check_cap=False)  # data is still right


@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_half_wait_is_what_keeps_data_intact(direction):
    n = 8 * 4096 + 77  # many chunks through the small halves of each direction

    def trip(skip: bool, seed: int) -> bool:
        buf = StagingBuffer(CPU, 8192, _test_delay_s=0.002, _test_skip_half_wait=skip)
        src = _random_bytes(n, seed)
        dst = torch.zeros(n, dtype=torch.uint8)
        (buf.copy_to_device if direction == "to_device" else buf.copy_to_host)(dst, src)
        return torch.equal(dst, src)

    # Negative control: without the wait a half is reused while the worker still needs it.
    assert any(not trip(True, seed) for seed in range(5)), "skipping the wait went unnoticed"
    assert all(trip(False, seed) for seed in range(3))


def _concurrent_round_trips(buf: StagingBuffer, trips: int = 4) -> list:
    results, barrier = [], threading.Barrier(2)

    def worker(tid: int) -> None:
        barrier.wait()
        for i in range(trips):
            try:
                results.append(_round_trip(buf, 3 * CAP + 1000 * tid + i, seed=100 * tid + i))
            except AssertionError:
                results.append(False)

    threads = [threading.Thread(target=worker, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_two_threads_share_one_buffer():
    buf = get_staging(CPU, CAP)
    assert get_staging("cpu") is buf
    buf._set_test_delay(0.001)
    results = _concurrent_round_trips(buf)
    assert results == [True] * 8
    _assert_capped(buf)
    assert staging_pinned_bytes() == buf.pinned_bytes == CAP


def test_without_the_lock_threads_corrupt_each_other():
    # Negative control for the test above: the lock is what keeps concurrent copies apart.
    for _ in range(3):
        buf = StagingBuffer(CPU, CAP, _test_delay_s=0.001)
        buf._h2d.lock = buf._d2h.lock = contextlib.nullcontext()
        if not all(_concurrent_round_trips(buf, trips=2)):
            return
    pytest.fail("two unlocked threads never corrupted each other")


def test_validation():
    for cap in (0, -2, 4097, 4098, 1.5, True):
        with pytest.raises(ValueError):
            StagingBuffer(CPU, cap)
    buf = StagingBuffer(CPU, 4096)
    with pytest.raises(ValueError, match="size mismatch"):
        buf.copy_to_device(torch.zeros(10, dtype=torch.uint8), torch.zeros(11, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        buf.copy_to_host(torch.zeros(4, 4).t(), torch.zeros(4, 4))
    buf.copy_to_device(torch.zeros(0), torch.zeros(0))  # empty copies are no-ops
    assert buf.pinned_bytes == 0
    old = get_staging(CPU, CAP)
    new = get_staging(CPU, 2 * CAP)  # another cap replaces the buffer
    assert new is not old and new.cap_bytes == 2 * CAP and get_staging(CPU) is new


def test_copies_smaller_than_a_half_are_split_into_chunks():
    # 40,000 bytes fit in one 64 KiB half, yet go through in `split` page-sized chunks so the
    # memcpy of one overlaps the DMA of the one before; the halves are only a chunk large.
    buf = StagingBuffer(CPU, 1 << 20, min_chunk_bytes=4096, split=4)
    assert buf._chunk(40_000, buf._h2d) == 12_288 and buf._chunk(4096, buf._h2d) == 4096
    assert _round_trip(buf, 40_000, seed=31)
    assert buf.pinned_bytes == 2 * 2 * 16_384
    big = StagingBuffer(CPU, 1 << 20)  # default minimum chunk: a small copy is one chunk
    assert big._chunk(40_000, big._h2d) == 40_000 and big._chunk(10 << 20, big._h2d) == big._half_cap(big._h2d) == (3 << 20) // 8


def test_split_chunks_need_the_half_wait_too():
    # Negative control for the sub-chunk path: chunks well below the half size still alternate
    # halves, and skipping the per-half wait corrupts them.
    def trip(skip: bool, seed: int) -> bool:
        buf = StagingBuffer(CPU, 1 << 20, min_chunk_bytes=4096, split=8,
                            _test_delay_s=0.002, _test_skip_half_wait=skip)
        src = _random_bytes(9 * 4096 + 5, seed)
        dst = torch.zeros_like(src)
        buf.copy_to_device(dst, src)
        return torch.equal(dst, src)

    assert any(not trip(True, seed) for seed in range(5)), "skipping the wait went unnoticed"
    assert all(trip(False, seed) for seed in range(3))


def test_copy_all_streams_several_pairs_through_one_lock():
    buf = StagingBuffer(CPU, CAP, _test_delay_s=0.0005)
    sizes = [0, 1, 4096 + 12, CAP // 4, 2 * CAP + 345]
    srcs = [_random_bytes(n, 40 + i) for i, n in enumerate(sizes)]
    devs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    buf.copy_all_to_device(list(zip(devs, srcs)))
    assert all(torch.equal(d, s) for d, s in zip(devs, srcs))
    backs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    buf.copy_all_to_host(list(zip(backs, devs)))
    assert all(torch.equal(b, s) for b, s in zip(backs, srcs))
    _assert_capped(buf)


@pytest.mark.parametrize("shared_lock", [False, True])
def test_a_write_back_does_not_wait_for_a_delivery(shared_lock):
    # The two directions have their own halves and lock, so a device-to-host copy runs while a
    # host-to-device copy holds its lock. Negative control: with one lock for both it blocks.
    buf = StagingBuffer(CPU, CAP)
    if shared_lock:
        buf._d2h.lock = buf._h2d.lock
    done = threading.Event()
    src, dst = _random_bytes(3 * CAP, 50), torch.zeros(3 * CAP, dtype=torch.uint8)
    with buf._h2d.lock:  # a delivery in progress
        t = threading.Thread(target=lambda: (buf.copy_to_host(dst, src), done.set()), daemon=True)
        t.start()
        finished = done.wait(timeout=5 if not shared_lock else 0.5)
    t.join(timeout=10)
    assert finished == (not shared_lock)
    assert torch.equal(dst, src)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("native", [None, False])  # None: the compiled pump where it loads
@pytest.mark.parametrize("cap", [CAP, 64 << 20])
@pytest.mark.parametrize("n_of_cap", [lambda cap: cap - 100, lambda cap: 2 * cap + 12_345])
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_round_trip_is_ordered_with_the_callers_stream(cap, n_of_cap, side_stream, native):
    # Slow kernels on both streams turn a missing stream-to-stream wait into wrong data. A copy
    # of two chunks or fewer returns with all of it in flight; longer ones have host waits inside
    # that can hide a missing wait, so it takes the whole matrix to catch each one.
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = StagingBuffer(dev, cap, native=native)
    n = n_of_cap(cap)
    stream = torch.cuda.Stream(dev) if side_stream else torch.cuda.current_stream(dev)
    with torch.cuda.stream(stream):
        src_outer, src = _framed(n, seed=21)
        expected = src.to(dev)
        dev_outer = _framed(n, seed=22)[0].to(dev)
        guards = dev_outer.clone()
        d = dev_outer[OFF:OFF + n]
        torch.cuda._sleep(50_000_000)
        d.zero_()  # queued behind a slow kernel: the copy must wait for it on the device
        with torch.cuda.stream(buf._h2d.stream):
            torch.cuda._sleep(50_000_000)  # keeps the copy in flight after copy_to_device returns
        buf.copy_to_device(d, src)
        assert torch.equal(d, expected)  # no host sync in between
        assert torch.equal(dev_outer[:OFF], guards[:OFF])
        assert torch.equal(dev_outer[OFF + n:], guards[OFF + n:])
        torch.cuda._sleep(50_000_000)
        d.add_(1)  # queued work that copy_to_host must wait for before reading
        back_outer, back = _framed(n, seed=23)
        back_before = back_outer.clone()
        buf.copy_to_host(back, d)
        assert torch.equal(back, src + 1)
        assert torch.equal(back_outer[:OFF], back_before[:OFF])
        assert torch.equal(back_outer[OFF + n:], back_before[OFF + n:])
    _assert_capped(buf)


@cuda_only
@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_cuda_event_ordered_copies_wait_and_record(direction):
    # The transport's path: the copy waits for an event recorded on another stream (not for
    # the caller's stream) and records an event the consumer waits on. Negative control: the
    # same copy without the wait reads or overwrites too early and the data is wrong.
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 3 * (8 << 20) + 12_345  # several chunks
    producer = torch.cuda.Stream(dev)

    def trip(with_wait: bool) -> bool:
        buf = StagingBuffer(dev, 16 << 20, min_chunk_bytes=1 << 20)
        src = _random_bytes(n, seed=51)
        ready, done = torch.cuda.Event(), torch.cuda.Event()
        if direction == "to_device":
            d = torch.zeros(n, dtype=torch.uint8, device=dev)
            with torch.cuda.stream(producer):
                torch.cuda._sleep(200_000_000)
                d.fill_(7)  # work on the destination that the copy must come after
                ready.record(producer)
            buf.copy_all_to_device([(d, src)], waits=[ready] if with_wait else [], record=done)
            # read after both the copy and the producer: a copy that did not wait for the
            # producer's write was overwritten by it
            torch.cuda.current_stream(dev).wait_event(done)
            torch.cuda.current_stream(dev).wait_event(ready)
            ok = torch.equal(d.cpu(), src)
        else:
            d = src.to(dev)
            with torch.cuda.stream(producer):
                torch.cuda._sleep(200_000_000)
                d.add_(1)  # the rows the copy must read only once written
                ready.record(producer)
            back = torch.zeros(n, dtype=torch.uint8)
            buf.copy_all_to_host([(back, d)], waits=[ready] if with_wait else [], record=done)
            done.synchronize()
            ok = torch.equal(back, src + 1)
        torch.cuda.synchronize(dev)
        buf.close()
        return ok

    assert trip(True)
    assert not trip(False), "a copy without the event wait went unnoticed"


@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_empty_event_ordered_copy_is_a_no_op_on_cpu(direction):
    # A delivery unit with no stable rows still goes through the copy call (it must record its
    # event on CUDA); on any device an empty list must not fail.
    buf = StagingBuffer(CPU, CAP)
    copy = buf.copy_all_to_device if direction == "to_device" else buf.copy_all_to_host
    copy([], waits=None, record=None)
    copy([(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8))])
    assert buf.pinned_bytes == 0


@cuda_only
@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_cuda_empty_event_ordered_copy_still_records_after_its_waits(direction):
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = StagingBuffer(dev, CAP)
    producer = torch.cuda.Stream(dev)
    ready, done = torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)
        ready.record(producer)
    copy = buf.copy_all_to_device if direction == "to_device" else buf.copy_all_to_host
    copy([], waits=[ready], record=done)
    assert not done.query()  # recorded behind the wait, not at once
    done.synchronize()
    assert ready.query()


def _pump_or_skip(cuda: bool):
    from kvferry.transport.native import load_pump
    if load_pump(cuda) is None:
        pytest.skip("the compiled staging pump could not be built here (no C compiler?)")


@pytest.mark.parametrize("mode", ["memcpy", "stream"])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("n", [CAP, CAP + 1, 2 * CAP + 12_345, 40 * CAP + 3])
def test_pump_copies_like_the_python_loop(n, threads, mode):
    # The compiled chunk pump walks the same chunks through the same halves as the Python loop:
    # every byte arrives, guards stay, the cap holds, and the chunk counts agree.
    _pump_or_skip(False)
    counts = {}
    for native in (True, False):
        buf = StagingBuffer(CPU, CAP, native=native)
        buf.pump_threads = threads
        buf.pump_copy = mode
        assert _round_trip(buf, n, seed=n + threads)
        counts[native] = buf.stats()["h2d"]["chunks"]
        assert buf.pinned_bytes == CAP
    assert counts[True] == counts[False] > 1


@pytest.mark.parametrize("mode", ["memcpy", "stream"])
def test_pump_memcpy_modes_copy_every_byte_at_any_alignment(mode):
    # The pump's memcpy on its own, at sizes around the threading (1 MiB) and line (64 B) edges
    # and at odd offsets of both ends: the streaming-store path has a head to a 64-byte line of
    # the destination, a body of whole lines and a tail, each of which must land exactly.
    _pump_or_skip(False)
    from kvferry.transport.native import load_pump
    pump = load_pump(False)
    sizes = [0, 1, 63, 255, 256, 257, 4096 + 65, (1 << 20) - 1, (1 << 20) + 4097, 3 * (1 << 20) + 13]
    for k, n in enumerate(sizes):
        for s_off, d_off in ((0, 0), (1, 63), (37, 5), (64, 0)):
            src = _random_bytes(n + 2 * GUARD, seed=k + s_off)
            dst = torch.zeros(n + 2 * GUARD, dtype=torch.uint8)
            a, b = GUARD + s_off, GUARD + d_off
            pump.copy(dst.data_ptr() + b, src.data_ptr() + a, n, 4, mode)
            assert torch.equal(dst[b:b + n], src[a:a + n]), (mode, n, s_off, d_off)
            assert not dst[:b].any() and not dst[b + n:].any(), (mode, n, s_off, d_off)


def test_pump_streams_several_pairs_and_alternates_halves():
    _pump_or_skip(False)
    buf = StagingBuffer(CPU, CAP, native=True)
    srcs = [_random_bytes(n, seed=n) for n in (5, CAP // 3, 3 * CAP + 7, 1)]
    dsts = [torch.zeros_like(s) for s in srcs]
    buf.copy_all_to_device(list(zip(dsts, srcs)))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    first = buf._h2d.next
    buf.copy_to_device(dsts[0], srcs[0])  # one chunk: the next copy starts in the other half
    assert buf._h2d.next == first ^ 1


@cuda_only
def test_cuda_pump_half_wait_is_what_keeps_data_intact():
    # With the DMAs held back by a slow kernel on the staging stream, the pump must wait for a
    # half's DMA before refilling it. Negative control: skipping that wait corrupts the copy.
    _pump_or_skip(True)
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 20 * (384 << 10) + 999  # many chunks through 384 KiB halves (1 MiB cap)

    def trip(skip: bool) -> bool:
        buf = StagingBuffer(dev, 1 << 20, native=True, _test_skip_half_wait=skip)
        src = _random_bytes(n, seed=5)
        dst = torch.zeros(n, dtype=torch.uint8, device=dev)
        torch.cuda._sleep(100_000_000)  # a single copy's DMAs queue on the caller's stream
        buf.copy_to_device(dst, src, synchronize=True)
        ok = torch.equal(dst.cpu(), src)
        buf.close()
        return ok

    assert not trip(True), "skipping the half wait went unnoticed"
    assert trip(False)


def test_worker_waits_for_its_gate_then_copies_in_order_off_the_caller():
    # The delivery worker (a C thread) holds a job until its gate counter reaches the job's
    # generation, then copies; jobs run in submission order; a Python-side copy on the same
    # buffer first lets the worker finish. The gate check is also the negative control: a
    # worker that ignored gates would have written before the gate was set.
    import ctypes
    import time

    _pump_or_skip(False)
    buf = StagingBuffer(CPU, CAP, native=True)
    n = 3 * CAP + 777
    a, b = _random_bytes(n, seed=1), _random_bytes(n, seed=2)
    dst = torch.zeros(n, dtype=torch.uint8)
    gate, sig = ctypes.c_longlong(0), ctypes.c_longlong(0)
    buf.submit_to_device([(dst, a)], gates=[(gate, 1)], signal=(sig, 1))
    buf.submit_to_device([(dst, b)], signal=(sig, 2))  # queued behind the gated job
    time.sleep(0.05)
    assert sig.value == 0 and not dst.any(), "the worker ran a job before its gate was set"
    gate.value = 1
    buf.wait_signal((sig, 2))
    assert torch.equal(dst, b), "jobs ran out of submission order"
    # a Python-side copy after queued jobs: they land first, then it does
    other = torch.zeros(n, dtype=torch.uint8)
    buf.submit_to_device([(dst, a)], signal=(sig, 3))
    buf.copy_to_device(other, b)
    assert sig.value == 3 and torch.equal(dst, a) and torch.equal(other, b)
    # and the worker picks up after it (halves, alternation), with a copy that grows the halves
    big = _random_bytes(40 * CAP + 3, seed=3)
    out = torch.zeros_like(big)
    buf.submit_to_device([(out, big)], signal=(sig, 4))
    buf.wait_signal((sig, 4))
    assert torch.equal(out, big) and buf.pinned_bytes <= CAP
    assert buf.stats()["h2d"]["chunks"] > 40
    buf.close()


def test_worker_rejects_a_bad_pair_before_queueing():
    _pump_or_skip(False)
    import ctypes
    buf = StagingBuffer(CPU, CAP, native=True)
    sig = ctypes.c_longlong(0)
    with pytest.raises(ValueError):
        buf.submit_to_device([(torch.zeros(10, dtype=torch.uint8), torch.zeros(11, dtype=torch.uint8))],
                             signal=(sig, 1))
    assert sig.value == 0  # nothing was queued: the caller marks its signal itself
    src = _random_bytes(100, seed=4)
    dst = torch.zeros(100, dtype=torch.uint8)
    buf.submit_to_device([(dst, src)], signal=(sig, 1))  # the worker still takes jobs
    buf.wait_signal((sig, 1))
    assert torch.equal(dst, src)
    buf.close()


@cuda_only
def test_cuda_worker_orders_by_events_and_signals_after_issue():
    # The delivery worker on CUDA: its stream waits for the job's CUDA events (after the gate),
    # the record fires after the DMAs, and the signal counter is set once the record is issued.
    # Negative control: the same job without the event wait is overwritten by the producer.
    import ctypes
    _pump_or_skip(True)
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 3 * (8 << 20) + 12_345
    producer = torch.cuda.Stream(dev)

    def trip(with_wait: bool) -> bool:
        buf = StagingBuffer(dev, 16 << 20, min_chunk_bytes=1 << 20, native=True)
        src = _random_bytes(n, seed=61)
        ready, done = torch.cuda.Event(), torch.cuda.Event()
        gate, sig = ctypes.c_longlong(0), ctypes.c_longlong(0)
        d = torch.zeros(n, dtype=torch.uint8, device=dev)
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)
            d.fill_(7)
            ready.record(producer)
        gate.value = 1  # "recorded": the worker may issue its stream wait now
        buf.submit_to_device([(d, src)], waits=[ready] if with_wait else [], gates=[(gate, 1)],
                             record=done, signal=(sig, 1))
        buf.wait_signal((sig, 1))
        torch.cuda.current_stream(dev).wait_event(done)
        torch.cuda.current_stream(dev).wait_event(ready)
        ok = torch.equal(d.cpu(), src)
        assert buf.stats()["h2d"]["chunks"] >= 3
        buf.close()
        return ok

    assert trip(True)
    assert not trip(False), "a worker job without the event wait went unnoticed"


def test_single_pump_copies_are_cut_finer_than_deliveries():
    # A single copy through the pump is cut at pump_min_chunk_bytes (its memcpy and DMA overlap
    # even for a copy of a few chunks), while the Python loop and event-ordered deliveries keep
    # min_chunk_bytes. Both land every byte; the chunk counts tell the plans apart.
    _pump_or_skip(False)
    n = (1 << 20) + 12_345
    chunks = {}
    for native in (True, False):
        buf = StagingBuffer(CPU, 8 << 20, native=native, pump_min_chunk_bytes=256 << 10)
        assert _round_trip(buf, n, seed=81)
        chunks[native] = buf.stats()["h2d"]["chunks"]
        buf.close()
    assert chunks[False] == 1, "the Python loop's plan changed"
    assert chunks[True] == 4, "a single pump copy was not cut at pump_min_chunk_bytes"  # split 4
    with pytest.raises(ValueError, match="pump_min_chunk_bytes"):
        StagingBuffer(CPU, CAP, pump_min_chunk_bytes=0)


@cuda_only
def test_cuda_single_pump_copy_is_ordered_on_the_callers_stream():
    # copy_to_device through the pump queues its DMAs on the caller's current stream: a kernel
    # queued there before the copy runs before it, one queued after sees its bytes, with no
    # host sync and no staging-stream events. Negative control: the same chunks issued on the
    # staging stream with no wait land before the earlier kernel, which then overwrites them.
    _pump_or_skip(True)
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 3 * (1 << 20) + 12_345

    def trip(on_caller: bool) -> bool:
        buf = StagingBuffer(dev, 4 << 20, native=True)
        src = _random_bytes(n, seed=71)
        d = torch.zeros(n, dtype=torch.uint8, device=dev)
        s = torch.cuda.Stream(dev)
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
            d.fill_(7)  # queued before the copy on the caller's stream
            if on_caller:
                buf.copy_to_device(d, src)
            else:
                d_ = buf._h2d
                with d_.lock:
                    buf._pump_call(buf._pump(), d_, buf._raw([(d, src)], d_, buf.pump_min_chunk_bytes))
            after = d.to(torch.int64).sum()  # queued after the copy on the same stream
        s.synchronize()
        buf.close()
        return torch.equal(d.cpu(), src) and int(after) == int(src.to(torch.int64).sum())

    assert trip(True)
    assert not trip(False), "DMAs off the caller's stream went unnoticed"


@cuda_only
def test_cuda_single_copy_is_cut_finer_only_when_the_engine_is_idle():
    # Idle copy engine: a single pump copy is cut at pump_min_chunk_bytes (its first memcpy is
    # exposed latency). Busy (the previous chunk's DMA still queued behind a slow kernel): it
    # takes the large-chunk plan, here one chunk. Every byte lands either way.
    _pump_or_skip(True)
    dev = torch.device("cuda", torch.cuda.current_device())
    # split 2: a fine plan is two chunks, one per half, so no copy below waits for a half
    # on the host and the second one returns with its DMAs still queued behind the sleep
    buf = StagingBuffer(dev, 64 << 20, native=True, pump_min_chunk_bytes=256 << 10, split=2)
    n = 4 << 20
    srcs = [_random_bytes(n, seed=91 + i) for i in range(3)]
    dsts = [torch.zeros(n, dtype=torch.uint8, device=dev) for _ in range(3)]
    counts = []

    def chunks():
        return buf.stats()["h2d"]["chunks"]
    buf.copy_to_device(dsts[0], srcs[0], synchronize=True)
    counts.append(chunks())
    torch.cuda._sleep(200_000_000)  # the DMAs queue behind it on the caller's stream
    buf.copy_to_device(dsts[1], srcs[1])  # the engine was idle at entry: fine chunks
    counts.append(chunks() - counts[-1])
    buf.copy_to_device(dsts[2], srcs[2])  # busy now: the large-chunk plan
    counts.append(chunks() - sum(counts))
    torch.cuda.synchronize()
    assert counts == [2, 2, 1]
    assert all(torch.equal(d.cpu(), s) for d, s in zip(dsts, srcs))
    buf.close()
