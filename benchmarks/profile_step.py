"""Where a decode step's time goes: host (Python + launches) against device, per arm.

  python benchmarks/profile_step.py --out DIR -- BENCH FLAGS
  e.g. python benchmarks/profile_step.py --out /tmp/p -- --random-weights llama3-8b \
         -d 4096,16384 -nkvo 0,1 -kvpd 1 --device cuda

Uses the bench's engine, caches and depth fill. For each depth and arm it times N decode
steps three ways: the whole step (synchronized), the host time until forward() returns
(enqueue only), and, with torch.profiler, the top ops by host time and their call counts.
Writes DIR/profile.md. A step whose enqueue time is close to its whole time is host-bound:
the GPU waits for Python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("bench", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    from kvferry.bench.command import parse_args
    from kvferry.bench.runner import Bench
    bench_args = [x for x in a.bench if x != "--"]
    ba = parse_args(["-p", "0", "-n", str(a.steps + 8), "-r", "1", *bench_args])
    b = Bench(ba)
    eng = b.eng
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lines = [f"# decode step profile: {eng.loaded.cfg.name}, {eng.device}, {a.steps} steps per arm\n"]
    for cfg in b.cfgs:
        b.cache_for(cfg)
    for depth in b.depths:
        b.fill_depth(depth)
        timed = []
        # all arms are timed before any profiling: a profiler run leaves per-op hooks
        # behind that slow every later op
        for prof_pass in (False, True):
            for arm, cfg in zip(b.arms, b.cfgs):
                eng.cache, eng.cfg = b.cache_for(cfg), cfg
                eng.model.set_flash_attn(cfg.flash_attn)
                eng.model.use_graphs = cfg.cuda_graphs
                name = ", ".join(f"{k} {v}" for k, v in arm.items() if v != "-")
                eng.cache.truncate(0, depth)
                tok = [1]
                for i in range(3):  # warm-up
                    tok = eng.decode([0], tok, [depth + i]).argmax(-1).tolist()
                if not prof_pass:
                    enq, whole = [], []
                    for i in range(a.steps):
                        sync()
                        t0 = time.perf_counter()
                        logits = eng.decode([0], tok, [depth + 3 + i])
                        t1 = time.perf_counter()
                        tok = logits.argmax(-1).tolist()
                        t2 = time.perf_counter()
                        enq.append((t1 - t0) * 1e3)
                        whole.append((t2 - t0) * 1e3)
                    timed.append((statistics.median(whole), statistics.median(enq)))
                    print(f"step {timed[-1][0]:.2f} ms, enqueue {timed[-1][1]:.2f} ms | {name} | depth {depth}",
                          file=sys.stderr, flush=True)
                    eng.cache.truncate(0, depth)
                    continue
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                with torch.profiler.profile(activities=acts) as prof:
                    for i in range(4):
                        tok = eng.decode([0], tok, [depth + 3 + i]).argmax(-1).tolist()
                eng.cache.truncate(0, depth)
                whole, enq = timed.pop(0)
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60)
                lines += [f"## depth {depth}: {name}\n",
                          f"step {whole:.2f} ms (median of {a.steps}, timed before profiling), host enqueue "
                          f"{enq:.2f} ms ({100 * enq / whole:.0f}% of the step)\n",
                          "```", table, "```\n"]
    for c in b.caches.values():
        c.close()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
