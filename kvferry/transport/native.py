"""The staging buffer's compiled chunk pump (pump.c): built on first use with the system C
compiler, cached per source hash, loaded with ctypes (whose calls release the GIL).

`load_pump()` returns a `Pump` or None when it cannot be had (no compiler, a failed build,
no CUDA runtime to hand it, or KVFERRY_NATIVE=0); the staging buffer then keeps its Python loop,
and says so once in the log. Why by hand: no library offers a GIL-free pageable staging loop;
a ctypes-loaded C file needs neither CUDA headers nor a build of PyTorch's extension machinery.
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
import time
from pathlib import Path

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("pump.c")
_LOCK = threading.Lock()
_STATE: dict = {}
# the host memcpy's stores (pump.c): glibc memcpy, or non-temporal (streaming) stores
COPY_MODES = {"memcpy": 0, "stream": 1}


class _Cuda(ctypes.Structure):
    _fields_ = [("memcpy_async", ctypes.c_void_p), ("event_sync", ctypes.c_void_p),
                ("event_record", ctypes.c_void_p), ("stream_wait", ctypes.c_void_p),
                ("set_device", ctypes.c_void_p)]


class Pump:
    def __init__(self, lib: ctypes.CDLL, cuda: _Cuda | None):
        self._fn = lib.kvf_h2d
        P = ctypes.c_void_p
        self._fn.argtypes = [ctypes.c_int, P, P, P, P, P, P, P, P, P, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, P, P, P, ctypes.c_int, ctypes.c_int, P, P]
        self._fn.restype = ctypes.c_int
        self._d2h = lib.kvf_d2h
        self._d2h.argtypes = [ctypes.c_int, P, P, P, P, P, P, P, P, P, ctypes.c_int, ctypes.c_int,
                              P, P, P, ctypes.c_int, P, P]
        self._d2h.restype = ctypes.c_int
        self._copy = lib.kvf_copy
        self._copy.argtypes = [P, P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        self._copy.restype = None
        self.cuda = cuda
        self.lib = lib
        LL, PLL = ctypes.c_longlong, ctypes.POINTER(ctypes.c_longlong)
        for name, args, res in (
                ("kvf_worker_start", [P, ctypes.c_int], P),
                ("kvf_worker_submit", [P, ctypes.c_int, P, P, P, P, P, P, P, P, P, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_int, P, ctypes.c_int, P, P, P, P, LL], LL),
                ("kvf_worker_wait", [P, P, LL, ctypes.c_int], ctypes.c_int),
                ("kvf_worker_half", [P, ctypes.c_int], ctypes.c_int),
                ("kvf_worker_stats", [P, P, P], None),
                ("kvf_worker_stop", [P], None),
                ("kvf_store", [PLL, LL], None)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.store = lib.kvf_store  # store(ctypes.c_longlong, value): a release store

    @staticmethod
    def _arrays(pairs):
        n = len(pairs)
        arr, sz = ctypes.c_void_p * n, ctypes.c_size_t * n
        return (n, arr(*(p[0] for p in pairs)), arr(*(p[1] for p in pairs)),
                sz(*(p[2] for p in pairs)), sz(*(p[3] for p in pairs)))

    @staticmethod
    def _add(counts, times, chunks_done):
        for k, v in zip(("wait_s", "memcpy_s", "issue_s"), times):
            counts[k] += v
        counts["chunks"] += chunks_done[0]

    def copy(self, dst: int, src: int, n: int, nthreads: int, mode: str = "memcpy") -> None:
        """The pump's host memcpy alone (benchmarks): n bytes from src to dst pointers."""
        self._copy(dst, src, n, nthreads, COPY_MODES[mode])

    def d2h(self, pairs, halves, events, stream, nthreads: int, counts: dict, waits=(), record=None,
            mode: str = "memcpy"):
        """Device to host (CUDA): pairs (dst host ptr, src device ptr, nbytes, chunk); returns
        with every byte in the host destinations."""
        times, chunks_done = (ctypes.c_double * 3)(), (ctypes.c_long * 1)()
        t0 = time.perf_counter()
        r = self._d2h(*self._arrays(pairs), halves[0], halves[1], events[0], events[1], stream, nthreads,
                      COPY_MODES[mode], ctypes.byref(self.cuda), times, chunks_done,
                      len(waits), (ctypes.c_void_p * max(1, len(waits)))(*waits), record)
        counts["call_s"] = counts.get("call_s", 0.0) + time.perf_counter() - t0
        self._add(counts, times, chunks_done)
        if r < 0:
            raise RuntimeError(f"staging pump: CUDA error {-1000 - r} in a device-to-host chunk")

    def h2d(self, pairs, halves, events, stream, half: int, nthreads: int, counts: dict,
            skip_half_wait: bool = False, waits=(), record=None, mode: str = "memcpy") -> int:
        """pairs: (dst_ptr, src_ptr, nbytes, chunk). halves: two pointers; events, stream,
        waits (events the stream waits for first) and record (an event recorded after the last
        DMA): raw CUDA handles (ignored on CPU). mode: a COPY_MODES key. Adds chunks and wait / memcpy / issue seconds
        to `counts`. Returns the half the next copy starts in; raises on a CUDA error."""
        cuda = ctypes.byref(self.cuda) if self.cuda is not None else None
        times, chunks_done = (ctypes.c_double * 3)(), (ctypes.c_long * 1)()
        t0 = time.perf_counter()
        r = self._fn(*self._arrays(pairs), halves[0], halves[1], events[0], events[1], stream,
                     half, nthreads, COPY_MODES[mode], cuda, times, chunks_done, int(skip_half_wait),
                     len(waits), (ctypes.c_void_p * max(1, len(waits)))(*waits), record)
        counts["call_s"] = counts.get("call_s", 0.0) + time.perf_counter() - t0
        self._add(counts, times, chunks_done)
        if r < 0:
            raise RuntimeError(f"staging pump: CUDA error {-1000 - r} in a host-to-device chunk")
        return r


class Worker:
    """A delivery worker (pump.c): host-to-device jobs run in order on a C thread that never
    takes the GIL. A job's gates are (ctypes.c_longlong, generation) pairs that other threads
    set once the CUDA events they stand for are recorded; its signal counter is set when the
    job's record has been issued (on CPU: when its bytes have landed)."""

    def __init__(self, pump: Pump, device: int):
        self.pump, self.lib = pump, pump.lib
        cuda = ctypes.byref(pump.cuda) if pump.cuda is not None else None
        self._w = self.lib.kvf_worker_start(cuda, device)
        if not self._w:
            raise RuntimeError("staging pump: could not start the delivery worker thread")
        self._times, self._chunks = (ctypes.c_double * 3)(), ctypes.c_long()

    def submit(self, pairs, halves, events, stream, nthreads: int, mode: str, waits, gates, record,
               signal) -> int:
        """pairs (dst_ptr, src_ptr, nbytes, chunk); events, stream, waits, record: raw CUDA
        handles (None on CPU); gates [(c_longlong, gen)]; signal (c_longlong, gen) or None."""
        P, LL = ctypes.c_void_p, ctypes.c_longlong
        n_w, n_g = len(waits), len(gates)
        t = self.lib.kvf_worker_submit(
            self._w, *Pump._arrays(pairs), halves[0], halves[1], events[0], events[1], stream, nthreads,
            COPY_MODES[mode], n_w, (P * max(1, n_w))(*waits), n_g,
            (P * max(1, n_g))(*(ctypes.addressof(c) for c, _ in gates)), (LL * max(1, n_g))(*(g for _, g in gates)),
            record, ctypes.byref(signal[0]) if signal else None, signal[1] if signal else 0)
        if t < 0:
            raise MemoryError("staging pump: no memory to queue a delivery")
        return t

    def _check(self, err: int) -> None:
        if err:
            raise RuntimeError(f"staging pump: CUDA error {err} in a queued host-to-device delivery")

    def wait(self, ctr: ctypes.c_longlong, gen: int) -> None:
        """Block (GIL released) until a job set ``ctr`` to ``gen``; raises a job's CUDA error."""
        self._check(self.lib.kvf_worker_wait(self._w, ctypes.byref(ctr), gen, 1))

    def drain(self) -> None:
        """Block until every queued job has run; raises a job's CUDA error."""
        self._check(self.lib.kvf_worker_wait(self._w, None, 0, 1))

    def half(self, h: int = -1) -> int:
        return self.lib.kvf_worker_half(self._w, h)

    def add_stats(self, counts: dict) -> None:
        """Add the worker's accumulated wait / memcpy / issue seconds and chunks to ``counts``."""
        self.lib.kvf_worker_stats(self._w, self._times, ctypes.byref(self._chunks))
        Pump._add(counts, self._times, [self._chunks.value])

    def stop(self) -> None:
        if self._w:
            self.lib.kvf_worker_stop(self._w)
            self._w = None


def _cache_dir() -> Path:
    base = os.environ.get("KVFERRY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvferry")
    return Path(base)


def _build() -> Path | None:
    src = _SRC.read_bytes()
    out = _cache_dir() / f"pump-{hashlib.sha256(src).hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("staging pump: no C compiler found (set CC), using the Python chunk loop")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        cmd = [cc, "-O3", "-fopenmp", "-pthread", "-shared", "-fPIC", "-o", str(so), str(_SRC)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("staging pump: build failed (%s), using the Python chunk loop: %s",
                        " ".join(cmd), r.stderr.strip()[-500:])
            return None
        os.replace(so, out)  # atomic: concurrent builders leave one complete file
    return out


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime PyTorch loaded (its handles are the ones this process uses)."""
    import torch
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "libcudart" in ln and ln.split()[-1].startswith("/")}
    for p in sorted(paths):
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


def load_pump(cuda: bool) -> Pump | None:
    key = "cuda" if cuda else "cpu"
    with _LOCK:
        if key in _STATE:
            return _STATE[key]
        pump = None
        if os.environ.get("KVFERRY_NATIVE", "1") != "0":
            try:
                so = _build()
                if so is not None:
                    lib = ctypes.CDLL(str(so))
                    funcs = None
                    if cuda:
                        rt = _cudart()
                        if rt is None:
                            log.info("staging pump: PyTorch's CUDA runtime library not found, "
                                     "using the Python chunk loop")
                            lib = None
                        else:
                            addr = [ctypes.cast(getattr(rt, n), ctypes.c_void_p).value for n in
                                    ("cudaMemcpyAsync", "cudaEventSynchronize", "cudaEventRecord",
                                     "cudaStreamWaitEvent", "cudaSetDevice")]
                            funcs = _Cuda(*addr)
                    if lib is not None:
                        pump = Pump(lib, funcs)
                        log.info("staging pump: compiled chunk loop loaded (%s)", so)
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                log.warning("staging pump: unavailable (%s), using the Python chunk loop", e)
        _STATE[key] = pump
        return pump
