"""Host<->device bandwidth: pinned copy_, pageable copy_, and pageable through StagingBuffer.

    python benchmarks/staging_bench.py --out DIR [--max-gib 4] [--reps 5] [--cap-mib 64]

Writes DIR/staging.md (markdown table), DIR/staging.json and DIR/staging.png. Needs a CUDA GPU;
on a machine without one it says so and exits with status 2.

Timing: the pinned paths are timed with CUDA events on the current stream (the copy is a single
async DMA). The pageable and staging paths do host work too, so they are timed on the wall clock
between two device synchronizations. Each number is the median of --reps runs after one warm-up.
Host buffers of the largest size are allocated once and sliced, because pinning GiBs is slow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvferry.transport.staging import get_staging, staging_pinned_bytes  # noqa: E402

MIB = 1 << 20
SIZES_MIB = [1, 4, 16, 64, 256, 1024, 4096]
PATHS = ["h2d_pinned", "h2d_pageable", "h2d_staging", "d2h_pinned", "d2h_pageable", "d2h_staging"]


def progress(msg: str) -> None:
    sys.stderr.write(f"\r\033[K{msg}")
    sys.stderr.flush()


def time_events(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def time_wall(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for staging.md/.json/.png")
    ap.add_argument("--max-gib", type=float, default=4.0, help="largest copy size in GiB")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per point (median kept)")
    ap.add_argument("--cap-mib", type=int, default=64, help="staging buffer cap in MiB")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("staging_bench: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "this benchmark measures host<->GPU copies and has nothing to measure here.",
              file=sys.stderr)
        return 2
    sizes = [m * MIB for m in SIZES_MIB if m <= args.max_gib * 1024]
    if not sizes:
        ap.error("--max-gib is below the smallest size (1 MiB)")
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    top = sizes[-1]

    progress(f"allocating {top / MIB:.0f} MiB: device, pinned and 2 pageable host buffers")
    d_buf = torch.empty(top, dtype=torch.uint8, device=dev)
    d_buf.random_(0, 256)
    pinned = torch.empty(top, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(d_buf)
    src = torch.empty(top, dtype=torch.uint8)
    src.copy_(pinned)  # random bytes, and every page faulted in before timing
    back = torch.zeros(top, dtype=torch.uint8)
    staging = get_staging(dev, args.cap_mib * MIB)

    rows = []
    for i, n in enumerate(sizes):
        label = f"[{i + 1}/{len(sizes)}] {n / MIB:.0f} MiB"
        d, p, s, b = d_buf[:n], pinned[:n], src[:n], back[:n]
        secs = {}
        progress(f"{label}: h2d pinned")
        secs["h2d_pinned"] = time_events(lambda: d.copy_(p, non_blocking=True), args.reps)
        progress(f"{label}: h2d pageable")
        secs["h2d_pageable"] = time_wall(lambda: d.copy_(s), args.reps)
        progress(f"{label}: h2d staging")
        secs["h2d_staging"] = time_wall(lambda: staging.copy_to_device(d, s), args.reps)
        torch.cuda.synchronize()
        ok_h2d = bool(torch.equal(d, s.to(dev)))
        progress(f"{label}: d2h pinned")
        secs["d2h_pinned"] = time_events(lambda: p.copy_(d, non_blocking=True), args.reps)
        progress(f"{label}: d2h pageable")
        secs["d2h_pageable"] = time_wall(lambda: b.copy_(d), args.reps)
        b.zero_()
        progress(f"{label}: d2h staging")
        secs["d2h_staging"] = time_wall(lambda: staging.copy_to_host(b, d), args.reps)
        ok_d2h = bool(torch.equal(b, s))
        med = {k: statistics.median(v) for k, v in secs.items()}
        gbps = {k: n / v / 1e9 for k, v in med.items()}
        rows.append({"bytes": n, "seconds": med, "gbps": gbps, "all_seconds": secs,
                     "staging_h2d_verified": ok_h2d, "staging_d2h_verified": ok_d2h})
    progress("")

    info = {
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "host_threads": torch.get_num_threads(), "reps": args.reps,
        "cap_bytes": staging.cap_bytes, "staging_peak_bytes": staging.peak_bytes,
        "staging_pinned_bytes_total": staging_pinned_bytes(),
        "timing": {"pinned": "cuda events", "pageable/staging": "wall clock between syncs"},
    }
    md = render_markdown(rows, info)
    print(md)
    (args.out / "staging.md").write_text(md)
    (args.out / "staging.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    plot(rows, args.out / "staging.png", info)
    bad = [r["bytes"] for r in rows if not (r["staging_h2d_verified"] and r["staging_d2h_verified"])]
    if bad:
        print(f"staging_bench: staged data did NOT match for sizes {bad}", file=sys.stderr)
        return 1
    return 0


def render_markdown(rows, info) -> str:
    head = ("| size | H2D pinned | H2D pageable | H2D staging | staging % pinned "
            "| D2H pinned | D2H pageable | D2H staging | staging % pinned |")
    lines = [f"# Host<->device copy bandwidth (GB/s, 1 GB = 1e9 bytes) on {info['gpu']}", "",
             f"torch {info['torch']}, {info['host_threads']} host threads, median of "
             f"{info['reps']} runs; staging cap {info['cap_bytes'] // MIB} MiB, "
             f"peak staging bytes {info['staging_peak_bytes']:,}.", "",
             head, "|" + "---|" * 9]
    for r in rows:
        g = r["gbps"]
        size = f"{r['bytes'] // MIB} MiB" if r["bytes"] < 1 << 30 else f"{r['bytes'] >> 30} GiB"
        lines.append(
            f"| {size} | {g['h2d_pinned']:.1f} | {g['h2d_pageable']:.1f} | {g['h2d_staging']:.1f} "
            f"| {100 * g['h2d_staging'] / g['h2d_pinned']:.0f}% | {g['d2h_pinned']:.1f} "
            f"| {g['d2h_pageable']:.1f} | {g['d2h_staging']:.1f} "
            f"| {100 * g['d2h_staging'] / g['d2h_pinned']:.0f}% |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path, info) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    x = [r["bytes"] / MIB for r in rows]
    for key in PATHS:
        style = "-o" if key.startswith("h2d") else "--s"
        ax.plot(x, [r["gbps"][key] for r in rows], style, label=key.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("copy size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"host<->device copies, {info['gpu']}, staging cap {info['cap_bytes'] // MIB} MiB")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
