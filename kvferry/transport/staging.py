"""Capped, double-buffered staging buffer for copies between pageable host memory and a device.

PyTorch copies pageable host memory to a GPU at a fraction of the pinned-memory rate, and
pinning a multi-GiB KV cache up front is slow and can exhaust locked memory. Instead each copy
is bounced through a small pinned buffer in chunks, so the host memcpy of one chunk overlaps
the DMA of the previous one.

Owns: one buffer per device (pinned when the device is CUDA, plain memory on CPU), its copy
stream (on CPU a single worker thread that stands in for the copy engine), one event per half
and the lock that gives one copy the buffer for all of its chunks.

Must not: hold more than ``cap_bytes`` (the copy size never decides the buffer size), touch a
half on the host while the copy engine may still use it, keep references to caller tensors after
a copy returns, or block the host where a stream-to-stream wait is enough.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)

DEFAULT_CAP_BYTES = 64 << 20
_MIN_HALF = 4096  # smaller halves only add per-chunk overhead; page size keeps halves aligned


class _HostEvent:
    """Stand-in for ``torch.cuda.Event`` on the CPU worker: record / query / synchronize."""

    def __init__(self, worker: _CopyWorker):
        self._worker = worker
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._done.set()  # like a CUDA event never recorded: waiting returns at once
        self._gen = 0

    def record(self) -> None:
        with self._lock:  # read the generation under the lock that bumped it
            self._gen += 1
            gen = self._gen
            self._done.clear()
        self._worker.submit(lambda: self._fire(gen))

    def _fire(self, gen: int) -> None:
        # A re-record replaces the earlier one, as with CUDA; only the newest marker completes it.
        with self._lock:
            if gen == self._gen:
                self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        self._worker.raise_error()


class _CopyWorker:
    """One thread running copy jobs in submission order, like a single CUDA copy stream."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.delay_s = delay_s  # test-only: random sleep before each copy to widen races
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._error: BaseException | None = None
        self._rng = random.Random()

    def submit(self, fn, *, is_copy: bool = False) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put((fn, is_copy))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, is_copy = job
            try:
                if is_copy and self.delay_s > 0:
                    time.sleep(self._rng.uniform(0.0, self.delay_s))
                fn()
            except BaseException as exc:  # surfaced to the waiting caller by raise_error
                if self._error is None:
                    self._error = exc

    def raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"staging copy worker {self._name} failed") from err

    def stop(self) -> None:
        # A later submit starts a fresh thread; the sentinel is ahead of its jobs in the FIFO,
        # so exactly one thread consumes them and their order is kept.
        with self._start_lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread = None


def _normalize(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _flat_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"staging copy: {what} must be contiguous (got strides {t.stride()})")
    # reshape(-1) first: view(uint8) on a 0-d tensor of a wider dtype is not allowed
    return t.reshape(-1).view(torch.uint8)


class StagingBuffer:
    """Bounce buffer of at most ``cap_bytes`` for one device, split into two halves."""

    def __init__(self, device: torch.device, cap_bytes: int = DEFAULT_CAP_BYTES, *,
                 _test_uncapped: bool = False, _test_delay_s: float = 0.0,
                 _test_skip_half_wait: bool = False):
        device = _normalize(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"StagingBuffer: unsupported device {device} (cuda or cpu only)")
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes <= 0 \
                or cap_bytes % 2:
            raise ValueError("StagingBuffer: cap_bytes must be a positive even int (it is split "
                             f"into two equal halves), got {cap_bytes!r}")
        self.device = device
        self.cap_bytes = cap_bytes
        self._cuda = device.type == "cuda"
        self._test_uncapped = _test_uncapped
        self._test_skip_half_wait = _test_skip_half_wait
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._half = self._peak = 0
        # the half the next copy starts in: consecutive copies alternate halves, so the host
        # memcpy of one small copy overlaps the DMA of the one before it
        self._next = 0
        self._worker: _CopyWorker | None = None
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        else:
            self._worker = _CopyWorker(f"kvferry-staging-{device}", _test_delay_s)
            self._events = [_HostEvent(self._worker), _HostEvent(self._worker)]
            weakref.finalize(self, self._worker.stop)

    def _set_test_delay(self, seconds: float) -> None:
        """Test-only: random sleeps of up to ``seconds`` before each CPU worker copy."""
        self._worker.delay_s = seconds

    @property
    def pinned_bytes(self) -> int:
        """Bytes this buffer holds now (pinned on CUDA, plain host memory on CPU)."""
        return 0 if self._buf is None else self._buf.numel()

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def _ensure(self, nbytes: int) -> None:
        want = nbytes if self._test_uncapped else min(nbytes, self.cap_bytes // 2)
        half = max(_MIN_HALF, 1 << max(want - 1, 0).bit_length())
        if not self._test_uncapped:
            half = min(half, self.cap_bytes // 2)
        if half <= self._half:
            return
        for ev in self._events:  # a copy still in flight may read or write the old buffer
            ev.synchronize()
        # Grown, never shrunk: the buffer is kept for reuse on purpose (pinning is slow),
        # bounded by the cap per device. Freed smaller blocks go back to torch's host cache.
        self._buf = torch.empty(2 * half, dtype=torch.uint8, pin_memory=self._cuda)
        log.debug("staging %s: buffer %d -> %d bytes (cap %d)",
                  self.device, 2 * self._half, 2 * half, self.cap_bytes)
        self._half = half
        self._peak = max(self._peak, 2 * half)

    def _check(self, dst, src, dst_dev, src_dev):
        for t, dev, what in ((dst, dst_dev, "dst"), (src, src_dev, "src")):
            if t.device != dev:
                raise ValueError(f"staging copy: {what} is on {t.device}, expected {dev}")
        if dst.nbytes != src.nbytes:
            raise ValueError(f"staging copy: size mismatch, src has {src.nbytes} bytes, "
                             f"dst has {dst.nbytes}")
        return _flat_bytes(dst, "dst"), _flat_bytes(src, "src")

    def _engine_copy(self, dst: torch.Tensor, src: torch.Tensor, h: int) -> None:
        """Queue ``dst.copy_(src)`` on the copy engine, then record half ``h``'s event."""
        if self._cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
            self._events[h].record(self._stream)
        else:
            self._worker.submit(lambda: dst.copy_(src), is_copy=True)
            self._events[h].record()

    def _wait_half(self, h: int) -> None:
        if not self._test_skip_half_wait:
            self._events[h].synchronize()

    def _begin(self) -> None:
        if self._cuda:  # dst/src may still be used by kernels queued on the caller's stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                       synchronize: bool = False) -> None:
        """Copy host ``src`` (pageable) into device ``dst``; any dtypes, equal byte counts.

        On CUDA the caller's current stream is made to wait on the copy stream (no host sync),
        so work queued on it afterwards sees the data; ``synchronize=True`` also blocks the host
        until the copy is done. ``src`` may be reused as soon as this returns. On CPU the copy is
        complete on return.
        """
        d, s = self._check(dst, src, self.device, torch.device("cpu"))
        n = s.numel()
        if n == 0:
            return
        with self._lock:
            self._ensure(n)
            self._begin()
            half, buf, h = self._half, self._buf, self._next
            for off in range(0, n, half):
                m = min(half, n - off)
                stage = buf[h * half:h * half + m]
                self._wait_half(h)  # the half's previous DMA may still be reading it
                stage.copy_(s[off:off + m])
                self._engine_copy(d[off:off + m], stage, h)
                h ^= 1
            self._next = h
            if self._cuda:
                dst.record_stream(self._stream)
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
                if synchronize:
                    self._stream.synchronize()
            else:
                for ev in self._events:
                    ev.synchronize()

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device ``src`` into host ``dst`` (pageable); returns when ``dst`` holds all bytes."""
        d, s = self._check(dst, src, torch.device("cpu"), self.device)
        n = s.numel()
        if n == 0:
            return
        with self._lock:
            self._ensure(n)
            self._begin()
            half, buf, h = self._half, self._buf, 0
            pending = None  # (half index, offset, length) of the chunk still to drain
            for off in range(0, n, half):
                m = min(half, n - off)
                self._engine_copy(buf[h * half:h * half + m], s[off:off + m], h)
                if pending is not None:
                    self._drain(d, buf, half, *pending)  # overlaps the DMA just queued
                pending = (h, off, m)
                h ^= 1
            self._drain(d, buf, half, *pending)
            for ev in self._events:  # a skipped half wait must not leave a job writing later
                ev.synchronize()

    def _drain(self, d, buf, half, h, off, m) -> None:
        self._wait_half(h)
        d[off:off + m].copy_(buf[h * half:h * half + m])

    def close(self) -> None:
        """Wait for in-flight copies, free the memory and CPU worker; a later copy starts over."""
        with self._lock:
            for ev in self._events:
                ev.synchronize()
            self._buf, self._half = None, 0
            if self._worker is not None:
                self._worker.stop()


_REGISTRY: dict[torch.device, StagingBuffer] = {}
_REGISTRY_LOCK = threading.Lock()


def get_staging(device, cap_bytes: int | None = None) -> StagingBuffer:
    """The one staging buffer of ``device``. ``cap_bytes`` None keeps the existing buffer (or
    makes one with the default cap); another cap replaces it, after its copies finish."""
    device = _normalize(device)
    with _REGISTRY_LOCK:
        buf = _REGISTRY.get(device)
        if buf is not None and cap_bytes is not None and cap_bytes != buf.cap_bytes:
            buf.close()
            buf = None
        if buf is None:
            buf = StagingBuffer(device, DEFAULT_CAP_BYTES if cap_bytes is None else cap_bytes)
            _REGISTRY[device] = buf
        return buf


def staging_pinned_bytes() -> int:
    """Bytes held by all registered staging buffers (for debug logs and benchmarks)."""
    with _REGISTRY_LOCK:
        return sum(b.pinned_bytes for b in _REGISTRY.values())


def release_staging() -> None:
    """Close and forget every registered buffer (shutdown, or isolation between tests)."""
    with _REGISTRY_LOCK:
        bufs = list(_REGISTRY.values())
        _REGISTRY.clear()
    for b in bufs:
        b.close()
