"""Huge pages for the pageable host KV cache (kvferry/transport/hostmem.py).

Checked on the mapping itself: /proc/self/smaps lists, per mapping of this process, how much of
it is in anonymous huge pages. Where the system's THP setting is "never" (or not Linux) there is
nothing to see and the tests skip; with "always" every large mapping gets them anyway, so the
negative control (KVFERRY_HOST_THP=0 leaves the pages small) needs "madvise".
"""

import pytest
import torch

from kvferry.transport import hostmem

MiB = 1 << 20


def _huge_bytes_at(addr: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def _mode_or_skip(*modes):
    mode = hostmem.thp_mode()
    if mode not in modes:
        pytest.skip(f"transparent huge pages are {mode!r} here; the test needs {' or '.join(modes)}")


def test_advised_memory_is_backed_by_huge_pages():
    _mode_or_skip("madvise", "always")
    t = torch.empty(64 * MiB + 12_345, dtype=torch.uint8)
    advised = hostmem.advise_huge_pages(t)
    assert advised >= 60 * MiB and advised % hostmem.HUGE_PAGE == 0
    t.fill_(1)  # first touch: the kernel backs the advised range with 2 MiB pages
    mid = t.data_ptr() + t.nbytes // 2
    assert _huge_bytes_at(mid) >= 32 * MiB


def test_switched_off_leaves_pages_small(monkeypatch):
    _mode_or_skip("madvise")
    monkeypatch.setenv("KVFERRY_HOST_THP", "0")
    t = torch.empty(64 * MiB, dtype=torch.uint8)
    assert hostmem.advise_huge_pages(t) == 0
    t.fill_(1)
    assert _huge_bytes_at(t.data_ptr() + t.nbytes // 2) == 0


def test_too_small_or_not_on_the_host_is_left_alone():
    assert hostmem.advise_huge_pages(torch.empty(4096, dtype=torch.uint8)) == 0
    assert hostmem.advise_huge_pages(torch.empty(0, dtype=torch.uint8)) == 0


def test_pageable_host_cache_is_advised(monkeypatch):
    # The pageable host KV cache asks for huge pages for every layer before it zeroes it (on a
    # GPU the pinned cache does not: torch's pinned allocator owns those pages).
    _mode_or_skip("madvise", "always")
    from kvferry.config import KVConfig
    from kvferry.kv.cache import KVSpec
    from kvferry.transport import host_cache

    calls = []
    real = host_cache.advise_huge_pages
    monkeypatch.setattr(host_cache, "advise_huge_pages", lambda t: calls.append(t.nbytes) or real(t))
    spec = KVSpec(num_layers=2, num_seqs=1, ctx=8192, num_kv_heads=4, head_dim=128, kv_type="f16",
                  chunk_rows=1024)
    cache = host_cache.HostKVCache(spec, KVConfig(offload=True, pinned=False, depth=1),
                                   torch.device("cpu"), torch.float32)
    assert len(calls) == 2 * spec.num_layers
    t = cache.host_k[0]
    assert _huge_bytes_at(t.data_ptr() + t.nbytes // 2) > 0, "the host cache is not in huge pages"
