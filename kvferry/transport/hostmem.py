"""Host memory for the pageable KV cache and the staging halves: transparent huge pages.

Every decode step with a pageable host cache reads the whole context through the host memcpy
into the staging halves. With 4 KiB pages that stream touches a new page (a TLB entry, and in a
virtual machine a two-level page walk) every 4 KiB, and the CPU's prefetchers stop at each page
boundary; 2 MiB pages remove almost all of that. Linux gives anonymous memory huge pages where a
mapping asks for them with madvise(MADV_HUGEPAGE) when the system setting is "madvise" (the
common default; with "always" they come anyway, with "never" the call does nothing). PyTorch
does the same for its own CPU allocations only when THP_MEM_ALLOC_ENABLE is set before it
starts, for every tensor; here it is asked for these buffers alone.

The memory is a private anonymous mapping of its own (Python's mmap, which also gives the
madvise call), not the CPU allocator's: an allocation below glibc's mmap threshold (up to
32 MiB) can come from heap pages already touched, which stay small whatever is advised.

Set KVFERRY_HOST_THP=0 to leave the pages small (for A/B measurements).
"""

from __future__ import annotations

import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20


def thp_enabled() -> bool:
    """Whether kvferry asks for huge pages (KVFERRY_HOST_THP, default on; Linux only)."""
    return sys.platform.startswith("linux") and os.environ.get("KVFERRY_HOST_THP", "1") != "0"


def alloc_host(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous host memory (zero, no page touched yet) as a 1-D uint8
    tensor that keeps the mapping alive; 2 MiB-aligned and advised for huge pages when
    ``thp_enabled()``, page-aligned otherwise. The pages come when first written."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not POSIX: the allocator's memory
        return torch.empty(nbytes, dtype=torch.uint8)
    huge = thp_enabled() and hasattr(mmap, "MADV_HUGEPAGE")
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


def thp_mode() -> str | None:
    """The system's transparent huge page setting ("always", "madvise", "never"), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None
