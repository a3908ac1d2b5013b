"""Link probe: host<->device bandwidth (pinned, pageable, through the staging queues) and
device memory bandwidth, measured in the same run as the benchmark that uses them.

Two measurements per staged size: `single`, one copy alone (its latency, as a weight upload
sees it), and `stream`, back-to-back copies of that size (at least STREAM_BYTES in all, from
distinct offsets) as KV deliveries see them. Every figure is also given as % of the pinned
copy of the same size in the same run.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

import torch

MiB = 1 << 20
STREAM_BYTES = 512 * MiB


def _time_ms(fn, device, reps=5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def _staged_d2h(staged, dst, src):
    done = staged.d2h.event("probe")
    staged.d2h.submit([(dst, src)], signal=done)
    done.wait_host(done.armed)


def probe_link(device: torch.device, size_mib: int = 256, staged=None, reps: int = 5) -> dict:
    """GB/s of one copy of `size_mib` MiB per path (`staged`: the engine's StagedQueues, to
    include them). On CPU the 'link' is a host memcpy."""
    n = size_mib * MiB
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    pageable = torch.empty(n, dtype=torch.uint8).fill_(7)
    out = {"size_mib": size_mib}
    out["h2d_pageable"] = _gbps(n, _time_ms(lambda: dev.copy_(pageable), device, reps))
    out["d2h_pageable"] = _gbps(n, _time_ms(lambda: pageable.copy_(dev), device, reps))
    if device.type == "cuda":
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out["h2d_pinned"] = _gbps(n, _time_ms(lambda: dev.copy_(pinned, non_blocking=True), device, reps))
        out["d2h_pinned"] = _gbps(n, _time_ms(lambda: pinned.copy_(dev, non_blocking=True), device, reps))
        del pinned
    else:
        out["h2d_pinned"], out["d2h_pinned"] = out["h2d_pageable"], out["d2h_pageable"]
    if staged is not None:
        out["h2d_staging"] = _gbps(n, _time_ms(lambda: staged.upload(dev, pageable), device, reps))
        out["d2h_staging"] = _gbps(n, _time_ms(lambda: _staged_d2h(staged, pageable, dev), device, reps))
    return out


def link_sweep(device: torch.device, staged, sizes_mib: list[int], reps: int = 5, progress=None) -> list[dict]:
    """Per size: pinned and plain pageable copies, the host memcpy (pageable into pinned, the
    leg a staged copy runs beside its DMA), and staged single and stream copies, each
    direction, in GB/s and % of pinned. A staged stream cannot beat the slower of the pinned
    copy and the host memcpy."""
    big = max(max(sizes_mib) * MiB, STREAM_BYTES)
    host = torch.empty(big, dtype=torch.uint8).fill_(3)  # pageable
    dev = torch.empty(big, dtype=torch.uint8, device=device)
    pinned = torch.empty(max(sizes_mib) * MiB, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rows = []
    for size in sizes_mib:
        n = size * MiB
        k = max(1, STREAM_BYTES // n)  # copies in a stream, at distinct offsets
        offs = [(i * n) % (big - n + 1) for i in range(k)]
        o0 = offs[-1]  # not the copy just before it: not warm in the caches

        def h2d_stream():
            for o in offs:
                staged.h2d.submit([(dev[o:o + n], host[o:o + n])])
            staged.h2d.fence()

        def d2h_stream():
            for o in offs:
                staged.d2h.submit([(host[o:o + n], dev[o:o + n])])
            staged.d2h.fence()

        r = dict(size_mib=size,
                 h2d_pinned=_gbps(n, _time_ms(lambda: dev[:n].copy_(pinned[:n], non_blocking=True), device, reps)),
                 d2h_pinned=_gbps(n, _time_ms(lambda: pinned[:n].copy_(dev[:n], non_blocking=True), device, reps)),
                 h2d_pageable=_gbps(n, _time_ms(lambda: dev[:n].copy_(host[:n]), device, reps)),
                 # the staged path's other leg: pageable -> pinned on the host, torch's threads
                 host_memcpy=_gbps(n, _time_ms(lambda: pinned[:n].copy_(host[o0:o0 + n]), device, reps)),
                 h2d_single=_gbps(n, _time_ms(lambda: staged.upload(dev[:n], host[:n]), device, reps)),
                 h2d_stream=_gbps(n * k, _time_ms(h2d_stream, device, reps)),
                 d2h_single=_gbps(n, _time_ms(lambda: _staged_d2h(staged, host[:n], dev[:n]), device, reps)),
                 d2h_stream=_gbps(n * k, _time_ms(d2h_stream, device, reps)))
        for key in ("h2d_pageable", "h2d_single", "h2d_stream"):
            r[key + "_pct"] = round(100 * r[key] / r["h2d_pinned"], 1)
        for key in ("d2h_single", "d2h_stream"):
            r[key + "_pct"] = round(100 * r[key] / r["d2h_pinned"], 1)
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
        if progress:
            progress()
    return rows


def sweep_table(rows: list[dict]) -> str:
    out = ["| size MiB | pinned H2D GB/s | host memcpy GB/s | pageable copy_ | staged single | staged stream | "
           "pinned D2H GB/s | staged D2H single | staged D2H stream |", "|---:" * 9 + "|"]
    for r in rows:
        out.append(f"| {r['size_mib']} | {r['h2d_pinned']:.1f} | {r['host_memcpy']:.1f} | {r['h2d_pageable_pct']:.0f}% | "
                   f"{r['h2d_single_pct']:.0f}% | {r['h2d_stream_pct']:.0f}% | {r['d2h_pinned']:.1f} | "
                   f"{r['d2h_single_pct']:.0f}% | {r['d2h_stream_pct']:.0f}% |")
    return "\n".join(out)


def probe_contention(device: torch.device, copy_mib: int = 64, reps: int = 3) -> dict:
    """How much a stream of host-to-device copies slows the device's own memory-bound work, as
    the ring's copies run beside a decode step: one-token matrix products over Llama-3-8B's
    gate+up weights (4096 x 28672 bf16; smaller, f32, on CPU) timed alone and beside back-to-back
    pinned copies of `copy_mib` MiB on another stream (on CPU: a thread copying host memory).
    Returns alone_ms, beside_ms, slowdown_pct and the copies' GB/s while they ran."""
    cuda = device.type == "cuda"
    k, n, iters = (4096, 28672, 100) if cuda else (1024, 4096, 20)
    dtype = torch.bfloat16 if cuda else torch.float32
    w = torch.randn(k, n, device=device, dtype=dtype)
    x = torch.randn(1, k, device=device, dtype=dtype)
    src = torch.empty(copy_mib * MiB, dtype=torch.uint8, pin_memory=cuda).fill_(5)
    dst = torch.empty(copy_mib * MiB, dtype=torch.uint8, device=device)

    def work():
        for _ in range(iters):
            x @ w
    work()  # warm-up
    if cuda:
        side = torch.cuda.Stream(device)
        w0, w1, c0, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))  # work, copies

        def timed(ncopies):
            torch.cuda.synchronize(device)
            with torch.cuda.stream(side):
                c0.record(side)
                for _ in range(ncopies):
                    dst.copy_(src, non_blocking=True)
                c1.record(side)
            w0.record()
            work()
            w1.record()
            torch.cuda.synchronize(device)
            gbps = _gbps(ncopies * src.nbytes, c0.elapsed_time(c1)) if ncopies else 0.0
            return w0.elapsed_time(w1), gbps
        alone = statistics.median(timed(0)[0] for _ in range(reps))
        # enough copies to outlast the work at 64 GB/s, above a PCIe 5.0 x16 link's rate
        ncopies = max(2, math.ceil(2 * alone * 1e-3 * 64e9 / src.nbytes))
        runs = [timed(ncopies) for _ in range(reps)]
    else:
        def timed(with_copies):
            stop, copied = threading.Event(), [0]

            def copier():
                while not stop.is_set():
                    dst.copy_(src)
                    copied[0] += src.nbytes
            t = threading.Thread(target=copier, daemon=True)
            if with_copies:
                t.start()
            t0 = time.perf_counter()
            work()
            ms = (time.perf_counter() - t0) * 1e3
            stop.set()
            if with_copies:
                t.join()
            return ms, _gbps(copied[0], ms)
        alone = statistics.median(timed(False)[0] for _ in range(reps))
        runs = [timed(True) for _ in range(reps)]
    beside = statistics.median(ms for ms, _ in runs)
    return dict(copy_mib=copy_mib, alone_ms=round(alone, 3), beside_ms=round(beside, 3),
                slowdown_pct=round(100 * (beside / alone - 1), 1),
                copy_gbps=round(statistics.median(g for _, g in runs), 1))


def probe_device_memory(device: torch.device, size_mib: int = 1024, reps: int = 5) -> float:
    """Device memory GB/s: a device-to-device copy, counting bytes read plus written."""
    if device.type != "cuda":
        size_mib = min(size_mib, 256)
    n = size_mib * MiB
    a = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    return _gbps(2 * n, _time_ms(lambda: b.copy_(a), device, reps))

