"""Host<->device bandwidth: pinned copy_, pageable copy_, and pageable through StagingBuffer.

    python benchmarks/staging_bench.py --out DIR [--max-gib 4] [--reps 5] [--cap-mib 64]
                                       [--sweep-min-chunk-mib 1,2,4 --sweep-split 2,4,8]

Writes DIR/staging.md (markdown tables), DIR/staging.json and DIR/staging.png. Needs a CUDA
GPU; on a machine without one it says so and exits with status 2.

Two measurements per copy size, for every path, all timed the same way (wall clock between two
device synchronizations, median of --reps runs after one warm-up):
  single   one copy of that size: its latency, as a weight upload or one delivery sees it;
  stream   back-to-back copies of that size (at least --stream-mib MiB in all, from distinct
           source and destination offsets, so no copy reads what the cache still holds), as a
           stream of KV deliveries sees it; this is how bandwidthTest-style tools measure.
The pinned path is also timed with CUDA events (the DMA alone, no launch or sync) as the raw
link figure. The host memcpy column is pageable to pinned host memory, the other half of a
staged copy: a staged copy cannot beat min(link, memcpy). Host buffers of the largest size are
allocated once and sliced, because pinning GiBs is slow.
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
from kvferry.transport.staging import StagingBuffer  # noqa: E402

MIB = 1 << 20
SIZES_MIB = [1, 4, 16, 64, 256, 1024, 4096]


def progress(msg: str) -> None:
    sys.stderr.write(f"\r\033[K{msg}")
    sys.stderr.flush()


def time_events(fn, reps: int) -> list[float]:
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


def time_wall(fn, reps: int) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


class Buffers:
    def __init__(self, top: int, dev: torch.device):
        progress(f"allocating {top / MIB:.0f} MiB: device, pinned and 2 pageable host buffers")
        self.dev = torch.empty(top, dtype=torch.uint8, device=dev)
        self.dev.random_(0, 256)
        self.pinned = torch.empty(top, dtype=torch.uint8, pin_memory=True)
        self.pinned.copy_(self.dev)
        self.src = torch.empty(top, dtype=torch.uint8)
        self.src.copy_(self.pinned)  # random bytes, and every page faulted in before timing
        self.back = torch.zeros(top, dtype=torch.uint8)
        self.top = top

    def slices(self, n: int, stream_bytes: int):
        """Views for one size: the single-copy operands, and k distinct operands for a stream."""
        k = max(1, min(self.top // n, -(-stream_bytes // n)))
        return k, [slice(i * n, (i + 1) * n) for i in range(k)]


def measure_size(b: Buffers, n: int, staging: StagingBuffer, reps: int, stream_bytes: int,
                 label: str, plain: bool = True) -> dict:
    k, sl = b.slices(n, stream_bytes)
    d, p, s, bk = b.dev, b.pinned, b.src, b.back
    paths = {
        "h2d_pinned": lambda i: d[sl[i]].copy_(p[sl[i]], non_blocking=True),
        "h2d_staging": lambda i: staging.copy_to_device(d[sl[i]], s[sl[i]]),
        "d2h_pinned": lambda i: p[sl[i]].copy_(d[sl[i]], non_blocking=True),
        "d2h_staging": lambda i: staging.copy_to_host(bk[sl[i]], d[sl[i]]),
        "memcpy": lambda i: p[sl[i]].copy_(s[sl[i]]),
    }
    if plain:
        paths["h2d_pageable"] = lambda i: d[sl[i]].copy_(s[sl[i]])
        paths["d2h_pageable"] = lambda i: bk[sl[i]].copy_(d[sl[i]])
    secs = {}
    for name, fn in paths.items():
        progress(f"{label}: {name}")
        secs[f"single_{name}"] = time_wall(lambda: fn(0), reps)
        if k > 1 or name.endswith("staging"):
            def stream(fn=fn):
                for i in range(k):
                    fn(i)
            secs[f"stream_{name}"] = [t / k for t in time_wall(stream, reps)]
        else:
            secs[f"stream_{name}"] = secs[f"single_{name}"]
    secs["event_h2d_pinned"] = time_events(lambda: d[sl[0]].copy_(p[sl[0]], non_blocking=True), reps)
    # the staged data must be right: a fresh round trip of the first slice, both directions
    torch.cuda.synchronize()
    d[sl[0]].zero_()
    bk[sl[0]].zero_()
    staging.copy_to_device(d[sl[0]], s[sl[0]])
    staging.copy_to_host(bk[sl[0]], d[sl[0]])
    ok = torch.equal(bk[sl[0]], s[sl[0]])
    med = {key: statistics.median(v) for key, v in secs.items()}
    return {"bytes": n, "stream_copies": k, "seconds": med, "gbps": {key: n / v / 1e9 for key, v in med.items()},
            "all_seconds": secs, "verified": bool(ok)}


def pct(g: dict, mode: str, direction: str) -> float:
    return 100 * g[f"{mode}_{direction}_staging"] / g[f"{mode}_{direction}_pinned"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for staging.md/.json/.png")
    ap.add_argument("--max-gib", type=float, default=4.0, help="largest copy size in GiB")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per point (median kept)")
    ap.add_argument("--cap-mib", type=int, default=64, help="staging buffer cap in MiB")
    ap.add_argument("--stream-mib", type=int, default=512, help="bytes per stream measurement")
    ap.add_argument("--min-chunk-mib", type=float, default=None, help="staging minimum chunk (default: the library's)")
    ap.add_argument("--split", type=int, default=None, help="staging split (default: the library's)")
    ap.add_argument("--pump-min-chunk-kib", type=float, default=None,
                    help="minimum chunk of a single copy through the compiled pump, KiB (default: the library's)")
    ap.add_argument("--h2d-share", type=float, default=None, help="cap share of host-to-device halves (default: the library's)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (the host memcpy runs on them)")
    ap.add_argument("--sweep-min-chunk-mib", default="", help="comma list: also time these minimum chunk sizes")
    ap.add_argument("--sweep-split", default="", help="comma list: also time these split counts")
    ap.add_argument("--sweep-pump-min-chunk-kib", default="", help="comma list: also time these pump minimum chunks (KiB)")
    ap.add_argument("--sweep-sizes-mib", default="1,4,16,64", help="copy sizes for the sweep")
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
    b = Buffers(sizes[-1], dev)
    if args.threads:
        torch.set_num_threads(args.threads)
    knobs = {k: v for k, v in (("min_chunk_bytes", None if args.min_chunk_mib is None else int(args.min_chunk_mib * MIB)),
                               ("split", args.split), ("h2d_share", args.h2d_share),
                               ("pump_min_chunk_bytes", None if args.pump_min_chunk_kib is None
                                else int(args.pump_min_chunk_kib * 1024))) if v is not None}
    staging = StagingBuffer(dev, args.cap_mib * MIB, **knobs)
    stream_bytes = args.stream_mib * MIB

    rows = []
    # warm-up, discarded: the first copies of a process pay one-off costs (the context's first
    # pinned registrations, allocator growth) that are no property of any size
    measure_size(b, sizes[0], staging, 2, stream_bytes, "warm-up")
    for i, n in enumerate(sizes):
        rows.append(measure_size(b, n, staging, args.reps, stream_bytes, f"[{i + 1}/{len(sizes)}] {n / MIB:.0f} MiB"))
    sweep = []
    mins = [int(float(x) * MIB) for x in args.sweep_min_chunk_mib.split(",") if x]
    splits = [int(x) for x in args.sweep_split.split(",") if x]
    pmins = [int(float(x) * 1024) for x in args.sweep_pump_min_chunk_kib.split(",") if x]
    if mins or splits or pmins:
        for mc in mins or [staging.min_chunk_bytes]:
            for sp in splits or [staging.split]:
                for pmc in pmins or [staging.pump_min_chunk_bytes]:
                    st = StagingBuffer(dev, args.cap_mib * MIB, **{**knobs, "min_chunk_bytes": mc, "split": sp,
                                                                  "pump_min_chunk_bytes": pmc})
                    for m in [int(x) for x in args.sweep_sizes_mib.split(",")]:
                        r = measure_size(b, m * MIB, st, args.reps, stream_bytes,
                                         f"sweep min {mc / MIB:g} MiB split {sp} pump min {pmc >> 10} KiB: {m} MiB",
                                         plain=False)
                        sweep.append({"min_chunk_bytes": mc, "split": sp, "pump_min_chunk_bytes": pmc, **r})
                    st.close()
    progress("")

    info = {
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "host_threads": torch.get_num_threads(), "reps": args.reps, "stream_bytes": stream_bytes,
        "cap_bytes": staging.cap_bytes, "min_chunk_bytes": staging.min_chunk_bytes, "split": staging.split,
        "pump_min_chunk_bytes": staging.pump_min_chunk_bytes, "pump": staging._pump() is not None,
        "host_thp": __import__("kvferry.transport.hostmem", fromlist=["thp_mode"]).thp_mode(),
        "h2d_share": staging.h2d_share,
        "staging_peak_bytes": staging.peak_bytes, "staging_pinned_bytes": staging.pinned_bytes,
        "timing": "wall clock between device syncs for every path; event_h2d_pinned: CUDA events",
    }
    md = render_markdown(rows, sweep, info)
    print(md)
    (args.out / "staging.md").write_text(md)
    (args.out / "staging.json").write_text(json.dumps({"info": info, "rows": rows, "sweep": sweep}, indent=2))
    plot(rows, args.out / "staging.png", info)
    bad = [r["bytes"] for r in rows + sweep if not r["verified"]]
    if bad:
        print(f"staging_bench: staged data did NOT match for sizes {bad}", file=sys.stderr)
        return 1
    return 0


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n < 1 << 30 else f"{n >> 30} GiB"


def render_markdown(rows, sweep, info) -> str:
    lines = [f"# Host<->device copy bandwidth (GB/s, 1 GB = 1e9 bytes) on {info['gpu']}", "",
             f"torch {info['torch']}, {info['host_threads']} host threads, median of {info['reps']} runs; "
             f"staging cap {info['cap_bytes'] // MIB} MiB, minimum chunk {info['min_chunk_bytes'] / MIB:g} MiB, "
             f"split {info['split']}, single pump copies from {info['pump_min_chunk_bytes'] >> 10} KiB "
             f"(pump {'on' if info['pump'] else 'off'}, THP {info['host_thp']}); "
             f"peak staging bytes {info['staging_peak_bytes']:,}. Every path timed on "
             "the wall clock between syncs; 'event' is the pinned DMA alone (CUDA events).", ""]
    for mode, what in (("stream", f"back-to-back copies of each size (>= {info['stream_bytes'] // MIB} MiB per run)"),
                       ("single", "one copy of each size")):
        lines += [f"## {mode}: {what}", "",
                  "| size | H2D pinned (event) | H2D pinned | H2D pageable | H2D staging | staging % pinned "
                  "| D2H pinned | D2H pageable | D2H staging | staging % pinned | host memcpy |",
                  "|" + "---|" * 11]
        for r in rows:
            g = r["gbps"]
            lines.append(
                f"| {_size(r['bytes'])} | {g['event_h2d_pinned']:.1f} | {g[f'{mode}_h2d_pinned']:.1f} "
                f"| {g[f'{mode}_h2d_pageable']:.1f} | {g[f'{mode}_h2d_staging']:.1f} | {pct(g, mode, 'h2d'):.0f}% "
                f"| {g[f'{mode}_d2h_pinned']:.1f} | {g[f'{mode}_d2h_pageable']:.1f} | {g[f'{mode}_d2h_staging']:.1f} "
                f"| {pct(g, mode, 'd2h'):.0f}% | {g[f'{mode}_memcpy']:.1f} |")
        lines.append("")
    if sweep:
        lines += ["## chunking sweep: staging % of pinned (stream / single)", "",
                  "| min chunk | split | pump min chunk | size | H2D | D2H |", "|---|---|---|---|---|---|"]
        for r in sweep:
            g = r["gbps"]
            lines.append(f"| {r['min_chunk_bytes'] / MIB:g} MiB | {r['split']} | {r['pump_min_chunk_bytes'] >> 10} KiB "
                         f"| {_size(r['bytes'])} "
                         f"| {pct(g, 'stream', 'h2d'):.0f}% / {pct(g, 'single', 'h2d'):.0f}% "
                         f"| {pct(g, 'stream', 'd2h'):.0f}% / {pct(g, 'single', 'd2h'):.0f}% |")
        lines.append("")
    return "\n".join(lines)


def plot(rows, path: Path, info) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    x = [r["bytes"] / MIB for r in rows]
    for ax, mode in zip(axes, ("stream", "single")):
        for key in ("h2d_pinned", "h2d_staging", "h2d_pageable", "d2h_pinned", "d2h_staging", "d2h_pageable", "memcpy"):
            style = "-o" if key.startswith("h2d") else ("--s" if key.startswith("d2h") else ":^")
            ax.plot(x, [r["gbps"][f"{mode}_{key}"] for r in rows], style, label=key.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("copy size (MiB)")
        ax.set_title(f"{mode}: {'back-to-back copies' if mode == 'stream' else 'one copy'}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"host<->device copies, {info['gpu']}, staging cap {info['cap_bytes'] // MIB} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
