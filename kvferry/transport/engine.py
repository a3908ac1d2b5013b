"""Copy engines: where deliveries and write-backs run, and the events that order them.

The transport talks to one of two engines through the same five calls (`copy`,
`compute_wait`, `compute_record`, `fence`, `close`):
  CudaCopyEngine     pinned host memory: async copies issued straight onto two copy
                     streams (lane 0 deliveries, lane 1 write-backs); ordering is stream
                     to stream (wait_event / record).
  ThreadCopyEngine   one worker thread per lane runs its copies in FIFO order. On CPU it
                     stands in for the copy engine (threading events in place of CUDA
                     events), so the ordering logic and its races run where CI runs. On a
                     GPU with pageable host memory it drives the staging buffer, whose
                     chunk loop needs a host thread, still recording CUDA events. A lane
                     can be "inline": its copies run on the calling thread at the call
                     (the pageable cache stages deliveries on the decode thread that way,
                     between layers, with no second Python thread contending for the GIL).
Every event is a `SlotEvent` with a generation counter: `arm()` when a record is
promised, `mark()` when it has happened (recorded on a stream, or completed on CPU).
A wait targets the generation armed at the time it is issued, as a CUDA stream wait
targets the event's latest record.
"""

from __future__ import annotations

import ctypes
import queue
import random
import threading
import time
from typing import Callable

import torch


class SlotEvent:
    def __init__(self, device: torch.device, name: str = ""):
        self.name = name
        self.cuda = torch.cuda.Event() if device.type == "cuda" else None
        self._cv = threading.Condition()
        self.armed = 0
        self.done = 0
        # `done` for a delivery worker (native lanes), which reads it without the GIL: set with
        # `store` (a release store) where one is given. `native_wait(ctr, gen)`, when set,
        # is how to wait for an event that the worker marks (it sets ctr, not `done`).
        self.ctr = ctypes.c_longlong(0)
        self.store = None
        self.native_wait = None

    def arm(self) -> int:
        with self._cv:
            self.armed += 1
            return self.armed

    def mark(self, gen: int) -> None:
        with self._cv:
            self.done = max(self.done, gen)
            if self.store is not None:
                self.store(self.ctr, self.done)
            else:
                self.ctr.value = self.done
            self._cv.notify_all()

    def wait_host(self, gen: int) -> None:
        with self._cv:
            if self.done >= gen:
                return
            native_wait = self.native_wait
        if native_wait is not None:
            native_wait(self.ctr, gen)  # raises the worker's error, if any
            self.mark(gen)
            return
        with self._cv:
            while self.done < gen:
                self._cv.wait()


class CopyEngine:
    """Interface shared by the engines."""

    def __init__(self, device: torch.device, delay_s: tuple[float, float] | None = None, seed: int = 0):
        self.device = device
        # test hook: random delay (lo, hi) seconds before each copy, or {lane: (lo, hi)}
        self.delay_s = delay_s if isinstance(delay_s, dict) or delay_s is None else {0: delay_s, 1: delay_s}
        self._rng = random.Random(seed)
        self.copy_s = 0.0  # copy time (--kv-debug 2): host-measured on the worker, events on CUDA
        self.timing = False

    def event(self, name="") -> SlotEvent:
        return SlotEvent(self.device, name)

    def copy(self, jobs: list[tuple[torch.Tensor, torch.Tensor]], waits: list[SlotEvent],
             signal: SlotEvent | None, keep: list[torch.Tensor] = (), lane: int = 0) -> None:
        """Run `jobs` (dst, src) after `waits`, then record `signal`. Lane 0 carries
        deliveries (host to device), lane 1 write-backs (device to host): each lane is in
        order, and the two run concurrently, so a write-back that waits for the compute
        side never holds up the deliveries queued behind it."""
        raise NotImplementedError

    def compute_wait(self, ev: SlotEvent) -> None:
        raise NotImplementedError

    def compute_record(self, ev: SlotEvent) -> None:
        raise NotImplementedError

    def fence(self) -> None:
        """Host waits until every issued copy has finished (never inside the decode loop)."""
        raise NotImplementedError

    def copy_seconds(self) -> float:
        """Total time spent copying so far (fences first on CUDA; debug use only)."""
        return self.copy_s

    def close(self) -> None:
        pass


class CudaCopyEngine(CopyEngine):
    def __init__(self, device, delay_s=None, seed=0):
        super().__init__(device, delay_s, seed)
        self.streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def copy(self, jobs, waits, signal, keep=(), lane=0):
        stream = self.streams[lane]
        with torch.cuda.stream(stream):
            for ev in waits:  # recorded by this thread already: a stream wait is enough
                stream.wait_event(ev.cuda)
            if self.delay_s and lane in self.delay_s:
                torch.cuda._sleep(int(self._rng.uniform(*self.delay_s[lane]) * 1.5e9))
            if self.timing:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(stream)
            for dst, src in jobs:
                dst.copy_(src, non_blocking=True)
            if self.timing:
                t1.record(stream)
                self._timed.append((t0, t1))
            for t in keep:  # device tensors read on this stream: keep them from reuse
                t.record_stream(stream)
            if signal is not None:
                g = signal.arm()
                signal.cuda.record(stream)
                signal.mark(g)

    def compute_wait(self, ev):
        ev.wait_host(ev.armed)
        torch.cuda.current_stream(self.device).wait_event(ev.cuda)

    def compute_record(self, ev):
        g = ev.arm()
        ev.cuda.record(torch.cuda.current_stream(self.device))
        ev.mark(g)

    def fence(self):
        for st in self.streams:
            st.synchronize()

    def copy_seconds(self):
        self.fence()
        self.copy_s += sum(a.elapsed_time(b) for a, b in self._timed) / 1e3
        self._timed.clear()
        return self.copy_s


def _plain_copies(jobs, lane, waits, record, keep):
    for dst, src in jobs:
        dst.copy_(src)


class ThreadCopyEngine(CopyEngine):
    def __init__(self, device, delay_s=None, seed=0, copy_fn: Callable | None = None,
                 fence_fn: Callable | None = None, inline_lanes=(), native=None):
        super().__init__(device, delay_s, seed)
        # native: None, or (submit, wait, drain, store) for lane 0 on a delivery worker (a C
        # thread, staging.submit_to_device): submit(jobs, *, waits, gates, record, signal, keep)
        # queues a job, wait(ctr, gen) waits for its signal, drain() for all of them, store a
        # release store for the counters the worker reads. Change only after fence().
        self.native = native
        # lanes whose copies run on the caller's thread, in call order (the caller's calls on
        # such a lane are then in FIFO order by construction); change only after fence()
        self.inline_lanes = frozenset(inline_lanes)
        self.cuda = device.type == "cuda"
        if self.cuda and copy_fn is None:
            raise ValueError("ThreadCopyEngine on CUDA needs a copy_fn that orders its copies by "
                             "the given events (the staging buffer's); plain copies would not")
        # copy_fn(jobs, lane, waits, record, keep) runs one copy() call's jobs after the host
        # waits. On CUDA it orders them itself: CUDA events to wait for before, one to record
        # after, tensors to mark as used; fence_fn then waits for what it queued. On CPU it
        # gets None, None, () (the copies are done when it returns); the default copies the
        # jobs one by one.
        self.copy_fn = copy_fn or _plain_copies
        self.fence_fn = fence_fn
        self._queues: list[queue.Queue] = [queue.Queue(), queue.Queue()]
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        # diagnostics (benchmarks/pageable_probe.py): per lane, seconds busy on a job and seconds
        # of that spent waiting for its events; the compute thread's seconds waiting for copies
        self.lane_busy_s = [0.0, 0.0]
        self.lane_wait_s = [0.0, 0.0]
        self.lane_idle_s = [0.0, 0.0]  # a worker's seconds waiting for its next job
        self.compute_wait_s = 0.0
        self._workers = [threading.Thread(target=self._run, args=(lane,), name=f"kvferry-copy{lane}", daemon=True)
                         for lane in range(2)]
        for w in self._workers:
            w.start()

    def event(self, name="") -> SlotEvent:
        ev = SlotEvent(self.device, name)
        if self.native is not None:
            ev.store = self.native[3]
        return ev

    def copy(self, jobs, waits, signal, keep=(), lane=0):
        self._raise()
        gens = [(ev, ev.armed) for ev in waits]
        sig = (signal, signal.arm()) if signal is not None else None
        if lane == 0 and self.native is not None:
            self._submit(jobs, gens, sig, keep)
            return
        if lane in self.inline_lanes:
            try:  # an error reaches the caller at once
                self._do(lane, jobs, gens, sig, list(keep), self._rng)
            finally:
                if sig:  # marked even on error, so no waiter hangs
                    sig[0].mark(sig[1])
            return
        with self._cv:
            self._pending += 1
        self._queues[lane].put((jobs, gens, sig, list(keep)))

    def _submit(self, jobs, gens, sig, keep):
        submit, wait = self.native[:2]
        if sig is not None:
            sig[0].native_wait = wait
        try:  # the job waits for the gens on the worker thread (the gates), not here
            submit(jobs, waits=[ev.cuda for ev, _ in gens if ev.cuda is not None],
                   gates=[(ev.ctr, g) for ev, g in gens], record=sig[0].cuda if sig else None,
                   signal=(sig[0].ctr, sig[1]) if sig else None, keep=keep)
        except BaseException:
            if sig:  # never queued: marked here, so no waiter hangs
                sig[0].mark(sig[1])
            raise

    def _do(self, lane, jobs, gens, sig, keep, rng):
        t0 = time.perf_counter()
        for ev, g in gens:
            ev.wait_host(g)  # on CUDA: recorded (not finished) on its stream
        self.lane_wait_s[lane] += time.perf_counter() - t0
        if self.cuda:
            self.copy_fn(jobs, lane, [ev.cuda for ev, _ in gens], sig[0].cuda if sig else None, keep)
        else:
            if self.delay_s and lane in self.delay_s:
                time.sleep(rng.uniform(*self.delay_s[lane]))
            self.copy_fn(jobs, lane, None, None, ())
        dt = time.perf_counter() - t0
        self.copy_s += dt
        self.lane_busy_s[lane] += dt

    def _run(self, lane: int):
        q = self._queues[lane]
        rng = random.Random(self._rng.random() + lane)
        while True:
            t0 = time.perf_counter()
            item = q.get()
            self.lane_idle_s[lane] += time.perf_counter() - t0
            if item is None:
                return
            jobs, gens, sig, keep = item
            try:
                self._do(lane, jobs, gens, sig, keep, rng)
            except BaseException as e:  # surfaced on the next call from the main thread
                self._error = e
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

    def compute_wait(self, ev):
        t0 = time.perf_counter()
        ev.wait_host(ev.armed)
        self.compute_wait_s += time.perf_counter() - t0
        if ev.cuda is not None:
            torch.cuda.current_stream(self.device).wait_event(ev.cuda)
        self._raise()

    def compute_record(self, ev):
        g = ev.arm()
        if ev.cuda is not None:
            ev.cuda.record(torch.cuda.current_stream(self.device))
        ev.mark(g)  # on CPU compute is synchronous: done when recorded

    def fence(self):
        with self._cv:
            while self._pending:
                self._cv.wait()
        if self.native is not None:
            self.native[2]()
        if self.fence_fn is not None:
            self.fence_fn()
        self._raise()

    def close(self):
        self.fence()
        for q in self._queues:
            q.put(None)
        for w in self._workers:
            w.join(timeout=10)
