"""Host-side costs behind a staged copy, on the machine it runs on:

    python benchmarks/host_copy_probe.py [--sizes-mib 1,4,16,64] [--threads 1,4,8,16]

  memcpy GB/s   torch CPU copy_ of distinct pageable sources into one destination, from the
                main thread and from a worker thread, at several intra-op thread counts
  launch us     host time to issue one tiny non-blocking host-to-device copy, one event
                record, one event synchronize on a finished event (CUDA only)
Prints a markdown table. Use it to tell whether a host is memcpy-bound or launch-bound.
"""

from __future__ import annotations

import argparse
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64")
    ap.add_argument("--threads", default="1,4,8,16")
    a = ap.parse_args()
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
