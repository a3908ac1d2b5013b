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
DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch: the largest pitch a 2D copy takes


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
    """memcpy(dst, src, stream): an asynchronous copy of two contiguous tensors onto `stream`,
    for pinned host memory and device memory (either way); `linear` and `rows` take addresses.
    The functions hold the GIL (PyDLL): a call returns in microseconds, and releasing the GIL
    there would let another thread's Python run in the middle of a step's issue."""

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
        fn2 = lib.cudaMemcpy2DAsync
        fn2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                        ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn2.restype = ctypes.c_int
        err = lib.cudaGetErrorString
        err.argtypes, err.restype = [ctypes.c_int], ctypes.c_char_p
        self._fn, self._fn2, self._err = fn, fn2, err
        value = ctypes.c_int(0)
        lib.cudaDeviceGetAttribute(ctypes.byref(value), DEV_ATTR_MAX_PITCH, torch.cuda.current_device())
        self.max_pitch = value.value  # 0 where unknown: rows are then copied one by one

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> None:
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes != src.nbytes:
            raise ValueError(f"a ring copy needs contiguous operands of one size; got {tuple(dst.shape)} "
                             f"{dst.dtype} strides {dst.stride()} and {tuple(src.shape)} {src.dtype} "
                             f"strides {src.stride()}")
        if dst.nbytes:
            self.linear(dst.data_ptr(), src.data_ptr(), dst.nbytes, stream)

    def linear(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """nbytes from address src to address dst: for callers that computed the addresses
        (a few integer operations cost less host time than the tensor views they stand for)."""
        self._check(self._fn(dst, src, nbytes, MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def rows(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        """`height` rows of `width` bytes, each `spitch` bytes after the one before at src and
        `dpitch` at dst: one plain copy where the rows are contiguous on both sides."""
        if height == 1 or dpitch == spitch == width:  # contiguous bytes
            self.linear(dst, src, width * height, stream)
        elif max(dpitch, spitch) <= self.max_pitch:
            self._check(self._fn2(dst, dpitch, src, spitch, width, height, MEMCPY_DEFAULT, stream),
                        "cudaMemcpy2DAsync")
        else:  # a pitch over the device's limit (a host context of gigabytes per row)
            for i in range(height):
                self.linear(dst + i * dpitch, src + i * spitch, width, stream)

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} failed: {self._err(rc).decode()} (error {rc})")
