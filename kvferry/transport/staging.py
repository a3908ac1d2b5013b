"""Capped, double-buffered staging buffer for copies between pageable host memory and a device.

PyTorch copies pageable host memory to a GPU at a fraction of the pinned-memory rate, and
pinning a multi-GiB KV cache up front is slow and can exhaust locked memory. Instead each copy
is bounced through a small pinned buffer in chunks, so the host memcpy of one chunk overlaps
the DMA of the previous one.

Owns: one buffer per device of at most ``cap_bytes``, split into two directions (host to
device, device to host) so that a delivery and a write-back never wait for each other (the
link is full duplex). Each direction is double-buffered: two halves, one event per half, its
own copy stream (on CPU a worker thread that stands in for the copy engine) and its own lock,
which one copy holds for all of its chunks.

Must not: hold more than ``cap_bytes`` (the copy size never decides the buffer size), touch a
half on the host while the copy engine may still use it, keep references to caller tensors after
a copy returns, or block the host where a stream-to-stream wait is enough.

Why by hand: PyTorch has no chunked pageable copy (its own pageable ``copy_`` is the slow
path this replaces), and CUDA's driver-side staging is neither capped nor overlapped.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import weakref

import torch

from kvferry.transport.hostmem import alloc_host

log = logging.getLogger(__name__)

DEFAULT_CAP_BYTES = 64 << 20
_MIN_HALF = 4096  # smaller halves only add per-chunk overhead; page size keeps halves aligned
_PAGE = 4096
# A copy is cut into at least DEFAULT_SPLIT chunks of at least DEFAULT_MIN_CHUNK bytes (and
# at most a half), so the memcpy of chunk k + 1 overlaps the DMA of chunk k; consecutive copies
# continue the alternation. Chunks are large on purpose: on the H200 machine each chunk costs
# the copy thread several GIL hand-overs and tens of microseconds of launches, and the host
# memcpy runs faster per byte on big blocks; 16-24 MiB chunks more than halved the pageable
# decode step against 4 MiB ones (docs/results.md, issue 4).
DEFAULT_MIN_CHUNK = 16 << 20
DEFAULT_SPLIT = 4
# A single copy through the compiled pump (copy_to_device: weight uploads, one-off copies) is
# cut finer: the pump's per-chunk cost is a launch and an event record, not Python, and a copy
# under DEFAULT_SPLIT * DEFAULT_MIN_CHUNK bytes would otherwise be one chunk whose memcpy and
# DMA run in series (a 1 MiB copy at 27-35% of pinned on the H200). Deliveries of the host KV
# cache stream back to back, so their pipeline stays full across copies and they keep the
# large chunks (the chunk plan of an event-ordered call does not change).
DEFAULT_PUMP_MIN_CHUNK = 256 << 10
# Share of the cap for the host-to-device halves (24 MiB each of the default 64 MiB), the rest
# device to host (8 MiB halves): deliveries carry the bulk of the bytes (a whole context per
# decode step), write-backs a few rows.
DEFAULT_H2D_SHARE = 0.75
# The pump's memcpy stores (native.COPY_MODES); KVFERRY_PUMP_COPY overrides, for benchmarks.
DEFAULT_PUMP_COPY = os.environ.get("KVFERRY_PUMP_COPY", "memcpy")


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
                # callers may hand over inference tensors (views made in the decode thread's
                # inference mode); in that mode both kinds may be written (byte buffers, no autograd)
                with torch.inference_mode():
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


def _unpin(ptr: int, stream, events) -> None:
    try:
        stream.synchronize()  # a DMA may still read or write the pages: on the staging stream,
        for ev in events:  # or (single copies through the pump) on a caller's stream
            ev.synchronize()
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


def _normalize(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _require_contiguous(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"staging copy: {what} must be contiguous (got strides {t.stride()})")


def _flat_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    _require_contiguous(t, what)
    if t.dtype == torch.uint8 and t.dim() == 1:
        return t
    # reshape(-1) first: view(uint8) on a 0-d tensor of a wider dtype is not allowed
    return t.reshape(-1).view(torch.uint8)


class _Direction:
    """One direction's double buffer: two halves, an event per half, a stream and a lock."""

    def __init__(self, device: torch.device, name: str, delay_s: float):
        self.lock = threading.Lock()
        self.buf: torch.Tensor | None = None
        self.halves: tuple[torch.Tensor, torch.Tensor] | None = None
        self.half = 0
        # unpins the halves (CUDA, pinned in place): called by free(), or by the garbage
        # collector when a buffer is dropped without close(); None = nothing registered
        self.unpin: weakref.finalize | None = None
        # the half the next copy starts in: consecutive copies alternate halves, so the host
        # memcpy of one small copy overlaps the DMA of the one before it
        self.next = 0
        # host-side accounting (stats()): where a copy's time goes on the calling thread
        # call_s: wall time of the pump's C calls (native.py); entry_s: of event-ordered calls from entry to exit
        # (both with the pump; what they hold beyond wait + memcpy + issue is overhead)
        self.counts = dict(copies=0, chunks=0, bytes=0, wait_s=0.0, memcpy_s=0.0, issue_s=0.0,
                           call_s=0.0, entry_s=0.0)
        self.worker: _CopyWorker | None = None
        # the delivery worker (native.Worker, host to device only) once submit_to_device() has
        # been used; "stale" when a Python-side copy ran since, so the worker's next half is
        # out of date
        self.native = None
        self.stale = False
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            for ev in self.events:  # created now: the compiled pump waits on their raw handles
                ev.record(self.stream)
        else:
            self.stream = None
            self.worker = _CopyWorker(f"kvferry-staging-{name}-{device}", delay_s)
            self.events = [_HostEvent(self.worker), _HostEvent(self.worker)]

    @property
    def nbytes(self) -> int:
        return 2 * self.half

    def synchronize(self) -> None:
        if self.native is not None:
            self.native.drain()
        for ev in self.events:
            ev.synchronize()

    def own(self) -> None:
        """A Python-side copy is about to use the halves (lock held): run what the delivery
        worker has queued first, and take over its half alternation."""
        if self.native is not None:
            self.native.drain()
            self.next = self.native.half()
            self.stale = True

    def free(self) -> None:
        """Release the halves (the caller has waited for their copies)."""
        if self.unpin is not None:
            self.unpin()
        self.buf = self.halves = self.unpin = None
        self.half = 0


class StagingBuffer:
    """Bounce buffer of at most ``cap_bytes`` for one device: per direction, two halves; host to
    device gets ``h2d_share`` of the cap, device to host the rest.

    ``min_chunk_bytes`` and ``split`` set how a copy is cut into chunks (see DEFAULT_SPLIT).
    """

    def __init__(self, device: torch.device, cap_bytes: int = DEFAULT_CAP_BYTES, *,
                 min_chunk_bytes: int = DEFAULT_MIN_CHUNK, split: int = DEFAULT_SPLIT,
                 pump_min_chunk_bytes: int = DEFAULT_PUMP_MIN_CHUNK,
                 h2d_share: float = DEFAULT_H2D_SHARE,
                 native: bool | None = None,
                 _test_uncapped: bool = False, _test_delay_s: float = 0.0,
                 _test_skip_half_wait: bool = False):
        device = _normalize(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"StagingBuffer: unsupported device {device} (cuda or cpu only)")
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes <= 0 \
                or cap_bytes % 4:
            raise ValueError("StagingBuffer: cap_bytes must be a positive multiple of 4 (it is split "
                             f"into two directions of two equal halves), got {cap_bytes!r}")
        if min_chunk_bytes < 1 or split < 1 or pump_min_chunk_bytes < 1:
            raise ValueError(f"StagingBuffer: min_chunk_bytes, pump_min_chunk_bytes and split must be "
                             f">= 1, got {min_chunk_bytes}, {pump_min_chunk_bytes} and {split}")
        self.device = device
        self.cap_bytes = cap_bytes
        if not 0.0 < h2d_share < 1.0:
            raise ValueError(f"StagingBuffer: h2d_share must be in (0, 1), got {h2d_share}")
        self.min_chunk_bytes = min_chunk_bytes
        self.pump_min_chunk_bytes = pump_min_chunk_bytes
        self.h2d_share = h2d_share
        self.split = split
        self._cuda = device.type == "cuda"
        self._test_uncapped = _test_uncapped
        self._test_skip_half_wait = _test_skip_half_wait
        self._poll_s: float | None = None
        # Host-to-device chunks through the compiled pump (native.py): True requires it, None
        # uses it on CUDA when it loads, False keeps the Python loop. Switchable between copies.
        self.native = native
        self._pump_state: tuple | None = None  # (native setting, pump or None)
        self.pump_threads: int | None = None  # memcpy threads of the pump; None: see _pump_nthreads
        # the pump's memcpy stores (native.COPY_MODES): "memcpy" (glibc) or "stream" (non-temporal)
        self.pump_copy = DEFAULT_PUMP_COPY
        if self.pump_copy not in ("memcpy", "stream"):
            raise ValueError(f"staging: unknown pump copy mode {self.pump_copy!r} (KVFERRY_PUMP_COPY?); "
                             "use 'memcpy' or 'stream'")
        self._h2d = _Direction(device, "h2d", _test_delay_s)
        self._d2h = _Direction(device, "d2h", _test_delay_s)
        self._peak = 0
        for d in (self._h2d, self._d2h):
            if d.worker is not None:
                weakref.finalize(self, d.worker.stop)

    def _set_test_delay(self, seconds: float) -> None:
        """Test-only: random sleeps of up to ``seconds`` before each CPU worker copy."""
        self._h2d.worker.delay_s = self._d2h.worker.delay_s = seconds

    @property
    def pinned_bytes(self) -> int:
        """Bytes this buffer holds now (pinned on CUDA, plain host memory on CPU)."""
        return self._h2d.nbytes + self._d2h.nbytes

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def _half_cap(self, d: _Direction) -> int:
        """Largest half of direction ``d``: host to device gets ``h2d_share`` of the cap."""
        h2d = int(self.cap_bytes * self.h2d_share) // 2
        return h2d if d is self._h2d else (self.cap_bytes - 2 * h2d) // 2

    def _chunk(self, n: int, d: _Direction, min_chunk: int | None = None) -> int:
        """Bytes per chunk for an n-byte copy in direction d (the last chunk may be shorter);
        ``min_chunk`` overrides ``min_chunk_bytes`` (single copies through the pump)."""
        if self._test_uncapped:
            return n  # test-only variant: the buffer grows to the copy size
        c = max(self.min_chunk_bytes if min_chunk is None else min_chunk, -(-n // self.split))
        c = -(-c // _PAGE) * _PAGE  # whole pages, so chunk starts keep the source's alignment
        return min(c, n, self._half_cap(d))

    def _ensure(self, d: _Direction, chunk: int) -> None:
        half = max(_MIN_HALF, 1 << max(chunk - 1, 0).bit_length())
        if not self._test_uncapped:
            half = min(half, self._half_cap(d))
        if half <= d.half:
            return
        d.synchronize()  # a copy still in flight may read or write the old buffer
        old = d.nbytes
        d.free()  # before the new one: the cap holds at every moment, not only between copies
        # Grown, never shrunk: the buffer is kept for reuse on purpose (pinning is slow),
        # bounded by the cap per device.
        d.buf = self._alloc(2 * half, d)
        d.halves = (d.buf[:half], d.buf[half:])
        d.half = half
        log.debug("staging %s: %s halves %d -> %d bytes; %d bytes held (cap %d)",
                  self.device, "h2d" if d is self._h2d else "d2h", old // 2, half,
                  self.pinned_bytes, self.cap_bytes)
        self._peak = max(self._peak, self.pinned_bytes)

    def _alloc(self, nbytes: int, d: _Direction) -> torch.Tensor:
        # The first copy may come from a thread in inference mode (the decode thread staging
        # deliveries): a buffer made there would be an inference tensor, which the CPU
        # workers, outside that mode, may not write. The buffer is plain storage either way.
        with torch.inference_mode(False):
            return self._alloc_plain(nbytes, d)

    def _alloc_plain(self, nbytes: int, d: _Direction) -> torch.Tensor:
        if not self._cuda:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Pinned in place with cudaHostRegister rather than through torch's pinned allocator:
        # that allocator keeps freed blocks pinned in its cache, so each growth would leave the
        # old halves pinned beyond the cap. A mapping of its own, so no page is shared with other data.
        buf = alloc_host(nbytes)  # its own pages, huge where the system gives them (hostmem.py)
        register = getattr(torch.cuda.cudart(), "cudaHostRegister", None)
        if register is None:  # a build without the binding: torch's allocator, growth leaves blocks cached
            log.warning("staging %s: cudaHostRegister is not available, pinning through torch's "
                        "host allocator", self.device)
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        err = register(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"staging {self.device}: pinning {nbytes} bytes failed (CUDA error "
                               f"{int(err)}); lower --staging-cap or raise the locked-memory limit")
        # The memory must leave the registration before the allocator can hand it out again
        # (a later register of the same pages fails with "already registered"): unpinned by
        # free(), or when the buffer is dropped unclosed, after its copies finished.
        d.unpin = weakref.finalize(buf, _unpin, buf.data_ptr(), d.stream, d.events)
        return buf

    @staticmethod
    def _validate(dst, src, dst_dev, src_dev) -> int:
        """Devices and sizes of one pair; returns its byte count."""
        for t, dev, what in ((dst, dst_dev, "dst"), (src, src_dev, "src")):
            if t.device != dev:
                raise ValueError(f"staging copy: {what} is on {t.device}, expected {dev}")
        if dst.nbytes != src.nbytes:
            raise ValueError(f"staging copy: size mismatch, src has {src.nbytes} bytes, "
                             f"dst has {dst.nbytes}")
        return src.nbytes

    def _check(self, pairs, dst_dev, src_dev):
        flat = []
        for dst, src in pairs:
            if self._validate(dst, src, dst_dev, src_dev):
                flat.append((_flat_bytes(dst, "dst"), _flat_bytes(src, "src")))
        return flat

    def _engine_copy(self, d: _Direction, dst: torch.Tensor, src: torch.Tensor, h: int) -> None:
        """Queue ``dst.copy_(src)`` on the direction's copy engine (on CUDA the caller has made
        its stream current), then record half ``h``'s event."""
        if self._cuda:
            dst.copy_(src, non_blocking=True)
            d.events[h].record(d.stream)
        else:
            d.worker.submit(lambda: dst.copy_(src), is_copy=True)
            d.events[h].record()

    def _wait_half(self, d: _Direction, h: int) -> None:
        if self._test_skip_half_wait:
            return
        ev = d.events[h]
        if self._poll_s is not None:  # diagnostic: yield the core instead of a driver spin-wait
            while not ev.query():
                time.sleep(self._poll_s)
        ev.synchronize()

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                       synchronize: bool = False) -> None:
        """Copy host ``src`` (pageable) into device ``dst``; any dtypes, equal byte counts.

        On CUDA the caller's current stream is made to wait on the copy stream (no host sync),
        so work queued on it afterwards sees the data; ``synchronize=True`` also blocks the host
        until the copy is done. ``src`` may be reused as soon as this returns. On CPU the copy is
        complete on return.
        """
        self.copy_all_to_device([(dst, src)], synchronize=synchronize)

    def copy_all_to_device(self, pairs, *, synchronize: bool = False, waits=None, record=None,
                           keep=()) -> None:
        """``copy_to_device`` for a list of (dst, src) pairs, taking the lock once: the chunks
        of all pairs stream through the halves back to back.

        CUDA only, for a copy engine that orders copies by events (the pageable host KV cache):
        ``waits`` (CUDA events) replace the wait for the caller's stream, ``record`` (a CUDA
        event) is recorded after the last DMA in place of making the caller's stream wait, and
        ``keep`` tensors are marked as used by the copy stream. Each saves the copy thread
        stream switches and event allocations per call. With ``waits`` given, the caller keeps
        its device tensors alive until ``record`` has fired (the compiled pump does not mark
        them; the transport's ring slots are never freed) or lists them in ``keep``."""
        pump = self._pump()
        if pump is not None and self._cuda:
            if waits is not None:
                return self._pump_event_ordered(pump, pairs, waits, record, keep)
            if record is None and not keep:
                return self._pump_on_caller_stream(pump, pairs, synchronize)
        flat = self._check(pairs, self.device, torch.device("cpu"))
        if not flat and record is None:
            return
        d = self._h2d
        with d.lock:
            d.own()
            caller, ctx = self._enter(d, waits)
            h = d.next
            c = d.counts
            if pump is not None and flat:
                raw = [(dst.data_ptr(), src.data_ptr(), src.numel(),
                        self._chunk(src.numel(), d, self.pump_min_chunk_bytes)) for dst, src in flat]
                with torch.cuda.device(self.device) if self._cuda else _NULL_CTX:
                    h = self._pump_call(pump, d, raw)
            else:
                with ctx:
                    h = self._loop_h2d(d, flat, h)
            c["copies"] += 1
            c["bytes"] += sum(src.numel() for _, src in flat)
            d.next = h
            if self._cuda:
                self._leave(d, [dst for dst, _ in flat], caller, record, keep)
                if synchronize:
                    d.stream.synchronize()
            else:
                d.synchronize()

    def _loop_h2d(self, d: _Direction, flat, h: int) -> int:
        """The reference chunk loop (Python): the compiled pump does the same per chunk."""
        c = d.counts
        for dst, src in self._chunks(d, flat):
            stage = d.halves[h][:src.numel()]
            t0 = time.perf_counter()
            self._wait_half(d, h)  # the half's previous DMA may still be reading it
            t1 = time.perf_counter()
            stage.copy_(src)
            t2 = time.perf_counter()
            self._engine_copy(d, dst, stage, h)
            c["wait_s"] += t1 - t0
            c["memcpy_s"] += t2 - t1
            c["issue_s"] += time.perf_counter() - t2
            c["chunks"] += 1
            h ^= 1
        return h

    def _pump(self):
        """The compiled pump to use for the next copy, or None (Python loop). Auto (native None)
        means CUDA only, and not while the half-wait polling diagnostic (_poll_s) is on, which
        only the Python loop implements."""
        want = self.native if self.native is not None else (self._cuda and not self._poll_s)
        if not want:
            return None
        if self._pump_state is None or self._pump_state[0] != want:
            from kvferry.transport.native import load_pump
            pump = load_pump(self._cuda)
            if pump is None and self.native:
                raise RuntimeError("staging: the compiled chunk pump was asked for (native=True) but "
                                   "could not be loaded; see the log, or use native=None/False")
            self._pump_state = (want, pump)
        return self._pump_state[1]

    def _pump_on_caller_stream(self, pump, pairs, synchronize: bool) -> None:
        """``copy_all_to_device`` with the compiled pump and no event ordering (weight uploads,
        one-off copies): the DMAs and the halves' events go on the caller's current stream,
        so they are ordered after its queued kernels and before whatever it queues next, as
        PyTorch's own ``copy_`` is. That is what the staging stream achieved with a wait on the
        caller's stream before and the caller's wait on the staging stream after, each an
        event made, recorded and waited for from Python per call; a small copy's latency is
        mostly such fixed costs. The halves stay safe across callers on other streams: a chunk
        waits on the host for its half's event, whichever stream recorded it. The source may
        be reused on return (every memcpy out of it is done); the destination is used on the
        caller's stream only, so the allocator needs no record_stream.

        The chunk plan adapts: with the copy engine idle (the last chunk's DMA is done), the
        first chunk's memcpy is latency nobody hides, so the copy is cut at
        ``pump_min_chunk_bytes``; with a DMA still running (a stream of copies, as a weight load
        is) the pipeline is already full and the copy takes the large chunks, which cost fewer
        launches and events per byte."""
        d = self._h2d
        with d.lock:
            d.own()
            busy = d.halves is not None and not d.events[d.next ^ 1].query()
            raw = self._raw(pairs, d, None if busy else self.pump_min_chunk_bytes)
            if not raw:
                return
            self._set_device()
            stream = torch.cuda.current_stream(self.device)
            self._pump_call(pump, d, raw, stream=stream.cuda_stream)
            d.counts["copies"] += 1
            d.counts["bytes"] += sum(r[2] for r in raw)
        if synchronize:
            stream.synchronize()

    def _raw(self, pairs, d: _Direction, min_chunk: int | None = None):
        """The checks of ``_check`` without its flat views: (dst_ptr, src_ptr, nbytes, chunk)."""
        raw = []
        host = torch.device("cpu")
        dst_dev, src_dev = (self.device, host) if d is self._h2d else (host, self.device)
        for dst, src in pairs:
            n = self._validate(dst, src, dst_dev, src_dev)
            if n:  # as in _check, empty pairs are skipped before the layout is looked at
                _require_contiguous(dst, "dst")
                _require_contiguous(src, "src")
                raw.append((dst.data_ptr(), src.data_ptr(), n, self._chunk(n, d, min_chunk)))
        return raw

    def submit_to_device(self, pairs, *, waits=(), gates=(), record=None, signal=None, keep=()) -> None:
        """Queue host-to-device pairs on the delivery worker (native.Worker) and return at once;
        the copies run on a C thread, in submission order, without the GIL. ``gates``:
        (ctypes.c_longlong, generation) pairs the worker waits for first (the host side of
        ``waits``, CUDA events it then makes its stream wait for); ``record``: a CUDA event
        recorded after the last DMA; ``signal``: (ctypes.c_longlong, generation) set once the
        job is issued, waited for with ``wait_signal``. The caller keeps the tensors alive
        until the signal is set (the transport's slots and host rows outlive every copy) and
        lists in ``keep`` device tensors the allocator must not reuse early. Needs the pump."""
        pump = self.worker_pump()
        if pump is None:
            raise RuntimeError("staging: the delivery worker needs the compiled chunk pump, which is "
                               "not in use (native=False, or it could not be built; see the log)")
        t0 = time.perf_counter()
        d = self._h2d
        raw = self._raw(pairs, d)
        with d.lock:
            w = d.native
            if w is None:
                from kvferry.transport.native import Worker
                d.synchronize()  # Python-side copies still in flight use the halves
                w = d.native = Worker(pump, self.device.index if self._cuda else -1)
                weakref.finalize(self, w.stop)  # a buffer dropped without close()
                d.stale = True
            need = max((r[3] for r in raw), default=0)
            if need > d.half:
                self._ensure(d, need)  # drains the worker before the halves change
            if d.stale:  # a Python-side copy ran since the last job: the worker is idle
                d.synchronize()
                w.half(d.next)
                d.stale = False
            halves = [t.data_ptr() for t in d.halves] if d.halves else [None, None]
            if self._cuda:
                if record is not None and not record.cuda_event:
                    record.record(d.stream)  # created now, so the worker has a handle to record
                events, stream = [e.cuda_event for e in d.events], d.stream.cuda_stream
                ev_waits = [e.cuda_event for e in waits]
                ev_record = record.cuda_event if record is not None else None
                for t in keep:  # held by the caller until issued: the free sees this stream's copy
                    t.record_stream(d.stream)
            else:
                events, stream, ev_waits, ev_record = (None, None), None, [], None
            w.submit(raw, halves, events, stream, self._pump_nthreads(), self.pump_copy, ev_waits,
                     list(gates), ev_record, signal)
            d.counts["copies"] += 1
            d.counts["bytes"] += sum(r[2] for r in raw)
            d.counts["entry_s"] += time.perf_counter() - t0

    def wait_signal(self, signal) -> None:
        """Block until the delivery worker has set ``signal`` (ctypes.c_longlong, generation)."""
        self._h2d.native.wait(*signal)

    def worker_pump(self):
        """The pump for the delivery worker: on CPU too (tests), unless native is False."""
        if self.native is False:
            return None
        from kvferry.transport.native import load_pump
        return load_pump(self._cuda)

    def _pump_event_ordered(self, pump, pairs, waits, record, keep, to_device: bool = True) -> None:
        """The transport's deliveries and write-backs with the compiled pump: the checks of
        ``_check`` without its flat views, then one call that waits, copies and records (each
        trip into PyTorch from a copy thread is a GIL hand-over with the decode thread). The
        caller keeps its device tensors alive past the copy (the transport's ring slots are
        never freed) and passes any others in ``keep``."""
        t0 = time.perf_counter()
        d = self._h2d if to_device else self._d2h
        raw = self._raw(pairs, d)
        with d.lock:
            d.own()
            self._set_device()
            self._pump_call(pump, d, raw, waits, record)
            for t in keep if to_device else ():  # device to host: the DMAs are done
                t.record_stream(d.stream)
            d.counts["copies"] += 1
            d.counts["bytes"] += sum(r[2] for r in raw)
            d.counts["entry_s"] += time.perf_counter() - t0

    def _pump_nthreads(self) -> int:
        # Two cores fewer than PyTorch's intra-op count: the decode thread and the write-back
        # thread keep a core each while a delivery's memcpy runs beside them. On the H200 machine
        # 14 of 16 beat 16 (and 10-12) for a copy thread's pump (docs/results.md, issue 4).
        return self.pump_threads or max(1, torch.get_num_threads() - 2)

    def _set_device(self) -> None:
        # the runtime's calls act on the calling thread's current device; a copy thread keeps it
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def _pump_call(self, pump, d: _Direction, raw, waits=(), record=None, stream=None) -> int:
        """One copy of ``raw`` (dst_ptr, src_ptr, nbytes, chunk) through the pump, in direction
        ``d`` (the caller holds its lock and, on CUDA, has made the device current); ``waits``
        and ``record`` are CUDA events, as in the event-ordered calls; ``stream`` a raw CUDA
        stream for the DMAs (default: the direction's). Returns ``d.next``."""
        if raw:
            self._ensure(d, max(r[3] for r in raw))
        halves = [t.data_ptr() for t in d.halves] if raw else [None, None]
        nthreads = self._pump_nthreads()
        if not self._cuda:  # the "DMA" is a memcpy on the calling thread: nothing in flight
            d.synchronize()  # a Python-loop copy before this one may still be on the worker
            d.next = pump.h2d(raw, halves, (None, None), None, d.next, nthreads, d.counts,
                              self._test_skip_half_wait, mode=self.pump_copy)
            return d.next
        events = [e.cuda_event for e in d.events]
        if stream is None:
            stream = d.stream.cuda_stream
        # an event never recorded has no handle yet (0): waiting on it is a no-op, as in
        # PyTorch (the pump skips it); one to record is created by recording it here first
        ev_waits = [e.cuda_event for e in waits]
        if record is not None and not record.cuda_event:
            record.record(d.stream)
        ev_record = record.cuda_event if record is not None else None
        if d is self._h2d:
            d.next = pump.h2d(raw, halves, events, stream, d.next, nthreads, d.counts,
                              self._test_skip_half_wait, ev_waits, ev_record, self.pump_copy)
        else:  # returns once every DMA is done
            pump.d2h(raw, halves, events, stream, nthreads, d.counts, ev_waits, ev_record, self.pump_copy)
        return d.next

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device ``src`` into host ``dst`` (pageable); returns when ``dst`` holds all bytes."""
        self.copy_all_to_host([(dst, src)])

    def copy_all_to_host(self, pairs, *, waits=None, record=None, keep=()) -> None:
        """``copy_to_host`` for a list of (dst, src) pairs, taking the lock once; ``waits``,
        ``record`` and ``keep`` as in ``copy_all_to_device`` (``record`` marks the device
        tensors as read)."""
        pump = self._pump()
        if pump is not None and self._cuda and waits is not None and not self._test_skip_half_wait:
            return self._pump_event_ordered(pump, pairs, waits, record, keep, to_device=False)
        flat = self._check(pairs, torch.device("cpu"), self.device)
        if not flat and record is None:
            return
        d = self._d2h
        with d.lock:
            caller, ctx = self._enter(d, waits)
            if not flat:
                self._leave(d, [], caller, record, keep)
                return
            h = 0
            pending = None  # (half, dst view) of the chunk still to drain
            c = d.counts
            with ctx:
                for dst, src in self._chunks(d, flat):
                    t0 = time.perf_counter()
                    self._engine_copy(d, d.halves[h][:src.numel()], src, h)
                    c["issue_s"] += time.perf_counter() - t0
                    c["chunks"] += 1
                    if pending is not None:
                        self._drain(d, *pending)  # overlaps the DMA just queued
                    pending = (h, dst)
                    h ^= 1
                self._drain(d, *pending)
            if self._cuda and (record is not None or keep):
                self._leave(d, [], None, record, keep)
            d.synchronize()  # a skipped half wait must not leave a job writing later
            c["copies"] += 1
            c["bytes"] += sum(src.numel() for _, src in flat)

    def _enter(self, d: _Direction, waits=None):
        """Make ``d``'s stream wait for ``waits`` (CUDA events) or, when None, for the caller's
        stream (whose kernels may still use the tensors); returns the caller's stream (None
        when waits are given) and a context that makes ``d``'s current (None and a no-op
        context on CPU)."""
        if not self._cuda:
            return None, _NULL_CTX
        if waits is not None:
            for ev in waits:
                d.stream.wait_event(ev)
            caller = None
        else:
            caller = torch.cuda.current_stream(self.device)
            d.stream.wait_stream(caller)
        return caller, torch.cuda.stream(d.stream)

    def _leave(self, d: _Direction, used, caller, record, keep) -> None:
        """After the last DMA of a copy: mark device tensors as used by ``d``'s stream, then
        record ``record`` or make the caller's stream wait."""
        for t in (*used, *keep):
            t.record_stream(d.stream)
        if record is not None:
            record.record(d.stream)
        elif caller is not None:
            caller.wait_stream(d.stream)

    def _chunks(self, d: _Direction, flat):
        """Size ``d``'s halves for these pairs, then yield (dst, src) views chunk by chunk."""
        plan = [(dst, src, self._chunk(src.numel(), d)) for dst, src in flat]
        if not plan:  # nothing to copy (an event-ordered call that only records)
            return
        self._ensure(d, max(c for _, _, c in plan))
        for dst, src, c in plan:
            n = src.numel()
            if c >= n:
                yield dst, src
                continue
            for off in range(0, n, c):  # the last slice is clipped to the end
                yield dst[off:off + c], src[off:off + c]

    def _drain(self, d: _Direction, h: int, dst: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self._wait_half(d, h)
        t1 = time.perf_counter()
        dst.copy_(d.halves[h][:dst.numel()])
        d.counts["wait_s"] += t1 - t0
        d.counts["memcpy_s"] += time.perf_counter() - t1

    def stats(self) -> dict:
        """Per direction: copies, chunks, bytes, and the calling thread's seconds waiting for a
        half (the copy engine is behind), in the host memcpy, and issuing DMAs and events. A
        memcpy rate (bytes / memcpy_s) well below the link's says the host side is the limit."""
        out = {}
        for name, d in (("h2d", self._h2d), ("d2h", self._d2h)):
            with d.lock:
                c = dict(d.counts)
                if d.native is not None:  # the delivery worker's own chunk loop
                    d.native.add_stats(c)
            c["memcpy_gbps"] = round(c["bytes"] / c["memcpy_s"] / 1e9, 2) if c["memcpy_s"] else None
            out[name] = c
        return out

    def synchronize(self) -> None:
        """Block until every copy queued on this buffer's streams (or CPU workers) is done."""
        for d in (self._h2d, self._d2h):
            if d.stream is not None:
                d.stream.synchronize()
            d.synchronize()

    def close(self) -> None:
        """Wait for in-flight copies, free the memory and CPU workers; a later copy starts over."""
        for d in (self._h2d, self._d2h):
            with d.lock:
                d.synchronize()
                d.free()
                if d.worker is not None:
                    d.worker.stop()
                if d.native is not None:  # its counters stay in the direction's
                    d.native.add_stats(d.counts)
                    d.native.stop()
                    d.native, d.stale = None, False


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_CTX = _NullCtx()
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
