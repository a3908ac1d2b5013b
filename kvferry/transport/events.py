"""Slot events: what orders the copy side and the compute side of the transport.

A `SlotEvent` pairs a CUDA event (None on CPU) with a generation counter on the host. `arm()`
when a record is promised, `mark(gen)` once it has happened (recorded on a stream, or on CPU
completed). A wait targets the generation armed when the wait is issued, as a CUDA stream wait
targets the event's latest record. The counter is a ctypes integer so that the compiled copy
worker (pump.c) can read it without the GIL: those reads are its "gates".

`Compute` is the compute side: it waits for an event before reading what it guards and records
events after its kernels, on the device's current stream.
"""

from __future__ import annotations

import ctypes
import threading

import torch


class SlotEvent:
    def __init__(self, device: torch.device, name: str = ""):
        self.name = name
        self.cuda = torch.cuda.Event() if device.type == "cuda" else None
        self._cv = threading.Condition()
        self.armed = 0
        self.ctr = ctypes.c_longlong(0)  # the generation marked done (read by the C worker)
        # set by a queue whose worker marks `ctr` itself: how to wait for it (GIL released)
        self.waiter = None
        self.store = None  # a release store for `ctr` where a C worker reads it

    @property
    def done(self) -> int:
        return self.ctr.value

    def arm(self) -> int:
        with self._cv:
            self.armed += 1
            return self.armed

    def mark(self, gen: int) -> None:
        with self._cv:
            if gen > self.ctr.value:
                if self.store is not None:
                    self.store(self.ctr, gen)
                else:
                    self.ctr.value = gen
            self._cv.notify_all()

    def wait_host(self, gen: int) -> None:
        """Until generation ``gen`` is marked (on CUDA: recorded, not finished)."""
        if self.ctr.value >= gen:
            return
        if self.waiter is not None:
            self.waiter(self.ctr, gen)  # raises the worker's error, if any
            return
        with self._cv:
            while self.ctr.value < gen:
                self._cv.wait()


class Compute:
    """The compute side's half of the ordering, on the device's current stream: the one that
    `begin()` found at a pass's start (looking it up per call costs host time per layer), or
    the current one at each call before any pass."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None
        self.handle = None  # the stream's cudaStream_t, for runtime calls (cudart.Memcpy)

    def begin(self) -> None:
        if self.device.type == "cuda":
            self.stream = torch.cuda.current_stream(self.device)
            self.handle = self.stream.cuda_stream

    def _stream(self):
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    def wait(self, ev: SlotEvent) -> None:
        """Work queued after this reads what ``ev`` guards only once it is there."""
        ev.wait_host(ev.armed)
        if ev.cuda is not None:
            self._stream().wait_event(ev.cuda)

    def record(self, ev: SlotEvent) -> None:
        """Mark the point after the work queued so far."""
        g = ev.arm()
        if ev.cuda is not None:
            ev.cuda.record(self._stream())
        ev.mark(g)  # on CPU compute is synchronous: done when recorded
