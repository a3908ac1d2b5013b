"""Capped, double-buffered staging for copies between pageable host memory and a device.

PyTorch copies pageable host memory to a GPU at a fraction of the pinned rate (7 of 55 GB/s on
the H200 machine), and pinning a multi-GiB KV cache up front is slow and can exhaust locked
memory. Instead each copy is bounced through a small pinned buffer in chunks, so the host
memcpy of one chunk overlaps the DMA of the previous one.

Owns:
  StagingBuffer   the memory: at most `cap_bytes` per device, split into a host-to-device and a
                  device-to-host direction (the link is full duplex, so a delivery and a
                  write-back never wait for each other), each two halves, pinned. It grows to
                  what the copies need, never past the cap, and never shrinks (pinning is slow;
                  kept for reuse on purpose).
  staged_queue()  the copy queue of one direction (queues.CopyQueue): the compiled worker
                  (pump.c, a C thread, no GIL) where it builds, else `PyStagedQueue`, the same
                  loop in Python, which is also the tests' oracle. One queue per direction owns
                  that direction's halves, so no lock is needed between copies.
Must not: hold more than `cap_bytes`, touch a half on the host while a DMA may still use it,
or drop a caller's device tensor before the DMA that uses it has been issued.

Why by hand: PyTorch has no chunked pageable copy (its own pageable `copy_` is the slow path
this replaces), and CUDA's driver-side staging is neither capped nor overlapped.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from kvferry.transport import hostmem
from kvferry.transport.events import SlotEvent
from kvferry.transport.queues import CopyQueue, ThreadQueue

log = logging.getLogger(__name__)

DEFAULT_CAP_BYTES = 64 << 20
_PAGE = 4096
# Share of the cap for the host-to-device halves (24 MiB each of the default 64 MiB), the rest
# device to host (8 MiB halves): deliveries carry the bulk of the bytes (a whole context per
# decode step), write-backs a few rows.
H2D_SHARE = 0.75
# A copy is cut into at least SPLIT chunks of at least MIN_CHUNK bytes (at most a half), so the
# memcpy of chunk k + 1 overlaps the DMA of chunk k; consecutive copies continue the alternation
# of halves, so a stream of small copies overlaps too. Chunks are large because each costs a
# parallel memcpy start and a host wait for its half: pageable decode on an H100 machine (8
# layers of the Llama-3-8B shape, 16k / 32k context, % of pinned in the same run) gave 51 / 64%
# with 16 MiB, 35-41 / 37-39% with 4 MiB and 41 / 40% with 1 MiB (docs/results.md).
MIN_CHUNK = 16 << 20
SPLIT = 4


def chunk_bytes(n: int, half_cap: int, min_chunk: int | None = None) -> int:
    """Bytes per chunk for an n-byte copy (the last chunk may be shorter): whole pages, so
    chunk starts keep the source's alignment."""
    c = max(min_chunk or MIN_CHUNK, -(-n // SPLIT))
    c = -(-c // _PAGE) * _PAGE
    return max(1, min(c, n, half_cap))


class _Direction:
    """One direction's two halves (pinned on CUDA), grown on demand within its share."""

    def __init__(self, buffer: "StagingBuffer", cap: int):
        self.buffer, self.cap = buffer, cap  # cap: both halves together
        self.mem: torch.Tensor | None = None
        self.half = 0

    @property
    def half_cap(self) -> int:
        return self.cap // 2

    def halves(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two halves of at least `need` bytes (<= half_cap). The caller has made sure no copy
        uses the old halves when they must grow."""
        if need > self.half:
            half = min(self.half_cap, max(_PAGE, 1 << max(need - 1, 0).bit_length()))
            self.free()  # before the new one: the cap holds at every moment
            self.mem = self.buffer.alloc(2 * half)
            self.half = half
            self.buffer.note_growth()
        return self.mem[:self.half], self.mem[self.half:]

    def free(self) -> None:
        if self.mem is not None:
            self.buffer.release(self.mem)
        self.mem, self.half = None, 0


class StagingBuffer:
    """Pinned staging memory of at most `cap_bytes` for one device (see the module docstring)."""

    def __init__(self, device: torch.device, cap_bytes: int = DEFAULT_CAP_BYTES):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 4 * _PAGE:
            raise ValueError(f"staging cap must be an integer of at least {4 * _PAGE} bytes, got {cap_bytes!r}")
        self.device, self.cap_bytes = device, cap_bytes
        h2d = int(cap_bytes * H2D_SHARE) // (2 * _PAGE) * 2 * _PAGE
        self.h2d = _Direction(self, h2d)
        self.d2h = _Direction(self, (cap_bytes - h2d) // (2 * _PAGE) * 2 * _PAGE)
        self.peak_bytes = 0
        self._pins: dict[int, object] = {}

    @property
    def pinned_bytes(self) -> int:
        """Bytes held now (pinned on CUDA, plain host memory on CPU)."""
        return 2 * (self.h2d.half + self.d2h.half)

    def note_growth(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.pinned_bytes)
        log.debug("staging %s: %d bytes held (cap %d)", self.device, self.pinned_bytes, self.cap_bytes)

    def alloc(self, nbytes: int) -> torch.Tensor:
        # its own mapping (huge pages where the system gives them), pinned in place: torch's
        # pinned allocator would keep freed blocks pinned in its cache, beyond the cap
        with torch.inference_mode(False):  # plain storage, writable from any thread
            mem = hostmem.alloc_host(nbytes)
        if self.device.type == "cuda":
            self._pins[mem.data_ptr()] = hostmem.pin(mem, what="the staging buffer")
        return mem

    def release(self, mem: torch.Tensor) -> None:
        pin = self._pins.pop(mem.data_ptr(), None)
        if pin is not None:
            pin()

    def close(self) -> None:
        """Free the halves (their queues are fenced first: see StagedQueues.close)."""
        self.h2d.free()
        self.d2h.free()


def _check_pairs(pairs, to_device: bool, device: torch.device):
    """[(dst_ptr, src_ptr, nbytes)] of non-empty pairs, after checking devices and sizes."""
    host = torch.device("cpu")
    dst_dev, src_dev = (device, host) if to_device else (host, device)
    out = []
    for dst, src in pairs:
        for t, dev, what in ((dst, dst_dev, "dst"), (src, src_dev, "src")):
            if t.device != dev:
                raise ValueError(f"staging copy: {what} is on {t.device}, expected {dev}")
            if not t.is_contiguous():
                raise ValueError(f"staging copy: {what} must be contiguous (strides {t.stride()})")
        if dst.nbytes != src.nbytes:
            raise ValueError(f"staging copy: size mismatch, src has {src.nbytes} bytes, dst {dst.nbytes}")
        if src.nbytes:
            out.append((dst.data_ptr(), src.data_ptr(), src.nbytes))
    return out


def _plan(q, raw) -> tuple[int, tuple]:
    """Chunk size and halves for a job of `raw` pairs. The halves grow only while the queue is
    idle (fenced first, so no DMA still uses them); while jobs are queued, a larger copy takes
    chunks of the halves there are. Never a wait on the queued jobs themselves: one of them may
    wait for a gate that the caller marks only after this submit."""
    if not raw:
        return 1, (None, None)
    d = q.dir
    chunk = chunk_bytes(max(n for _, _, n in raw), d.half_cap, q.min_chunk)
    if chunk > d.half:
        if d.half and not q.idle():
            chunk = d.half
        else:
            q.fence()
    return chunk, d.halves(chunk)


class NativeQueue(CopyQueue):
    """A direction's copies on the compiled worker (pump.c)."""

    def __init__(self, pump, direction: _Direction, to_device: bool, delay_s=None, seed=0,
                 min_chunk: int | None = None):
        from kvferry.transport.pump import Lane
        buf = direction.buffer
        super().__init__(buf.device, delay_s, seed)
        self.dir, self.to_device, self.min_chunk, self._pump = direction, to_device, min_chunk, pump
        cuda = buf.device.type == "cuda"
        lane = Lane(to_device=int(to_device), nthreads=_memcpy_threads(), device=buf.device.index or 0)
        if cuda:
            self.stream = torch.cuda.Stream(buf.device)
            self._half_events = [torch.cuda.Event(), torch.cuda.Event()]
            for i, ev in enumerate(self._half_events):  # recorded now: the worker needs handles
                ev.record(self.stream)
                lane.half_event[i] = ev.cuda_event
            lane.stream = self.stream.cuda_stream
        self._worker = pump.worker(lane)
        self._last: SlotEvent | None = None

    def event(self, name=""):
        ev = SlotEvent(self.device, name)
        ev.store = self._pump.store
        return ev

    def submit(self, pairs, waits=(), signal=None, keep=()):
        raw = _check_pairs(pairs, self.to_device, self.device)  # refused before anything is queued
        chunk, halves = _plan(self, raw)
        if signal is None:  # a fence needs something to wait for
            signal = self._last = self._last or self.event("last")
        gen = signal.arm()
        signal.waiter = self._worker.wait
        if signal.cuda is not None and not signal.cuda.cuda_event:
            signal.cuda.record(self.stream)  # created now, so the worker has a handle to record
        if signal.cuda is not None:
            for t in keep:  # after the job is issued, the allocator waits for this stream's copies
                t.record_stream(self.stream)
        self._hold(signal, gen, keep)
        try:
            self._worker.submit(raw, chunk, [h.data_ptr() if h is not None else None for h in halves],
                                [ev.cuda.cuda_event for ev in waits if ev.cuda is not None],
                                [(ev.ctr, ev.armed) for ev in waits],
                                signal.cuda.cuda_event if signal.cuda is not None else None,
                                (signal.ctr, gen), int(self._delay() * 1e6))
        except BaseException:
            signal.mark(gen)  # never queued: no waiter may hang on it
            raise

    def fence(self):
        self._worker.wait()
        self._held.clear()
        if self.device.type == "cuda":
            self.stream.synchronize()

    def busy_seconds(self):
        return self._worker.busy_seconds()

    def idle(self) -> bool:
        return self._worker.idle()

    def close(self):
        try:
            self.fence()
        finally:
            self._worker.stop()


class PyStagedQueue(ThreadQueue):
    """The staged loop in Python on a copy thread: the fallback where the compiled worker cannot
    be built, and the oracle the tests compare it to. On CPU the "DMA" is itself queued on a
    stand-in copy engine (a ThreadQueue) with a SlotEvent per half, so the half wait is what
    keeps a half from being overwritten while its copy is in flight, as on a GPU."""

    def __init__(self, direction: _Direction, to_device: bool, delay_s=None, seed=0,
                 min_chunk: int | None = None, _unsafe_skip_half_wait: bool = False):
        buf = direction.buffer
        super().__init__(buf.device, delay_s, seed, name="kvferry-staging")
        self.dir, self.to_device, self.min_chunk = direction, to_device, min_chunk
        self._skip_half_wait = _unsafe_skip_half_wait  # negative control for the tests
        if buf.device.type == "cuda":
            self.stream = torch.cuda.Stream(buf.device)
            self._dma = None
        else:
            self._dma = ThreadQueue(buf.device, name="kvferry-dma")  # the stand-in copy engine
        self._half_ev = [SlotEvent(buf.device, f"half{i}") for i in range(2)]
        self._h = 0

    def submit(self, pairs, waits=(), signal=None, keep=()):
        raw = _check_pairs(pairs, self.to_device, self.device)
        chunk, halves = _plan(self, raw)
        if self.device.type == "cuda":
            for t in keep:
                t.record_stream(self.stream)
        flat = [(_bytes(d), _bytes(s)) for d, s in pairs if s.nbytes]
        super().submit([(flat, chunk, halves)], waits, signal, keep)

    def idle(self) -> bool:
        with self._cv:
            return not self._pending

    def run(self, jobs, waits, record):
        (flat, chunk, halves), = jobs
        cuda = self.device.type == "cuda"
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            for ev in waits:
                self.stream.wait_event(ev)
            if self.to_device:
                for dst, src in flat:
                    for off in range(0, src.numel(), chunk):
                        n = min(chunk, src.numel() - off)
                        stage = halves[self._h][:n]
                        self._wait_half(self._h)  # its previous DMA may still read it
                        stage.copy_(src[off:off + n])
                        self._dma_copy(dst[off:off + n], stage, self._h)
                        self._h ^= 1
            else:
                pend = None
                for dst, src in flat:
                    for off in range(0, src.numel(), chunk):
                        n = min(chunk, src.numel() - off)
                        self._wait_half(self._h)  # drained before it is written again
                        self._dma_copy(halves[self._h][:n], src[off:off + n], self._h)
                        if pend is not None:
                            self._drain(*pend)  # under this chunk's DMA
                        pend = (self._h, dst[off:off + n], halves[self._h][:n])
                        self._h ^= 1
                if pend is not None:
                    self._drain(*pend)
            if record is not None:
                record.record(self.stream)
        if self._dma is not None:  # on CPU a job's signal means its bytes have landed
            for h in (0, 1):
                self._half_done(h)

    def _dma_copy(self, dst, src, h):
        ev = self._half_ev[h]
        if self._dma is None:
            dst.copy_(src, non_blocking=True)
            g = ev.arm()
            ev.cuda.record(self.stream)
            ev.mark(g)
        else:
            self._dma.submit([(dst, src)], signal=ev)

    def _half_done(self, h):
        """The host waits for the last DMA through half h."""
        ev = self._half_ev[h]
        ev.wait_host(ev.armed)
        if ev.cuda is not None:
            ev.cuda.synchronize()

    def _wait_half(self, h):
        if not self._skip_half_wait:
            self._half_done(h)

    def _drain(self, h, dst, half):
        self._half_done(h)  # always: the bytes must be in the half before they are read
        dst.copy_(half)

    def fence(self):
        super().fence()
        if self._dma is not None:
            self._dma.fence()
        if self.device.type == "cuda":
            self.stream.synchronize()

    def close(self):
        super().close()
        if self._dma is not None:
            self._dma.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dim() != 1 or t.dtype != torch.uint8 else t


def _memcpy_threads() -> int:
    # Two cores fewer than PyTorch's intra-op count: the decode thread and the other lane keep
    # a core each while a memcpy runs beside them. Measured on the H200 machine on 2026-12-03
    # (pageable decode, the copy thread's compiled loop): 14 of 16 threads beat 16 and 10-12.
    return max(1, torch.get_num_threads() - 2)


def staged_queue(buffer: StagingBuffer, to_device: bool, *, python: bool = False, delay_s=None,
                 seed: int = 0, min_chunk: int | None = None) -> CopyQueue:
    """The copy queue of one direction of `buffer`: the compiled worker unless `python` (or it
    cannot be built here), else the Python loop."""
    direction = buffer.h2d if to_device else buffer.d2h
    if not python:
        from kvferry.transport.pump import load_pump
        pump = load_pump(buffer.device.type == "cuda")
        if pump is not None:
            return NativeQueue(pump, direction, to_device, delay_s, seed, min_chunk)
    return PyStagedQueue(direction, to_device, delay_s, seed, min_chunk)


class StagedQueues:
    """A device's staging buffer with the queue of each direction; every staged copy (host KV
    deliveries and write-backs, weight uploads) goes through these two queues."""

    def __init__(self, device: torch.device, cap_bytes: int = DEFAULT_CAP_BYTES, *, python: bool = False):
        self.buffer = StagingBuffer(device, cap_bytes)
        self.device = self.buffer.device
        self.h2d = staged_queue(self.buffer, True, python=python)
        self.d2h = staged_queue(self.buffer, False, python=python)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host `src` into device `dst`; work queued on the current stream afterwards sees
        the bytes, and `src` may be reused on return."""
        done = self.h2d.event("upload")
        self.h2d.submit([(dst, src)], signal=done, keep=[dst])
        done.wait_host(done.armed)  # every byte of src has been read
        if done.cuda is not None:
            torch.cuda.current_stream(self.device).wait_event(done.cuda)

    def fence(self) -> None:
        self.h2d.fence()
        self.d2h.fence()

    def close(self) -> None:
        for q in (self.h2d, self.d2h):
            q.close()
        self.buffer.close()
