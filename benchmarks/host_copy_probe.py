"""Host-side costs behind a staged copy, on the machine it runs on:

    python benchmarks/host_copy_probe.py [--sizes-mib 1,4,16,64] [--threads 1,4,8,16]

  memcpy GB/s   torch CPU copy_ of distinct pageable sources into one destination, from the
                main thread and from a worker thread, at several intra-op thread counts
  launch us     host time to issue one tiny non-blocking host-to-device copy, one event
                record, one event synchronize on a finished event (CUDA only)
  ceiling       (--ceiling) the fastest host copy we can find, pageable source to two reused
                24 MiB halves (pinned on CUDA), as the staging loop does: torch copy_ at several
                thread counts and glibc memmove on several Python threads (ctypes drops the
                GIL) and the staging pump's own memcpy (glibc or streaming stores), each alone and while a pinned host-to-device DMA stream runs (CUDA), with
                that DMA's own rate. A staged copy cannot beat min(link, this).
Prints markdown. Use it to tell whether a host is memcpy-bound or launch-bound.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time

import torch

MIB = 1 << 20


def memcpy_gbps(n: int, reps: int = 20) -> float:
    src = torch.empty(n * reps, dtype=torch.uint8).fill_(3)  # distinct sources: no cache reuse
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)
    dst.copy_(src[:n])
    t0 = time.perf_counter()
    for i in range(reps):
        dst.copy_(src[i * n:(i + 1) * n])
    return n * reps / (time.perf_counter() - t0) / 1e9


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def launch_us(reps: int = 2000) -> dict:
    dev = torch.device("cuda")
    s = torch.cuda.Stream()
    a = torch.empty(1024, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(1024, dtype=torch.uint8, device=dev)
    ev = torch.cuda.Event()
    res = {}
    with torch.cuda.stream(s):
        d.copy_(a, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            d.copy_(a, non_blocking=True)
        res["copy_launch_us"] = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            ev.record(s)
        res["event_record_us"] = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            ev.synchronize()
        res["event_sync_done_us"] = (time.perf_counter() - t0) / reps * 1e6
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch.cuda.stream(s):
            pass
    res["stream_ctx_us"] = (time.perf_counter() - t0) / reps * 1e6
    return res


HALF = 24 * MIB


def _torch_copier(nt):
    def run(src, halves):
        torch.set_num_threads(nt)
        for k, off in enumerate(range(0, src.numel(), HALF)):
            n = min(HALF, src.numel() - off)
            halves[k & 1][:n].copy_(src[off:off + n])
    return run


def _memmove_copier(nt):
    # thread i copies its 1/nt of every 24 MiB piece: memmove through ctypes drops the GIL
    def run(src, halves):
        s0, h0 = src.data_ptr(), [h.data_ptr() for h in halves]
        part = HALF // nt

        def work(i):
            for k, off in enumerate(range(0, src.numel(), HALF)):
                ctypes.memmove(h0[k & 1] + i * part, s0 + off + i * part, part)
        ts = [threading.Thread(target=work, args=(i,)) for i in range(nt)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return run


def _pump_copier(nt, mode):
    # the staging pump's own memcpy (pump.c), one call per 24 MiB piece, GIL released
    from kvferry.transport.native import load_pump
    pump = load_pump(False)

    def run(src, halves):
        s0, h0 = src.data_ptr(), [h.data_ptr() for h in halves]
        for k, off in enumerate(range(0, src.numel(), HALF)):
            pump.copy(h0[k & 1], s0 + off, min(HALF, src.numel() - off), nt, mode)
    return run if pump is not None else None


def ceiling(total_mib: int, cuda: bool) -> list[str]:
    total = total_mib // 24 * HALF
    src = torch.empty(total, dtype=torch.uint8).fill_(7)  # touched: no first-touch faults timed
    halves = [torch.empty(HALF, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    default = torch.get_num_threads()
    methods = [(f"torch copy_, {n} threads", _torch_copier(n)) for n in (4, 8, 16) if n <= max(default, 4)]
    methods += [(f"glibc memmove, {n} Python threads", _memmove_copier(n)) for n in (1, 4, 8, 16)]
    methods += [(f"pump {mode}, {n} threads", _pump_copier(n, mode)) for mode in ("memcpy", "stream")
                for n in (8, 14, 16)]
    methods = [(name, fn) for name, fn in methods if fn is not None]
    lines = [f"host copy ceiling: {total / MIB:.0f} MiB pageable source into two 24 MiB "
             f"{'pinned ' if cuda else ''}halves", "",
             "| method | alone GB/s | with a DMA stream GB/s | that DMA GB/s |", "|---|---:|---:|---:|"]
    if cuda:
        dma_src = torch.empty(256 * MIB, dtype=torch.uint8, pin_memory=True)
        dma_dst = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
    for name, fn in methods:
        fn(src[:2 * HALF], halves)  # warm-up (threads, pages of the halves)
        t0 = time.perf_counter()
        fn(src, halves)
        alone = total / (time.perf_counter() - t0) / 1e9
        with_dma = dma = float("nan")
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = max(8, int(total / alone / 1e9 / (256 * MIB / 50e9)) + 8)  # outlasts the memcpy
            with torch.cuda.stream(side):
                e0.record(side)
                for _ in range(reps):
                    dma_dst.copy_(dma_src, non_blocking=True)
                e1.record(side)
            t0 = time.perf_counter()
            fn(src, halves)
            t_copy = time.perf_counter() - t0
            busy = not e1.query()  # the DMA stream was still running when the memcpy ended
            e1.synchronize()
            with_dma = total / t_copy / 1e9
            dma = reps * 256 * MIB / (e0.elapsed_time(e1) / 1e3) / 1e9
            if not busy:
                name += " (DMA ended first)"
        lines.append(f"| {name} | {alone:.1f} | {with_dma:.1f} | {dma:.1f} |")
        print(lines[-1], file=sys.stderr, flush=True)  # progress
    torch.set_num_threads(default)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64")
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--ceiling", type=int, default=0, metavar="MIB",
                    help="only the copy ceiling, over a pageable source of this many MiB")
    a = ap.parse_args()
    if a.ceiling:
        print("\n".join(ceiling(a.ceiling, torch.cuda.is_available())))
        return
    sizes = [int(x) * MIB for x in a.sizes_mib.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    default = torch.get_num_threads()
    print(f"torch {torch.__version__}, default intra-op threads {default}")
    print("| threads | where | " + " | ".join(f"{n // MIB} MiB" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for nt in threads:
        torch.set_num_threads(nt)
        print(f"| {nt} | main | " + " | ".join(f"{memcpy_gbps(n):.1f}" for n in sizes) + " |")
        # one long-lived thread, as the copy engine's worker is; warmed up before timing
        row = in_thread(lambda: [torch.set_num_threads(nt), memcpy_gbps(sizes[0])]
                        and [f"{memcpy_gbps(n):.1f}" for n in sizes])
        print(f"| {nt} | worker | " + " | ".join(row) + " |")
    torch.set_num_threads(default)
    if torch.cuda.is_available():
        print()
        for k, v in launch_us().items():
            print(f"{k}: {v:.2f}")


if __name__ == "__main__":
    main()
