"""Exactness gates on a GPU: the same checks as tests/test_transport_gates.py, on CUDA.

Greedy token ids and last-step logits must be bitwise equal across device-resident,
host ordered (-kvpd 0) and host pipelined (-kvpd 1, 4), pinned and pageable, for one
sequence and for 8 concurrent sequences with different prompts (unique nonces); the same
under random delays on the copy stream over >= 1000 decode steps; negative controls
(skip the ready wait, recycle slots early) must be caught.

  python benchmarks/gpu_gates.py [--device cuda] [--out DIR]
"""

import argparse
import json
import sys
import uuid

import torch

from kvferry.config import EngineConfig, KVConfig, SamplingConfig
from kvferry.engine.engine import Engine
from kvferry.transport.host_cache import HostKVCache

TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "rivers", "bees", "comets", "violins"]


def run(eng, prompts, n):
    ids, last = [[] for _ in prompts], {}
    for step in eng.generate_batch(prompts, n, SamplingConfig(temperature=0), stop_at_eog=False,
                                   on_logits=lambda j, lg: last.__setitem__(j, lg.clone())):
        for j, t in enumerate(step):
            if t is not None:
                ids[j].append(t)
    return ids, [last[j] for j in range(len(prompts))]


def same(a, b):
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--n1", type=int, default=96, help="tokens for the one-sequence gate")
    ap.add_argument("--n8", type=int, default=64, help="tokens per sequence for the 8-sequence gates")
    ap.add_argument("--random-weights", default=None, help="a preset (e.g. llama3-8b) instead of a model file")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=0, help="with --random-weights: random prompt length")
    ap.add_argument("--neg-delay-ms", type=float, default=1.0, help="upper copy delay for the negative controls")
    a = ap.parse_args()
    report = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu", "checks": []}

    def check(name, ok, **info):
        report["checks"].append(dict(name=name, ok=bool(ok), **info))
        print(f"{'PASS' if ok else 'FAIL'} {name} {info if info else ''}", flush=True)

    engines = {}

    def engine(np_, graphs=True, **kv):
        key = (np_, graphs, tuple(sorted(kv.items())))
        if key not in engines:
            cfg = EngineConfig(model=a.model, device=a.device, ctx_size=a.ctx, num_seqs=np_, cuda_graphs=graphs,
                               kv=KVConfig(chunk_rows=a.chunk, **kv))
            engines[key] = Engine(cfg, preset=a.random_weights, layers=a.layers, progress=False)
        return engines[key]

    placements = {"device": {}, "host-ordered": dict(offload=True, depth=0), "host-kvpd1": dict(offload=True, depth=1),
                  "host-kvpd4": dict(offload=True, depth=4), "host-pageable-kvpd1": dict(offload=True, depth=1, pinned=False, staging_on="decode"),
                  "host-pageable-thread-kvpd2": dict(offload=True, depth=2, pinned=False, staging_on="thread"),
                  "host-pageable-worker-kvpd2": dict(offload=True, depth=2, pinned=False, staging_on="worker")}
    for np_, n in ((1, a.n1), (8, a.n8)):
        base = engine(np_)
        if base.tokenizer is None:  # random weights: random prompts, a different one per sequence
            gen = torch.Generator().manual_seed(np_)
            prompts = [torch.randint(0, base.loaded.cfg.vocab_size, (a.prompt_len + 17 * j,), generator=gen).tolist()
                       for j in range(np_)]
        else:
            prompts = [base.tokenizer.encode(f"[task {uuid.uuid4().hex[:8]}] Write two sentences about {t}:")
                       for t in TOPICS[:np_]]
        ref = run(base, prompts, n)
        for name, kv in placements.items():
            got = run(engine(np_, **kv), prompts, n)
            check(f"np={np_} {name} == device-resident (ids + last logits bitwise)", same(got, ref),
                  mode=engine(np_, **kv).cache.stats().get("mode", "device"))
        if a.device.startswith("cuda"):  # decode through CUDA graphs (the default) against eager decode
            eager = run(engine(np_, graphs=False), prompts, n)
            diff = max(float((x - y).abs().max()) for x, y in zip(eager[1], ref[1]))
            check(f"np={np_} CUDA-graph decode == eager decode (ids + last logits bitwise)", same(eager, ref),
                  max_logit_diff=diff)
        if np_ == 8:
            check("8 different prompts give 8 different outputs", len({tuple(x) for x in ref[0]}) == 8
                  or base.tokenizer is None)
            steps = 0
            for depth in (1, 4):
                eng = engine(8, offload=True, depth=depth)
                for seed in range(2):
                    old = eng.cache
                    eng.cache = HostKVCache(eng.kv_spec, eng.cfg.kv, eng.device, eng.dtype, progress=False,
                                            _delay_s=(0.0, 2e-4), _seed=seed)
                    got = run(eng, prompts, n)
                    eng.cache.close()
                    eng.cache = old
                    check(f"kvpd {depth} with random copy delays (seed {seed})", same(got, ref))
                    steps += 8 * (n - 1)
            check(">= 1000 delayed decode steps in all", steps >= 1000, steps=steps)
            neg = a.neg_delay_ms * 1e-3
            # skip_ready gets longer delays: with large layers (an 8B shape) compute alone can
            # outlast a 1 ms copy delay, and a late copy must be likely for the control to bite
            for broken, delay, steps_n in (("_unsafe_skip_ready", (neg, 5 * neg), 24), ("_unsafe_early_recycle", (2e-4, neg), 24),
                                           ("_unsafe_skip_writeback_wait", {1: (10 * neg, 20 * neg)}, 6)):
                eng = engine(8, offload=True, depth=2)
                caught = False
                for seed in range(5):
                    old = eng.cache
                    eng.cache = HostKVCache(eng.kv_spec, eng.cfg.kv, eng.device, eng.dtype, progress=False,
                                            _delay_s=delay, _seed=seed, **{broken: True})
                    got = run(eng, prompts, steps_n)
                    eng.cache.close()
                    eng.cache = old
                    if not same(got, run(engine(8), prompts, steps_n)):
                        caught = True
                        break
                check(f"negative control {broken} is caught by the gate", caught)
    eng = engine(1, offload=True, depth=1, budget_mib=0.01)
    check("budget too small -> ordered fallback", eng.cache.depth == 0 and "budget" in (eng.cache.decline_reason or ""))
    if a.out:
        with open(f"{a.out}/gpu_gates.json", "w") as f:
            json.dump(report, f, indent=2)
    bad = [c for c in report["checks"] if not c["ok"]]
    print(f"{len(report['checks']) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
