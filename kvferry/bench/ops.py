"""`kvferry bench --profile`: which kernels (CUDA) or ops (CPU) a decode step spends its time
in, from torch's profiler over a few untimed steps after an arm's timed ones. The table of a
step's top entries points at what to fuse or speed up next; the timed rows stay unprofiled."""

from __future__ import annotations

import collections
import logging

import torch

log = logging.getLogger(__name__)
TOP = 12  # entries kept per row


def op_table(run_steps, steps: int, device: torch.device) -> tuple[list[list], float | None]:
    """Profile `run_steps()` (which runs `steps` decode steps) -> ([[name, us per step, calls
    per step], ...] the largest first, idle ms per step): device kernel time on CUDA, ops' own
    CPU time on CPU. Idle (CUDA only, else None): the time from the first kernel to the last
    that no kernel ran, per step: the device waiting for the host, a copy or an event."""
    cuda = device.type == "cuda"
    act = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[act]) as prof:
        run_steps()
    agg = collections.defaultdict(lambda: [0.0, 0])
    idle = None
    if cuda:
        spans = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name][0] += e.device_time
                agg[e.name][1] += 1
                if not e.name.startswith(("Memcpy", "Memset")):  # the copy engines' work is not a kernel's
                    spans.append((e.time_range.start, e.time_range.end))
        idle = round(idle_us(spans) / steps / 1e3, 3)
    else:
        for e in prof.key_averages():
            agg[e.key][0] += e.self_cpu_time_total
            agg[e.key][1] += e.count
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [[name, round(us / steps, 1), round(n / steps, 2)] for name, (us, n) in rows if us > 0], idle


def idle_us(spans: list[tuple[float, float]]) -> float:
    """Time between the first start and the last end of `spans` (start, end) that none covers."""
    if not spans:
        return 0.0
    spans = sorted(spans)
    gap, reach = 0.0, spans[0][1]
    for start, end in spans[1:]:
        if start > reach:
            gap += start - reach
        reach = max(reach, end)
    return gap


def log_table(title: str, table: list[list], idle_ms: float | None) -> None:
    total = sum(r[1] for r in table)
    lines = [f"{title}: top {len(table)} by time per step ({total / 1e3:.3f} ms of it)"
             + (f"; no kernel running {idle_ms:.3f} ms per step" if idle_ms is not None else "")]
    lines += [f"  {us:9.1f} us {n:7.2f}x  {name[:100]}" for name, us, n in table]
    log.info("\n".join(lines))
