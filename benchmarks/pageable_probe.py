"""Where a pageable host-KV decode step's time goes, against pinned, in one process:

  python benchmarks/pageable_probe.py --out DIR [--variants V;V;...] -- BENCH FLAGS
  e.g. python benchmarks/pageable_probe.py --out /tmp/p -- --random-weights llama3-8b \
         --layers 8 -d 16384 -kvpd 2 --device cuda

Builds the bench's engine with a pinned and a pageable host cache (same rows), times decode
steps on each, and for the pageable one reports the staging buffer's per-direction counters
per step: time the delivery thread waited for a half (the copy engine was behind), spent in
the host memcpy, and spent issuing DMAs. A variant is `name:key=value,...` with keys
  threads   torch intra-op threads (the staging memcpy runs on them)
  switch    sys.setswitchinterval seconds (the GIL hand-over between the decode and copy threads)
  min_mib   staging minimum chunk (MiB);  split  staging split;  cap_mib  staging cap (MiB)
  h2d_share the cap's share for host-to-device halves
  poll_us   wait for a half by polling its event with sleeps of this many us (-1: driver wait)
  worker    1: deliveries on the pump's C worker thread (--staging-on worker); 0: as `thread` says
  thread    1: deliveries staged on a Python copy thread (--staging-on thread), 0: on the decode thread
  native    1: host-to-device chunks through the compiled pump, 0: the Python chunk loop
  pump_threads  memcpy threads of the compiled pump (0: torch's intra-op count)
  stream    1: the pump's memcpy with non-temporal (streaming) stores, 0: glibc memcpy
Writes DIR/pageable_probe.md and .json. Diagnostic only: the bench's pin arm is the measure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

MIB = 1 << 20
DEFAULT_VARIANTS = "default:"


def parse_variants(text: str):
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, kv = item.partition(":")
        knobs = {}
        for pair in filter(None, kv.split(",")):
            k, _, v = pair.partition("=")
            knobs[k.strip()] = float(v)
        out.append((name, knobs))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("bench", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    from kvferry.bench.command import parse_args
    from kvferry.bench.report import write_md_json
    from kvferry.bench.runner import Bench
    from kvferry.transport.staging import get_staging

    bench_args = [x for x in a.bench if x != "--"]
    ba = parse_args(["-p", "0", "-n", str(a.steps + 8), "-r", "1", "-nkvo", "1", "-pin", "1,0",
                     *bench_args])
    b = Bench(ba)
    eng = b.eng
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    depth = b.depths[0]
    for cfg in b.cfgs:
        b.cache_for(cfg)
    b.fill_depth(depth)
    staging = get_staging(eng.device)
    spec = b.cache_for(b.cfgs[0]).spec
    step_bytes = spec.num_layers * 2 * depth * spec.num_kv_heads * spec.row_bytes
    base = dict(threads=torch.get_num_threads(), switch=sys.getswitchinterval(),
                min_mib=staging.min_chunk_bytes / MIB, split=staging.split, cap_mib=staging.cap_bytes / MIB,
                h2d_share=staging.h2d_share, poll_us=-1)
    pageable_engine = b.cache_for(b.cfgs[1]).engine
    base["thread"] = 0.0 if 0 in pageable_engine.inline_lanes else 1.0
    base["worker"] = 1.0 if pageable_engine.native is not None else 0.0
    worker_t = pageable_engine.native
    if worker_t is None and staging.worker_pump() is not None:
        worker_t = (staging.submit_to_device, lambda ctr, gen: staging.wait_signal((ctr, gen)),
                    staging.synchronize, staging.worker_pump().store)
    base["native"] = 1.0 if staging._pump() is not None else 0.0
    base["pump_threads"] = 0.0
    base["stream"] = 1.0 if staging.pump_copy == "stream" else 0.0

    def apply(knobs):
        k = {**base, **knobs}
        torch.set_num_threads(int(k["threads"]))
        sys.setswitchinterval(k["switch"])
        staging.min_chunk_bytes = int(k["min_mib"] * MIB)
        staging.split = int(k["split"])
        staging.cap_bytes = int(k["cap_mib"] * MIB)
        staging.h2d_share = k["h2d_share"]
        staging._poll_s = None if k["poll_us"] < 0 else k["poll_us"] * 1e-6
        pageable_engine.fence()
        pageable_engine.inline_lanes = frozenset() if k["thread"] or k["worker"] else frozenset((0,))
        pageable_engine.native = worker_t if k["worker"] else None
        staging.native = bool(k["native"])
        staging.pump_threads = int(k["pump_threads"]) or None
        staging.pump_copy = "stream" if k["stream"] else "memcpy"
        return k

    def timed(cfg):
        eng.cache, eng.cfg = b.cache_for(cfg), cfg
        eng.model.set_flash_attn(cfg.flash_attn)
        eng.model.use_graphs = cfg.cuda_graphs
        eng.cache.truncate(0, depth)
        tok = [1]
        for i in range(3):  # warm-up (graphs, halves grown)
            tok = eng.decode([0], tok, [depth + i]).argmax(-1).tolist()
        sync()
        s0 = staging.stats()
        e = eng.cache.engine
        e0 = (list(getattr(e, "lane_busy_s", [0, 0])), list(getattr(e, "lane_wait_s", [0, 0])), getattr(e, "compute_wait_s", 0),
              list(getattr(e, "lane_idle_s", [0, 0])))
        times = []
        for i in range(a.steps):
            t0 = time.perf_counter()
            tok = eng.decode([0], tok, [depth + 3 + i]).argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
        sync()
        s1 = staging.stats()
        e1 = (list(getattr(e, "lane_busy_s", [0, 0])), list(getattr(e, "lane_wait_s", [0, 0])), getattr(e, "compute_wait_s", 0),
              list(getattr(e, "lane_idle_s", [0, 0])))
        eng.cache.truncate(0, depth)
        per = dict(lane0_busy_s=(e1[0][0] - e0[0][0]) / a.steps, lane0_wait_s=(e1[1][0] - e0[1][0]) / a.steps,
                   compute_wait_s=(e1[2] - e0[2]) / a.steps, lane0_idle_s=(e1[3][0] - e0[3][0]) / a.steps)
        for d in ("h2d", "d2h"):
            per[d] = {k: (s1[d][k] - s0[d][k]) / a.steps for k in ("chunks", "bytes", "wait_s", "memcpy_s", "issue_s",
                                                                 "call_s", "entry_s")}
        return statistics.median(times), per

    pinned_cfg, pageable_cfg = b.cfgs[0], b.cfgs[1]
    rows, lines = [], []
    title = (f"# pageable vs pinned host KV decode: {eng.loaded.cfg.name}, {spec.num_layers} layers, depth {depth}, "
             f"{step_bytes / MIB:.0f} MiB ferried per step, {eng.device}, median of {a.steps} steps")
    lines += [title, "", "| variant | knobs | pinned ms | pageable ms | pageable % of pinned | h2d wait ms | "
              "h2d memcpy ms | h2d memcpy GB/s | h2d issue ms | h2d chunks | d2h ms | lane 0 busy ms | lane 0 event wait ms | "
              "compute waits ms | h2d pump call ms | h2d staging entry ms | lane 0 idle ms |", "|" + "---|" * 17]
    for name, knobs in parse_variants(a.variants):
        k = apply(knobs)
        t_pin, _ = timed(pinned_cfg)
        t_pg, per = timed(pageable_cfg)
        h, w = per["h2d"], per["d2h"]
        gbps = h["bytes"] / h["memcpy_s"] / 1e9 if h["memcpy_s"] else 0.0
        row = dict(variant=name, knobs=k, pinned_ms=t_pin * 1e3, pageable_ms=t_pg * 1e3,
                   pct_of_pinned=100 * t_pin / t_pg, staging=per, link_gbps_pinned=step_bytes / t_pin / 1e9)
        rows.append(row)
        knob_s = ", ".join(f"{kk} {vv:g}" for kk, vv in knobs.items()) or "-"
        line = (f"| {name} | {knob_s} | {t_pin * 1e3:.1f} | {t_pg * 1e3:.1f} | {row['pct_of_pinned']:.0f}% | "
                f"{h['wait_s'] * 1e3:.1f} | {h['memcpy_s'] * 1e3:.1f} | {gbps:.1f} | {h['issue_s'] * 1e3:.1f} | "
                f"{h['chunks']:.0f} | {(w['wait_s'] + w['memcpy_s'] + w['issue_s']) * 1e3:.1f} | "
                f"{per['lane0_busy_s'] * 1e3:.1f} | {per['lane0_wait_s'] * 1e3:.1f} | {per['compute_wait_s'] * 1e3:.1f} | "
                f"{h['call_s'] * 1e3:.1f} | {h['entry_s'] * 1e3:.1f} | "
                f"{per['lane0_idle_s'] * 1e3:.1f} |")
        lines.append(line)
        print(line, file=sys.stderr, flush=True)
    apply({})
    for c in b.caches.values():
        c.close()
    write_md_json(a.out, "pageable_probe", lines, rows)


if __name__ == "__main__":
    main()
