"""`kvferry bench`: llama-bench-style measurements, each set against the link bound
measured in the same run.

Tests: ppP (prefill P tokens) and tgN (decode N tokens) at each depth D (rows already in
the cache). Engine flags given as comma lists are swept; arms run A/B/A/B with the order
reversed between passes, so drift does not favour one arm. The device-resident arm's step
time and the link bandwidth of the same run give each row's bound; every arm's greedy
tokens are compared with the first arm's (the `same` column), so the benchmark is also
an exactness check on whatever machine it runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import statistics
import sys
import time

import torch
from tqdm import tqdm

from kvferry import KvferryError
from kvferry.bench import bound as B
from kvferry.bench.link import link_sweep, probe_device_memory, probe_link, sweep_table
from kvferry.bench.report import format_rows, plot_rows

log = logging.getLogger(__name__)
MiB = 1 << 20


def add_parser(sub):
    from kvferry.cli import add_model_args
    p = sub.add_parser("bench", help="llama-bench-style measurements against the link bound")
    p.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, comma list; 0 = none (default: 512)")
    p.add_argument("-n", "--n-gen", default="128", help="generation lengths, comma list; 0 = none (default: 128)")
    p.add_argument("-d", "--n-depth", default="0", help="depths: rows in the cache before each test, comma list (default: 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions per arm (default: 5)")
    p.add_argument("-o", "--output", default="md", choices=["md", "csv", "json", "jsonl"], help="output format (default: md)")
    p.add_argument("--plot", default=None, help="write a PNG of t/s against depth with the link bound")
    p.add_argument("--random-weights", default=None, metavar="PRESET",
                   help="random weights of a real shape: llama3-8b, llama3-70b, qwen3-32b, smollm2-135m, or a config.json path")
    p.add_argument("--layers", type=int, default=None, help="with --random-weights: keep this many layers")
    p.add_argument("--depth-fill", default="auto", choices=["auto", "random", "prefill"],
                   help="how depth rows get into the cache: random KV rows, or a real prefill (default: random for random weights)")
    p.add_argument("--link", action="store_true",
                   help="only probe the link: pinned, pageable and staged copies per size, as %% of pinned")
    p.add_argument("--link-mib", default=None,
                   help="copy sizes of the link probe in MiB, comma list (default: 1,4,16,64,256,1024,4096 "
                        "with --link; 256 for a benchmark's own link figure)"),
    p.add_argument("-pin", "--kv-pinned-sweep", default=None,
                   help="host cache pinned (1) or pageable (0), comma list to sweep (default: --kv-pinned)")
    add_model_args(p, sweep=True)
    p.set_defaults(func=cmd_bench)


def _ints(v: str, flag: str, lo: int = 0) -> list[int]:
    try:
        out = [int(x) for x in str(v).split(",") if x.strip() != ""]
    except ValueError:
        raise KvferryError(f"{flag} expects a comma list of integers, got '{v}'") from None
    if not out or any(x < lo for x in out):
        raise KvferryError(f"{flag} values must be >= {lo}, got '{v}'")
    return out


def _arms(a) -> list[dict]:
    lists = {
        "nkvo": [x.strip() for x in str(a.no_kv_offload).split(",")],
        "pin": [x.strip() for x in (a.kv_pinned_sweep or ("1" if a.kv_pinned else "0")).split(",")],
        "kvpd": [x.strip() for x in str(a.kv_pipeline_depth).split(",")],
        "kvpb": [x.strip() for x in str(a.kv_pipeline_budget).split(",")],
        "ctk": [x.strip() for x in str(a.kv_type).split(",")],
        "chunk": [x.strip() for x in str(a.kv_chunk).split(",")],
        "fa": [x.strip() for x in str(a.flash_attn).split(",")],
        "cg": [x.strip() for x in str(a.cuda_graphs).split(",")],
    }
    arms, seen = [], set()
    for combo in itertools.product(*lists.values()):
        arm = dict(zip(lists, combo))
        if arm["nkvo"] not in ("0", "1"):
            raise KvferryError(f"-nkvo expects 0 or 1, got '{arm['nkvo']}'")
        if arm["pin"] not in ("0", "1"):
            raise KvferryError(f"-pin expects 0 or 1, got '{arm['pin']}'")
        for flag in ("fa", "cg"):
            arm[flag] = {"on": "1", "off": "0"}.get(arm[flag].lower(), arm[flag])
            if arm[flag] not in ("0", "1"):
                raise KvferryError(f"-{flag} expects on/off (or 1/0), got '{arm[flag]}'")
        if arm["nkvo"] == "0":  # transport flags do not apply to a device-resident cache
            arm["kvpd"], arm["kvpb"], arm["pin"] = "-", "-", "-"
        key = tuple(arm.values())
        if key not in seen:
            seen.add(key)
            arms.append(arm)
    return arms


class Bench:
    def __init__(self, a):
        from kvferry.cli import engine_config
        from kvferry.engine.generation import Engine
        self.a = a
        self.pp = [x for x in _ints(a.n_prompt, "-p") if x > 0]
        self.tg = [x for x in _ints(a.n_gen, "-n") if x > 0]
        self.depths = _ints(a.n_depth, "-d")
        if a.repetitions < 1:
            raise KvferryError(f"-r must be >= 1, got {a.repetitions}")
        if not self.pp and not self.tg:
            raise KvferryError("nothing to run: give -p or -n a value > 0")
        self.arms = _arms(a)
        ctx = max(self.depths) + max(self.pp + self.tg) + 1
        first = self.arms[0]
        self.base = engine_config(a, nkvo="0", kvpd="0", kvpb="0", ctk=first["ctk"], chunk=first["chunk"], fa=first["fa"], cg=first["cg"])
        self.base = dataclasses.replace(self.base, ctx_size=max(ctx, 1))
        self.cfgs = [engine_config(a, nkvo=arm["nkvo"], pinned=arm["pin"] != "0", kvpd=arm["kvpd"] if arm["kvpd"] != "-" else "0",
                                   kvpb=arm["kvpb"] if arm["kvpb"] != "-" else "0", ctk=arm["ctk"], chunk=arm["chunk"], fa=arm["fa"], cg=arm["cg"])
                     for arm in self.arms]
        self.cfgs = [dataclasses.replace(c, ctx_size=self.base.ctx_size) for c in self.cfgs]
        rw = a.random_weights
        model_cfg = None
        if rw and rw.endswith(".json"):
            from kvferry.model.arch import ModelConfig
            with open(rw) as f:
                model_cfg = ModelConfig.from_hf_config(json.load(f))
            if a.layers:
                model_cfg = dataclasses.replace(model_cfg, num_layers=a.layers)
            rw = None
        self.eng = Engine(self.base, preset=rw, layers=a.layers, random_model=model_cfg, with_cache=False)
        self.fill = a.depth_fill if a.depth_fill != "auto" else ("random" if self.eng.tokenizer is None else "prefill")
        self.caches = {}

    # -- caches ---------------------------------------------------------------------------
    def cache_for(self, cfg):
        """One cache per placement/type/chunk, shared by arms that differ only in transport."""
        key = (cfg.kv.offload, cfg.kv.pinned, cfg.kv.kv_type, cfg.kv.chunk_rows)
        c = self.caches.get(key)
        if c is None:
            c = self.eng.make_cache(cfg)
            self.caches[key] = c
        elif cfg.kv.offload and (c.kv.depth, c.kv.budget_mib) != (cfg.kv.depth, cfg.kv.budget_mib):
            c.set_transport(cfg.kv)
        return c

    def fill_depth(self, depth: int):
        """Put `depth` rows in every sequence of every cache: the same rows everywhere."""
        spec0 = None
        for cache in self.caches.values():
            spec0 = cache.spec
            for s in range(spec0.num_seqs):
                cache.reset(s)
        if depth == 0:
            return
        if self.fill == "prefill":
            ids = torch.randint(0, self.eng.loaded.cfg.vocab_size, (depth,), generator=torch.Generator().manual_seed(7)).tolist()
            for cache in self.caches.values():
                self.eng.cache = cache
                for s in range(cache.spec.num_seqs):
                    self.eng.prefill(s, ids)
            return
        from kvferry.kv import quant
        for cache in self.caches.values():
            spec = cache.spec
            g = torch.Generator(device=self.eng.device).manual_seed(11)
            for layer in range(spec.num_layers):
                for s in range(spec.num_seqs):
                    kv = [quant.quantize(torch.randn(depth, spec.num_kv_heads, spec.head_dim, generator=g,
                                                     device=self.eng.device, dtype=torch.float32).to(self.eng.dtype),
                                         spec.kv_type) for _ in range(2)]
                    if hasattr(cache, "write_host_rows"):
                        cache.write_host_rows(layer, s, 0, kv[0].cpu(), kv[1].cpu())
                    else:
                        cache.k[layer][s, :depth] = kv[0]
                        cache.v[layer][s, :depth] = kv[1]
            for s in range(spec.num_seqs):
                cache.seq_lens[s] = depth

    # -- one timed test -------------------------------------------------------------------------
    def _sync(self):
        if self.eng.device.type == "cuda":
            torch.cuda.synchronize(self.eng.device)

    def run_test(self, kind: str, n: int, depth: int):
        eng = self.eng
        seqs = list(range(eng.cfg.num_seqs))
        for s in seqs:
            eng.cache.truncate(s, depth)
        g = torch.Generator().manual_seed(1000 + depth + n)
        vocab = eng.loaded.cfg.vocab_size
        self._sync()
        t0 = time.perf_counter()
        toks = None
        if kind == "pp":
            for s in seqs:
                eng.prefill(s, torch.randint(0, vocab, (n,), generator=g).tolist(), start=depth)
        else:
            toks = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
            out = []
            for i in range(n):
                logits = eng.decode(seqs, toks, [depth + i] * len(seqs))
                toks = logits.argmax(-1).tolist()
                out.append(toks)
            toks = out
        self._sync()
        return (time.perf_counter() - t0) * 1e3, toks

    # -- the sweep --------------------------------------------------------------------------------
    def run(self) -> tuple[list[dict], dict]:
        eng, a = self.eng, self.a
        dev = eng.device
        tests = [("pp", n) for n in self.pp] + [("tg", n) for n in self.tg]
        for cfg in self.cfgs:
            self.cache_for(cfg)
        link = probe_link(dev, _ints(a.link_mib or "256", "--link-mib", 1)[0],
                          staged=eng.runner.staged if any(not c.kv.pinned for c in self.cfgs if c.kv.offload) else None)
        mem_gbps = probe_device_memory(dev)
        link_gbps = link["h2d_pinned"]
        log.info("link %.1f GB/s host to device (pinned), device memory %.0f GB/s", link_gbps, mem_gbps)
        rows = []
        total = len(self.depths) * len(tests) * len(self.arms) * (a.repetitions + 1)
        bar = tqdm(total=total, desc="bench", unit="run", disable=None)
        for depth in self.depths:
            self.fill_depth(depth)
            for kind, n in tests:
                times = {i: [] for i in range(len(self.arms))}
                stats = {}
                ref_tokens = {}
                for rep in range(a.repetitions + 1):  # rep 0 warms up
                    order = list(range(len(self.arms)))
                    if rep % 2 == 0:
                        order.reverse()
                    for i in order:
                        cache = self.cache_for(self.cfgs[i])
                        eng.cache = cache
                        eng.cfg = self.cfgs[i]
                        eng.runner.set_options(self.cfgs[i].flash_attn, self.cfgs[i].cuda_graphs)
                        if dev.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(dev)
                        before = dict(getattr(cache, "totals", {}))
                        ms, toks = self.run_test(kind, n if rep else min(n, 4), depth)
                        bar.update()
                        if rep == 0:
                            continue
                        times[i].append(ms)
                        if rep == 1:
                            ref_tokens[i] = toks
                            after = getattr(cache, "totals", {})
                            stats[i] = dict(early=after.get("early", 0) - before.get("early", 0),
                                            peak=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0)
                rows += self._rows(kind, n, depth, times, stats, ref_tokens, link_gbps, mem_gbps)
        bar.close()
        return rows, dict(link=link, mem_gbps=mem_gbps)

    def _rows(self, kind, n, depth, times, stats, ref_tokens, link_gbps, mem_gbps):
        eng = self.eng
        mc = eng.loaded.cfg
        np_ = eng.cfg.num_seqs
        tokens = n * np_
        per = n if kind == "tg" else 1
        out = []
        for i, arm in enumerate(self.arms):
            # the bound uses the device-resident arm with the same kernels and KV encoding,
            # and tokens are compared with the first arm that computes the same way
            peers = [k for k, o in enumerate(self.arms) if (o["fa"], o["cg"], o["ctk"], o["chunk"]) == (arm["fa"], arm["cg"], arm["ctk"], arm["chunk"])]
            dev_arm = next((k for k in peers if self.arms[k]["nkvo"] == "0"),
                           next((k for k, o in enumerate(self.arms) if o["nkvo"] == "0"), None))
            dev_step = statistics.mean(times[dev_arm]) / per if dev_arm is not None else None
            first_tokens = ref_tokens.get(peers[0])
            t = times[i]
            tps = [tokens / (ms * 1e-3) for ms in t]
            step_ms = statistics.mean(t) / per
            cache = self.cache_for(self.cfgs[i])
            spec = cache.spec
            host = self.cfgs[i].kv.offload
            ferried = stats[i]["early"] / per if host else 0
            row = dict(model=mc.name, size_gib=round(eng.loaded.file_bytes / 2**30, 2),
                       params_b=round(mc.num_params / 1e9, 2), backend=eng.device.type.upper(),
                       **arm, np=np_, test=f"{kind}{n}", depth=depth,
                       tps=round(statistics.mean(tps), 2), tps_std=round(statistics.pstdev(tps), 2),
                       step_ms=round(step_ms, 3), ferried_mib=round(ferried / MiB, 2),
                       link_gbps=round(link_gbps, 2))
            if kind == "tg":
                copy_ms = B.transfer_ms(ferried, link_gbps) if host else 0.0
                bnd = B.bound_ms(dev_step, ferried, link_gbps)
                row.update(copy_ms=round(copy_ms, 3), compute_ms=round(dev_step, 3) if dev_step else None,
                           bound_ms=round(bnd, 3), pct_bound=round(B.pct_of_bound(step_ms, bnd), 1))
                if not host:
                    kv_read = B.decode_kv_bytes(spec.num_layers * spec.token_bytes, depth, n, np_)
                    row["roofline_pct"] = round(B.roofline_pct(step_ms, eng.loaded.file_bytes, kv_read, mem_gbps), 1)
            row.update(ring_mib=round(cache.ring_bytes / MiB, 2) if host else 0,
                       declined=(cache.decline_reason or "") if host else "",
                       peak_dev_mib=round(stats[i]["peak"] / MiB, 1),
                       pinned_mib=round(_pinned_bytes(eng, cache) / MiB, 1),
                       same=(ref_tokens.get(i) == first_tokens) if kind == "tg" else None)
            out.append(row)
        return out


def _pinned_bytes(eng, cache) -> int:
    held = cache.spec.total_bytes if getattr(cache, "pinned", False) else 0
    return held + eng.runner.staged.buffer.pinned_bytes


def cmd_bench(a) -> int:
    from kvferry.engine.runner import resolve_device
    if a.link:
        return _cmd_link(a, resolve_device(a.device))
    bench = Bench(a)
    try:
        rows, meta = bench.run()
    finally:
        for c in bench.caches.values():
            c.close()
    print(format_rows(rows, a.output))
    sys.stdout.flush()
    if a.plot:
        plot_rows(rows, a.plot)
        log.info("wrote %s", a.plot)
    return 0


def _cmd_link(a, dev) -> int:
    from kvferry.transport.staging import StagedQueues
    sizes = _ints(a.link_mib or "1,4,16,64,256,1024,4096", "--link-mib", 1)
    staged = StagedQueues(dev, a.staging_cap << 20)
    try:
        bar = tqdm(total=len(sizes), desc="link", unit="size", disable=None)
        rows = link_sweep(dev, staged, sizes, progress=bar.update)
        bar.close()
        mem = probe_device_memory(dev)
    finally:
        staged.close()
    if a.output == "md":
        print(sweep_table(rows))
        print(f"\ndevice memory: {mem:.1f} GB/s (device-to-device copy, read + write)")
    else:
        print(json.dumps(dict(rows=rows, device_memory_gbps=round(mem, 1))))
    return 0
