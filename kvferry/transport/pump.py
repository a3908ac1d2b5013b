"""The compiled copy worker (pump.c): built on first use with the system C compiler, cached per
source hash, loaded with ctypes (whose calls release the GIL).

`load_pump(cuda)` returns a `Pump`, or None when it cannot be had (no compiler, a failed build,
no CUDA runtime to hand it); the staging queues then run the Python reference loop, and say so
once in the log. Why by hand: no library offers a GIL-free staged copy loop, and a ctypes-loaded
C file needs neither CUDA headers nor a build of PyTorch's extension machinery.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kvferry.transport.cudart import runtime

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("pump.c")
_LOCK = threading.Lock()
_LOADED: dict[bool, "Pump | None"] = {}
P, LL = ctypes.c_void_p, ctypes.c_longlong


class _Cuda(ctypes.Structure):
    _fields_ = [("memcpy_async", P), ("event_sync", P), ("event_record", P), ("stream_wait", P),
                ("set_device", P)]


class Lane(ctypes.Structure):
    _fields_ = [("to_device", ctypes.c_int), ("nthreads", ctypes.c_int), ("device", ctypes.c_int),
                ("stream", P), ("half_event", P * 2)]


class Pair(ctypes.Structure):
    _fields_ = [("dst", P), ("src", P), ("n", ctypes.c_size_t)]


class Job(ctypes.Structure):
    _fields_ = [("n_pairs", ctypes.c_int), ("n_waits", ctypes.c_int), ("n_gates", ctypes.c_int),
                ("pairs", ctypes.POINTER(Pair)), ("chunk", ctypes.c_size_t), ("half", P * 2),
                ("waits", ctypes.POINTER(P)), ("gate_ctr", ctypes.POINTER(ctypes.POINTER(LL))),
                ("gate_gen", ctypes.POINTER(LL)), ("record", P), ("signal_ctr", ctypes.POINTER(LL)),
                ("signal_gen", LL), ("delay_us", ctypes.c_long), ("next", P), ("ticket", LL)]


class Pump:
    def __init__(self, lib: ctypes.CDLL, cuda: _Cuda | None):
        self.lib, self.cuda = lib, cuda
        for name, args, res in (
                ("kvf_worker_start", [P, ctypes.POINTER(Lane)], P),
                ("kvf_worker_submit", [P, ctypes.POINTER(Job)], LL),
                ("kvf_worker_wait", [P, ctypes.POINTER(LL), LL], ctypes.c_int),
                ("kvf_worker_busy", [P], ctypes.c_double),
                ("kvf_worker_idle", [P], ctypes.c_int),
                ("kvf_worker_stop", [P], None),
                ("kvf_store", [ctypes.POINTER(LL), LL], None)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.store = lib.kvf_store  # store(c_longlong, value): a release store, read by the worker

    def worker(self, lane: Lane) -> "Worker":
        return Worker(self, lane)


class Worker:
    """One lane's job queue, run in order on a C thread (see pump.c)."""

    def __init__(self, pump: Pump, lane: Lane):
        self.lib = pump.lib
        self._lane = lane  # kept alive: the worker copied it, but its arrays live here
        self._w = self.lib.kvf_worker_start(ctypes.byref(pump.cuda) if pump.cuda is not None else None,
                                            ctypes.byref(lane))
        if not self._w:
            raise RuntimeError("staging: could not start the copy worker thread")

    def submit(self, pairs, chunk: int, halves, waits, gates, record, signal, delay_us: int = 0) -> None:
        """pairs [(dst_ptr, src_ptr, nbytes)]; halves two pointers; waits and record raw CUDA
        event handles; gates [(c_longlong, gen)]; signal (c_longlong, gen) or None."""
        n, nw, ng = len(pairs), len(waits), len(gates)
        job = Job(n_pairs=n, n_waits=nw, n_gates=ng, chunk=chunk, record=record, delay_us=delay_us,
                  pairs=(Pair * max(1, n))(*(Pair(*p) for p in pairs)),
                  waits=(P * max(1, nw))(*waits),
                  gate_ctr=(ctypes.POINTER(LL) * max(1, ng))(*(ctypes.pointer(c) for c, _ in gates)),
                  gate_gen=(LL * max(1, ng))(*(g for _, g in gates)))
        job.half[0], job.half[1] = halves
        if signal is not None:
            job.signal_ctr, job.signal_gen = ctypes.pointer(signal[0]), signal[1]
        if self.lib.kvf_worker_submit(self._w, ctypes.byref(job)) < 0:
            raise MemoryError("staging: no memory to queue a copy")

    def wait(self, ctr: ctypes.c_longlong | None = None, gen: int = 0) -> None:
        """Block (GIL released) until a job set ``ctr`` to ``gen``, or with no ``ctr`` until
        every queued job has run; raises a job's CUDA error."""
        err = self.lib.kvf_worker_wait(self._w, ctypes.byref(ctr) if ctr is not None else None, gen)
        if err:
            raise RuntimeError(f"staging: CUDA error {err} in a queued copy")

    def busy_seconds(self) -> float:
        return self.lib.kvf_worker_busy(self._w)

    def idle(self) -> bool:
        return bool(self.lib.kvf_worker_idle(self._w))

    def stop(self) -> None:
        if self._w:
            self.lib.kvf_worker_stop(self._w)
            self._w = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "kvferry"


def _build() -> Path | None:
    src = _SRC.read_bytes()
    out = _cache_dir() / f"pump-{hashlib.sha256(src).hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("staging: no C compiler found (set CC), using the Python copy loop")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        cmd = [cc, "-O3", "-fopenmp", "-pthread", "-shared", "-fPIC", "-o", str(so), str(_SRC)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("staging: building the copy worker failed (%s), using the Python copy loop: %s",
                        " ".join(cmd), r.stderr.strip()[-500:])
            return None
        os.replace(so, out)  # atomic: concurrent builders leave one complete file
    return out


def load_pump(cuda: bool) -> Pump | None:
    with _LOCK:
        if cuda in _LOADED:
            return _LOADED[cuda]
        pump = None
        try:
            so = _build()
            if so is not None:
                funcs = None
                rt = runtime() if cuda else None
                if cuda and rt is None:
                    log.info("staging: PyTorch's CUDA runtime library not found, using the Python copy loop")
                else:
                    if rt is not None:
                        funcs = _Cuda(*(ctypes.cast(getattr(rt, n), P).value for n in (
                            "cudaMemcpyAsync", "cudaEventSynchronize", "cudaEventRecord",
                            "cudaStreamWaitEvent", "cudaSetDevice")))
                    pump = Pump(ctypes.CDLL(str(so)), funcs)
                    log.debug("staging: compiled copy worker loaded (%s)", so)
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            log.warning("staging: compiled copy worker unavailable (%s), using the Python copy loop", e)
        _LOADED[cuda] = pump
        return pump
