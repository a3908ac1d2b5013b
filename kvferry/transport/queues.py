"""Copy queues: the one interface through which the transport moves bytes.

A queue runs jobs in submission order. `submit(pairs, waits, signal, keep)` queues the copies
of `pairs` (dst, src), contiguous tensors of one size in bytes, to run after the `waits`
(SlotEvents, at the generation armed when submitted), then marks `signal`; it returns at
once. `fence()` makes the host wait for every job submitted so far; `close()` fences and
stops the queue.

  StreamQueue   CUDA, pinned host memory: copies issued straight onto the queue's copy
                stream (runtime calls: cudart.py); ordering is stream to stream
                (wait_event / record).
  ThreadQueue   a Python thread that runs jobs in order. On CPU it stands in for the copy
                engine (SlotEvents' host counters in place of CUDA events), so the transport's
                ordering and its races run where CI runs.
The staged queues for pageable host memory (the compiled worker, and the Python loop that is
its fallback and test oracle) are in staging.py.

Every queue takes `delay_s`, (lo, hi) seconds: a test hook that sleeps a random time before
each job (on CUDA, the copy stream sleeps), to widen races for the exactness gates.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time

import torch

from kvferry.transport.events import SlotEvent


class CopyQueue:
    timing = False  # time each job (--kv-debug 2); only StreamQueue needs to be told

    def __init__(self, device: torch.device, delay_s: tuple[float, float] | None = None, seed: int = 0):
        self.device = device
        self.delay_s = delay_s
        self._rng = random.Random(seed)
        # device tensors a queued job reads or writes, held until the job has been issued, so
        # the allocator cannot hand their memory out before the copy engine is done with it
        self._held: collections.deque = collections.deque()

    def event(self, name: str = "") -> SlotEvent:
        return SlotEvent(self.device, name)

    def submit(self, pairs, waits=(), signal: SlotEvent | None = None, keep=()) -> None:
        raise NotImplementedError

    def fence(self) -> None:
        raise NotImplementedError

    def busy_seconds(self) -> float:
        """Seconds spent copying so far (debug use; fences first where the copies are async)."""
        return 0.0

    def close(self) -> None:
        self.fence()

    def _delay(self) -> float:
        return self._rng.uniform(*self.delay_s) if self.delay_s else 0.0

    def _hold(self, signal: SlotEvent | None, gen: int, keep) -> None:
        """Keep ``keep`` alive until ``signal`` reaches ``gen``; drop what is done."""
        held = self._held
        while held and held[0][0].done >= held[0][1]:
            held.popleft()
        if keep:
            held.append((signal, gen, list(keep)))


class StreamQueue(CopyQueue):
    """Pinned host memory on CUDA: the copies go straight onto a copy stream, each one a runtime
    call (cudart.Memcpy: PyTorch's copy_ costs several times its host time, per layer and step)."""

    def __init__(self, device, delay_s=None, seed=0):
        super().__init__(device, delay_s, seed)
        from kvferry.transport.cudart import Memcpy
        self.stream = torch.cuda.Stream(device)
        self._handle = self.stream.cuda_stream
        self._memcpy = Memcpy()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._busy = 0.0

    def submit(self, pairs, waits=(), signal=None, keep=()):
        stream = self.stream
        for ev in waits:
            ev.wait_host(ev.armed)  # recorded on its stream (a worker may record it)
            stream.wait_event(ev.cuda)
        if self.delay_s:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(self._delay() * 1.5e9))
        if self.timing:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(stream)
        for dst, src in pairs:
            self._memcpy(dst, src, self._handle)
        if self.timing:
            t1.record(stream)
            self._timed.append((t0, t1))
        for t in keep:  # device tensors read or written on this stream
            t.record_stream(stream)
        if signal is not None:
            g = signal.arm()
            signal.cuda.record(stream)
            signal.mark(g)

    def fence(self):
        self.stream.synchronize()

    def busy_seconds(self):
        self.fence()
        self._busy += sum(a.elapsed_time(b) for a, b in self._timed) / 1e3
        self._timed.clear()
        return self._busy


class ThreadQueue(CopyQueue):
    """Jobs run in order on one Python thread; `run` copies one job's pairs (plain copies
    here, the staged loop in a subclass). An error is raised by the next call from the caller,
    and the failed job's signal is still marked, so no waiter hangs."""

    def __init__(self, device, delay_s=None, seed=0, name="kvferry-copy"):
        super().__init__(device, delay_s, seed)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._busy = 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, pairs, waits=(), signal=None, keep=()):
        self._raise()
        gens = [(ev, ev.armed) for ev in waits]
        sig = (signal, signal.arm()) if signal is not None else None
        self._hold(signal, sig[1] if sig else 0, keep if sig else ())
        with self._cv:
            self._pending += 1
        self._jobs.put((list(pairs), gens, sig, self._delay()))

    def run(self, pairs, waits, record) -> None:
        """Copy ``pairs``; ``waits``/``record``: CUDA events to order by (None on CPU)."""
        for dst, src in pairs:
            dst.copy_(src)

    def _loop(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, gens, sig, delay = job
            try:
                for ev, g in gens:
                    ev.wait_host(g)
                if delay:
                    time.sleep(delay)
                t0 = time.perf_counter()
                with torch.inference_mode():  # callers' tensors may be inference tensors
                    self.run(pairs, [ev.cuda for ev, _ in gens if ev.cuda is not None],
                             sig[0].cuda if sig else None)
                self._busy += time.perf_counter() - t0
            except BaseException as e:  # raised on the caller's next call
                self._error = self._error or e
            finally:
                if sig:
                    sig[0].mark(sig[1])
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _raise(self):
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def fence(self):
        with self._cv:
            while self._pending:
                self._cv.wait()
        self._held.clear()
        self._raise()

    def busy_seconds(self):
        return self._busy

    def close(self):
        try:
            self.fence()
        finally:
            self._jobs.put(None)
            self._thread.join(timeout=10)
