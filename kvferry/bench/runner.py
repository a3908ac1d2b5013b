"""`kvferry bench`'s measurements, llama-bench-style, each set against the link bound
measured in the same run (command.py owns the flags and checks them before this loads a model).

Tests: ppP (prefill P tokens) and tgN (decode N tokens) at each depth D (rows already in
the cache). Engine flags given as comma lists are swept; arms run A/B/A/B with the order
reversed between passes, so drift does not favour one arm. The device-resident arm's step
time and the link bandwidth of the same run give each row's bound; every arm's greedy
tokens are compared with the first arm's (the `same` column), so the benchmark is also
an exactness check on whatever machine it runs.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from tqdm import tqdm

from kvferry.bench import bound as B
from kvferry.bench.command import BenchPlan, make_plan
from kvferry.bench.link import probe_device_memory, probe_link
from kvferry.bench.ops import log_table, op_table

log = logging.getLogger(__name__)
MiB = 1 << 20


class Bench:
    def __init__(self, a, plan: BenchPlan | None = None):
        from kvferry.engine.generation import Engine
        plan = plan or make_plan(a)
        self.a = a
        self.pp, self.tg, self.depths, self.arms = plan.pp, plan.tg, plan.depths, plan.arms
        self.base, self.cfgs = plan.base, plan.cfgs
        self.eng = Engine(self.base, random_model=plan.random_model, with_cache=False)
        self.fill = a.depth_fill if a.depth_fill != "auto" else ("random" if self.eng.tokenizer is None else "prefill")
        self.caches = {}

    def close(self):
        for c in self.caches.values():
            c.close()
        self.eng.runner.close()

    # -- caches ---------------------------------------------------------------------------
    def cache_for(self, cfg):
        """One cache per placement/type/chunk, shared by arms that differ only in transport."""
        key = (cfg.kv.offload, cfg.kv.pinned, cfg.kv.kv_type, cfg.kv.chunk_rows)
        c = self.caches.get(key)
        if c is None:
            c = self.eng.make_cache(cfg)
            self.caches[key] = c
        elif cfg.kv.offload and (c.kv.depth, c.kv.budget_mib, c.kv.device_budget_mib) != (
                cfg.kv.depth, cfg.kv.budget_mib, cfg.kv.device_budget_mib):
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
        toks, host_s = None, 0.0
        if kind == "pp":
            for s in seqs:
                eng.prefill(s, torch.randint(0, vocab, (n,), generator=g).tolist(), start=depth)
        else:
            toks = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
            out = []
            for i in range(n):
                t1 = time.perf_counter()
                logits = eng.decode(seqs, toks, [depth + i] * len(seqs))
                host_s += time.perf_counter() - t1  # enqueueing the step (the sync comes next)
                toks = eng.runner.agree_tokens(logits.argmax(-1).tolist())
                out.append(toks)
            toks = out
        self._sync()
        return (time.perf_counter() - t0) * 1e3, toks, host_s * 1e3

    # -- the sweep --------------------------------------------------------------------------------
    def run(self) -> tuple[list[dict], dict]:
        eng, a = self.eng, self.a
        dev = eng.device
        tests = [("pp", n) for n in self.pp] + [("tg", n) for n in self.tg]
        for cfg in self.cfgs:
            self.cache_for(cfg)
        pageable = any(not c.kv.pinned for c in self.cfgs if c.kv.offload)
        link = probe_link(dev, a.link_mib[0], staged=eng.runner.staged if pageable else None)
        mem_gbps = probe_device_memory(dev)
        link_gbps = link["h2d_pinned"]
        for c in self.caches.values():
            if hasattr(c, "link_gbps"):  # a host cache: its --kv-debug line gives the step's bound
                c.link_gbps = link_gbps
        log.info("link %.1f GB/s host to device (pinned), device memory %.0f GB/s", link_gbps, mem_gbps)
        rows = []
        total = len(self.depths) * len(tests) * len(self.arms) * (a.repetitions + 1)
        bar = tqdm(total=total, desc="bench", unit="run", disable=None)
        for depth in self.depths:
            self.fill_depth(depth)
            for kind, n in tests:
                times = {i: [] for i in range(len(self.arms))}
                host = {}  # per arm: ms the host spends enqueueing a test (tg), mean over repetitions
                stats = {}
                ref_tokens = {}
                for rep in range(a.repetitions + 1):  # rep 0 warms up
                    order = list(range(len(self.arms)))
                    if rep % 2 == 0:
                        order.reverse()
                    for i in order:
                        cache = self._use_arm(i)
                        if dev.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(dev)
                        before = dict(getattr(cache, "totals", {}))
                        ms, toks, host_ms = self.run_test(kind, n if rep else min(n, 4), depth)
                        bar.update()
                        if rep == 0:
                            continue
                        times[i].append(ms)
                        host[i] = host.get(i, 0.0) + host_ms / a.repetitions
                        if rep == 1:
                            ref_tokens[i] = toks
                            after = getattr(cache, "totals", {})
                            stats[i] = dict(early=after.get("early", 0) - before.get("early", 0),
                                            read=sum(after.get(k, 0) - before.get(k, 0)
                                                     for k in ("early", "late", "resident")),
                                            resident=after.get("resident", 0) - before.get("resident", 0),
                                            peak=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0)
                if a.profile and kind == "tg":  # untimed: which kernels each arm's step spends its time in
                    for i in range(len(self.arms)):
                        self._use_arm(i)
                        steps = min(n, 8)
                        ops, idle = op_table(lambda s=steps: self.run_test(kind, s, depth), steps, dev)
                        stats[i].update(ops=ops, idle=idle)
                        log_table(f"{kind}{n} @ d{depth}, arm {i + 1} ({_arm_label(self.arms[i])})", ops, idle)
                rows += self._rows(kind, n, depth, times, stats, ref_tokens, link_gbps, mem_gbps, host)
        bar.close()
        return rows, dict(link=link, mem_gbps=mem_gbps)

    def _use_arm(self, i: int):
        """Point the engine at arm i's cache and options; returns the cache."""
        eng, cfg = self.eng, self.cfgs[i]
        eng.cache = self.cache_for(cfg)
        eng.cfg = cfg
        eng.runner.set_options(cfg.flash_attn, cfg.cuda_graphs)
        return eng.cache

    def _rows(self, kind, n, depth, times, stats, ref_tokens, link_gbps, mem_gbps, host_ms):
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
            dist = eng.runner.dist
            # a split run: every rank ferries its own share over its own link; the slowest sets the pace
            ranks = dist.gather((ferried, link_gbps)) if dist is not None else [(ferried, link_gbps)]
            slowest = max(ranks, key=lambda r: B.transfer_ms(r[0], r[1]))
            row = dict(model=mc.name, size_gib=round(eng.loaded.file_bytes / 2**30, 2),
                       params_b=round(mc.num_params / 1e9, 2), backend=eng.device.type.upper(),
                       **arm, np=np_, test=f"{kind}{n}", depth=depth,
                       tps=round(statistics.mean(tps), 2), tps_std=round(statistics.pstdev(tps), 2),
                       step_ms=round(step_ms, 3), ferried_mib=round(ferried / MiB, 2),
                       link_gbps=round(link_gbps, 2))
            if dist is not None:
                row.update(sm=dist.mode, ranks=dist.world_size,
                           ferried_mib_ranks="/".join(f"{b / MiB:.2f}" for b, _ in ranks),
                           link_gbps_ranks="/".join(f"{g:.1f}" for _, g in ranks))
            if kind == "tg":
                copy_ms = B.transfer_ms(slowest[0], slowest[1]) if host else 0.0
                bnd = B.bound_ms(dev_step, slowest[0], slowest[1])
                row.update(copy_ms=round(copy_ms, 3), compute_ms=round(dev_step, 3) if dev_step else None,
                           bound_ms=round(bnd, 3), pct_bound=round(B.pct_of_bound(step_ms, bnd), 1))
                if self.a.profile:  # host-bound where host_ms is close to the step
                    row.update(host_ms=round(host_ms[i] / per, 3), wait_ms=round(step_ms - host_ms[i] / per, 3),
                               top_ops=stats[i].get("ops", []))
                    if stats[i].get("idle") is not None:  # CUDA: the step's time with no kernel running
                        row["idle_ms"] = stats[i]["idle"]
                # bytes the device reads per step: the weights and the KV codes of every layer
                # (the decode kernel reads them as stored, so a quantized type reads fewer), from
                # the cache itself or from the ring; a host arm's share shows how far the link
                # keeps it from the device's own bound
                kv_read = B.decode_kv_bytes(spec.num_layers * spec.token_bytes, depth, n, np_)
                row["roofline_pct"] = round(B.roofline_pct(step_ms, eng.loaded.file_bytes, kv_read, mem_gbps), 1)
            # partial residency (--kv-device-budget): the share of the KV that attention read in
            # place on the device; only the rest was ferried (ferried_mib), and the bound uses that
            row.update(resident_pct=round(100 * stats[i]["resident"] / stats[i]["read"], 1)
                       if host and stats[i]["read"] else (100.0 if not host else 0.0),
                       resident_mib=round(cache.resident.nbytes / MiB, 2) if host and cache.resident is not None else 0)
            row.update(ring_mib=round(cache.ring_bytes / MiB, 2) if host else 0,
                       declined=(cache.decline_reason or "") if host else "",
                       peak_dev_mib=round(stats[i]["peak"] / MiB, 1),
                       pinned_mib=round(_pinned_bytes(eng, cache) / MiB, 1),
                       same=(ref_tokens.get(i) == first_tokens) if kind == "tg" else None)
            if host and str(cache.depth) != row["kvpd"]:  # the ring ran a shallower look-ahead (ring_plan)
                row["kvpd"] = f"{row['kvpd']} (ran {cache.depth})"
            out.append(row)
        return out


def _pinned_bytes(eng, cache) -> int:
    held = cache.spec.total_bytes if getattr(cache, "pinned", False) else 0
    return held + eng.runner.staged.buffer.pinned_bytes


def _arm_label(arm: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in arm.items() if v != "-")
