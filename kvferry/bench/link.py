"""Link probe: host<->device bandwidth (pinned, pageable, through the staging buffer) and
device memory bandwidth, measured in the same run as the benchmark that uses them."""

from __future__ import annotations

import statistics
import time

import torch

MiB = 1 << 20


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


def probe_link(device: torch.device, size_mib: int = 256, staging: bool = True, reps: int = 5) -> dict:
    """GB/s for each path, on `size_mib` MiB. On CPU the 'link' is a host memcpy."""
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
    if staging:
        from kvferry.transport.staging import get_staging
        st = get_staging(device)
        out["h2d_staging"] = _gbps(n, _time_ms(lambda: st.copy_to_device(dev, pageable), device, reps))
        out["d2h_staging"] = _gbps(n, _time_ms(lambda: st.copy_to_host(pageable, dev), device, reps))
    return out


def probe_device_memory(device: torch.device, size_mib: int = 1024, reps: int = 5) -> float:
    """Device memory GB/s: a device-to-device copy, counting bytes read plus written."""
    if device.type != "cuda":
        size_mib = min(size_mib, 256)
    n = size_mib * MiB
    a = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    return _gbps(2 * n, _time_ms(lambda: b.copy_(a), device, reps))


def link_table(r: dict) -> str:
    rows = ["| path | host to device GB/s | device to host GB/s |", "|---|---:|---:|"]
    for name in ("pinned", "pageable", "staging"):
        if f"h2d_{name}" in r:
            rows.append(f"| {name} | {r[f'h2d_{name}']:.1f} | {r[f'd2h_{name}']:.1f} |")
    return "\n".join(rows)
