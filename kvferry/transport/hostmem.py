"""Host memory for the KV cache and the staging halves: huge pages, and pinning with a fallback.

Every decode step with a pageable host cache reads the whole context through the host memcpy
into the staging halves. With 4 KiB pages that stream touches a new page (a TLB entry, and in a
virtual machine a two-level page walk) every 4 KiB; 2 MiB pages remove almost all of that.
Linux gives anonymous memory huge pages where a mapping asks for them with
madvise(MADV_HUGEPAGE) (system setting "madvise", the common default; "always" gives them
anyway, "never" not at all). The memory is a private anonymous mapping of its own, not the CPU
allocator's: an allocation below glibc's mmap threshold can come from heap pages already
touched, which stay small whatever is advised.

Pinning (page-locking for DMA) is done in place with cudaHostRegister, in pieces of at most
PIN_PIECE bytes (one registration of hundreds of GiB fails on some drivers). It can fail (a
locked-memory limit, a container); `pin` then unregisters what it did and raises PinError, and
the caller falls back to pageable memory.
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import Callable

import torch

HUGE_PAGE = 2 << 20
PIN_PIECE = 1 << 30


class PinError(RuntimeError):
    """Host memory could not be pinned; the message says why."""


def alloc_host(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh anonymous host memory (zero, no page touched yet) as a 1-D uint8 tensor
    that keeps the mapping alive; 2 MiB-aligned and advised for huge pages where the system has
    them, page-aligned otherwise. The pages come when first written."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not POSIX: the allocator's memory
        return torch.empty(nbytes, dtype=torch.uint8)
    huge = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
    pad = HUGE_PAGE if huge else 0
    m = mmap.mmap(-1, max(1, nbytes + pad), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds m: unmapped with the last view
    off = (-whole.data_ptr()) % HUGE_PAGE if huge else 0
    if huge and nbytes:
        try:
            m.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
        except OSError:  # a kernel without THP: small pages, nothing else changes
            pass
    return whole[off:off + nbytes]


def _cuda_register(ptr: int, nbytes: int) -> int:
    if not torch.cuda.is_available():
        return 0  # nothing pins here, and the CPU reads the memory as it is
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cuda_unregister(ptr: int) -> None:
    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


# the registration calls; tests replace them to make pinning fail on CPU
register: Callable[[int, int], int] = _cuda_register
unregister: Callable[[int], None] = _cuda_unregister


def pin(mem: torch.Tensor, what: str) -> Callable[[], None]:
    """Pin a 1-D uint8 tensor in place, in pieces; returns the function that unpins it (call it
    only once no copy uses the memory). Raises PinError, with nothing left pinned, on failure."""
    done: list[int] = []
    base, n = mem.data_ptr(), mem.numel()
    for off in range(0, n, PIN_PIECE):
        err = register(base + off, min(PIN_PIECE, n - off))
        if err:
            for p in done:
                unregister(p)
            raise PinError(f"pinning {n / 2**20:.0f} MiB for {what} failed at {off / 2**20:.0f} MiB "
                           f"(CUDA error {err}: the locked-memory limit, or the driver refused)")
        done.append(base + off)

    def unpin(mem=mem):  # keeps the memory alive until unpinned
        for p in done:
            unregister(p)
        done.clear()
    return unpin


def memory_bytes() -> tuple[int, int]:
    """(physical memory, memory available without swapping) in bytes; MemAvailable from
    /proc/meminfo, or all of physical memory where that file is missing."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            return total, next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return total, total



def thp_mode() -> str | None:
    """The system's transparent huge page setting ("always", "madvise", "never"), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None
