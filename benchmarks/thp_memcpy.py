"""Host memcpy from pageable memory into a 24 MiB buffer (a staging half), chunk by chunk, with
the pageable source in huge pages (hostmem.alloc_host) and in small pages (KVFERRY_HOST_THP=0
equivalent), on the compiled pump's memcpy. Best of 3 passes per point; both sides run in the
same process so only their ratio means anything.

    python benchmarks/thp_memcpy.py [--gib 1] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvferry.transport import hostmem  # noqa: E402
from kvferry.transport.native import load_pump  # noqa: E402

CHUNK = 24 << 20


def alloc(n: int, huge: bool):
    os.environ["KVFERRY_HOST_THP"] = "1" if huge else "0"
    t = hostmem.alloc_host(n)
    t.fill_(1)  # every page in before timing
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args()
    pump = load_pump(False)
    if pump is None:
        print("thp_memcpy: the compiled pump could not be built here", file=sys.stderr)
        return 2
    n = int(a.gib * (1 << 30))
    print(f"THP setting: {hostmem.thp_mode()}; {n >> 20} MiB source, {CHUNK >> 20} MiB chunks\n")
    print("| threads | small pages GB/s | huge pages GB/s | huge / small |\n|---:|---:|---:|---:|")
    for nt in (int(x) for x in a.threads.split(",")):
        gbps = {}
        for huge in (False, True):
            src, dst = alloc(n, huge), alloc(CHUNK, huge)
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                for off in range(0, n, CHUNK):
                    pump.copy(dst.data_ptr(), src.data_ptr() + off, min(CHUNK, n - off), nt)
                best = max(best, n / (time.perf_counter() - t0) / 1e9)
            gbps[huge] = best
            del src, dst
        print(f"| {nt} | {gbps[False]:.1f} | {gbps[True]:.1f} | {gbps[True] / gbps[False]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
