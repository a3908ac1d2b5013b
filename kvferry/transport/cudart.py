"""The CUDA runtime that PyTorch loaded, through ctypes: its handles (streams, events) are this
process's, so a call here acts on PyTorch's streams.

Two users: the compiled copy worker (pump.py hands it the runtime's function pointers) and the
pinned ring's copies (queues.StreamQueue), which the host issues per layer and step. Why by hand
there: `Tensor.copy_(non_blocking=True)` goes through the dispatcher, a TensorIterator and the
pinned-memory bookkeeping before it reaches cudaMemcpyAsync, and needs the copy stream made
current around it; at 4k context that host time, per layer, is what the step waits for (see
docs/results.md, the 4k host rows of the decode-kernel table). The call here is the runtime
call alone.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kvferry import KvferryError

_LOCK = threading.Lock()
_RT: list = []  # [CDLL or None] once looked up
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (unified addressing)


def runtime() -> ctypes.CDLL | None:
    """The libcudart PyTorch loaded, or None where none is found."""
    with _LOCK:
        if not _RT:
            _RT.append(_find())
        return _RT[0]


def _find() -> ctypes.CDLL | None:
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "libcudart" in ln and ln.split()[-1].startswith("/")}
    for p in sorted(paths):
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


class Memcpy:
    """memcpy(dst, src, stream): an asynchronous copy of a contiguous tensor's bytes onto
    `stream`, for pinned host memory and device memory (either way). The function holds the GIL
    (PyDLL): the call returns in microseconds, and releasing the GIL there would let another
    thread's Python run in the middle of a step's issue."""

    def __init__(self):
        rt = runtime()
        if rt is None:
            raise KvferryError("PyTorch's CUDA runtime library (libcudart) is not loaded in this process, and the "
                               "pinned host KV cache copies through it: use --no-kv-pinned (copies through the staging "
                               "buffer) or a PyTorch build that loads libcudart")
        lib = ctypes.PyDLL(rt._name)
        fn = lib.cudaMemcpyAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        err = lib.cudaGetErrorString
        err.argtypes, err.restype = [ctypes.c_int], ctypes.c_char_p
        self._fn, self._err = fn, err

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> None:
        n = src.nbytes
        if dst.nbytes != n or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"a ring copy needs two contiguous tensors of one size; got {tuple(dst.shape)} "
                             f"{dst.dtype} and {tuple(src.shape)} {src.dtype}")
        if n:
            rc = self._fn(dst.data_ptr(), src.data_ptr(), n, MEMCPY_DEFAULT, stream)
            if rc:
                raise RuntimeError(f"cudaMemcpyAsync failed: {self._err(rc).decode()} (error {rc})")
