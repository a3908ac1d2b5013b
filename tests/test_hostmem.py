"""Huge pages for the pageable host KV cache and the staging halves (kvferry/transport/hostmem.py).

Checked on the mapping itself: /proc/self/smaps lists, per mapping of this process, how much of
it is in anonymous huge pages. Where the system's THP setting is "never" (or not Linux) there is
nothing to see and those tests skip; with "always" every large mapping gets them anyway, so the
negative control (memory that was not advised stays in small pages) needs "madvise". Also:
pinning in pieces, and the host cache's fallback to pageable memory when pinning fails.
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


@pytest.mark.parametrize("n", [8 * MiB, 64 * MiB + 12_345])
def test_host_memory_is_aligned_zero_and_in_huge_pages(n):
    # 8 MiB: below glibc's mmap threshold, where the CPU allocator could hand out heap pages
    # that were touched before and stay small whatever is advised; a mapping of its own cannot.
    _mode_or_skip("madvise", "always")
    t = hostmem.alloc_host(n)
    assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() % hostmem.HUGE_PAGE == 0
    assert not t.any()
    t.fill_(1)  # first touch: the kernel backs the range with 2 MiB pages
    assert _huge_bytes_at(t.data_ptr()) >= n // 2
    assert bool((t == 1).all())


def test_memory_from_the_allocator_stays_in_small_pages():
    # negative control for the huge-page check: the same size from torch's allocator, not advised
    _mode_or_skip("madvise")
    t = torch.empty(64 * MiB, dtype=torch.uint8)
    t.fill_(1)
    assert _huge_bytes_at(t.data_ptr()) == 0


def test_pinning_in_pieces_and_undoing_a_failed_pin(monkeypatch):
    calls = []
    monkeypatch.setattr(hostmem, "PIN_PIECE", MiB)
    monkeypatch.setattr(hostmem, "register", lambda p, n: calls.append(("reg", p, n)) or (3 if len(calls) == 3 else 0))
    monkeypatch.setattr(hostmem, "unregister", lambda p: calls.append(("unreg", p)))
    t = hostmem.alloc_host(4 * MiB + 5)
    with pytest.raises(hostmem.PinError, match="failed at 2 MiB"):
        hostmem.pin(t, "a test")
    base = t.data_ptr()
    assert [c[:2] for c in calls] == [("reg", base), ("reg", base + MiB), ("reg", base + 2 * MiB),
                                      ("unreg", base), ("unreg", base + MiB)]
    calls.clear()
    monkeypatch.setattr(hostmem, "register", lambda p, n: calls.append(("reg", p, n)) or 0)
    unpin = hostmem.pin(t, "a test")
    assert [n for _, _, n in calls] == [MiB] * 4 + [5]
    unpin()
    assert sum(c[0] == "unreg" for c in calls) == 5


def test_host_cache_that_cannot_be_pinned_falls_back_to_pageable(monkeypatch, caplog):
    import logging

    from kvferry.config import KVConfig
    from kvferry.kv.cache import KVSpec
    from kvferry.transport.host_cache import HostKVCache
    monkeypatch.setattr(hostmem, "register", lambda p, n: 2)
    spec = KVSpec(num_layers=2, num_seqs=1, ctx=64, num_kv_heads=2, head_dim=32, kv_type="f32", chunk_rows=16)
    with caplog.at_level(logging.WARNING):
        cache = HostKVCache(spec, KVConfig(offload=True, pinned=True, depth=1), torch.device("cpu"), torch.float32,
                            progress=False)
    try:
        assert not cache.pinned
        assert sum("stays pageable" in r.message for r in caplog.records) == 1, "one line says why"
        assert type(cache.deliver).__name__ in ("NativeQueue", "PyStagedQueue")
    finally:
        cache.close()
    # the control: pinning works (and unpinning is faked too: on a CUDA machine the real call on
    # memory never registered leaves an error that the next kernel launch reports)
    monkeypatch.setattr(hostmem, "register", lambda p, n: 0)
    monkeypatch.setattr(hostmem, "unregister", lambda p: None)
    cache = HostKVCache(spec, KVConfig(offload=True, pinned=True, depth=1), torch.device("cpu"), torch.float32,
                        progress=False)
    assert cache.pinned and type(cache.deliver).__name__ == "ThreadQueue"
    cache.close()


def test_views_keep_the_mapping_alive():
    t = hostmem.alloc_host(3 * MiB + 5)
    v = t[MiB:].view(-1)
    del t
    v.fill_(7)  # the mapping is still there: no fault
    assert int(v[-1]) == 7 and v.numel() == 2 * MiB + 5
    assert hostmem.alloc_host(0).numel() == 0


def test_pageable_host_cache_is_in_huge_pages():
    # The pageable host KV cache takes its layers from alloc_host and zeroes them at once (with
    # progress), so they are in huge pages before the first decode step.
    _mode_or_skip("madvise", "always")
    from kvferry.config import KVConfig
    from kvferry.kv.cache import KVSpec
    from kvferry.transport.host_cache import HostKVCache

    spec = KVSpec(num_layers=2, num_seqs=1, ctx=8192, num_kv_heads=4, head_dim=128, kv_type="f16",
                  chunk_rows=1024)
    cache = HostKVCache(spec, KVConfig(offload=True, pinned=False, depth=1), torch.device("cpu"), torch.float32)
    for t in cache.host_kv:  # one allocation per layer (K and V)
        assert t.data_ptr() % hostmem.HUGE_PAGE == 0
        assert _huge_bytes_at(t.data_ptr()) >= t.nbytes // 2, "a host cache layer is not in huge pages"
