"""Host memory for the pageable KV cache and the staging halves: transparent huge pages.

Every decode step with a pageable host cache reads the whole context through the host memcpy
into the staging halves. With 4 KiB pages that stream touches a new page (a TLB entry, and in a
virtual machine a two-level page walk) every 4 KiB, and the CPU's prefetchers stop at each page
boundary; 2 MiB pages remove almost all of that. Linux gives anonymous memory huge pages where a
mapping asks for them with madvise(MADV_HUGEPAGE) when the system setting is "madvise" (the
common default; with "always" they come anyway, with "never" the call does nothing). PyTorch
does the same for its own CPU allocations only when THP_MEM_ALLOC_ENABLE is set before it
starts, for every tensor; here it is asked for these buffers alone.

Why by hand: there is no PyTorch API to advise one tensor's pages; this is one libc call.
Set KVFERRY_HOST_THP=0 to leave the pages as the allocator gives them (for A/B measurements).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_libc = None


def thp_enabled() -> bool:
    """Whether kvferry asks for huge pages (KVFERRY_HOST_THP, default on; Linux only)."""
    return sys.platform.startswith("linux") and os.environ.get("KVFERRY_HOST_THP", "1") != "0"


def _madvise():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    return _libc.madvise


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask for huge pages under the whole 2 MiB-aligned interior of ``t``'s memory (a CPU
    tensor, before its pages are first touched: pages already there stay small until the
    kernel's background collapse gets to them). Returns the bytes advised (0 when off, too
    small, or refused; a refusal is logged at debug level and changes nothing else)."""
    if not thp_enabled() or t.device.type != "cpu":
        return 0
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    if _madvise()(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): small pages", ctypes.get_errno())
        return 0
    return hi - lo


def huge_page_bytes() -> int | None:
    """This process's anonymous memory in huge pages (AnonHugePages of /proc/self/smaps_rollup),
    in bytes; None where the kernel does not report it."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def thp_mode() -> str | None:
    """The system's transparent huge page setting ("always", "madvise", "never"), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None
