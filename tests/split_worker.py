"""One rank of a split-mode gate run (tests/test_split.py starts it through kvferry.launch).

usage: split_worker.py OUT_DIR MODE RATIOS PARTS PROMPTS_JSON
  MODE tensor|layer, RATIOS "" or e.g. "2,1", PARTS a comma list of: placements, delays,
  controls, reference, fault, short (placements with half the tokens), residency (after
  placements: a different --kv-device-budget per rank). Every rank runs the same passes (they are collective); rank 0
  writes what it saw to OUT_DIR/result.pt. One process group serves every check.
usage: split_worker.py cli KVFERRY_ARGS...
  kvferry's CLI as a user runs it (under torchrun), with rank 1 failing after 3 tokens.
"""

import contextlib
import dataclasses
import json
import logging
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from kvferry.config import EngineConfig, KVConfig, SamplingConfig  # noqa: E402
from kvferry.engine.generation import Engine  # noqa: E402
from kvferry.transport.host_cache import HostKVCache  # noqa: E402
from kvferry.transport.residency import resident_bytes  # noqa: E402

CHUNK = 24
PLACEMENTS = {"device": {}, "host-ordered": dict(offload=True, depth=0),
              "host-kvpd1": dict(offload=True, depth=1), "host-kvpd4": dict(offload=True, depth=4)}
CONTROLS = {  # each breaks one ordering; the delays make the break show (as in test_transport_gates.py)
    "skip_ready": (dict(_unsafe_skip_ready=True), (1e-3, 4e-3), 24),
    "early_recycle": (dict(_unsafe_early_recycle=True), (1e-3, 4e-3), 24),
    # write-backs slower than under one process: in a layer split each rank idles while the
    # other computes, and its write-backs catch up there (10-20 ms missed in 3 of 3 seeds once
    # in CI, layer2, on a loaded 2-core machine)
    "skip_writeback_wait": (dict(_unsafe_skip_writeback_wait=True), {1: (0.04, 0.08)}, 6),
    "trust_prefetch": (dict(_unsafe_trust_prefetch=True), None, 6),
}


def main():
    out_dir, mode, ratios, parts, prompts_path = sys.argv[1:6]
    parts = parts.split(",")
    with open(prompts_path) as f:
        prompts = json.load(f)  # {"one": [ids], "eight": [[ids] x 8], "ref": [[ids] x 4]}
    split = dict(split_mode=mode, split_ratios=tuple(float(x) for x in ratios.split(",")) if ratios else ())
    first = None
    engines = {}

    def engine(kv, np_):
        nonlocal first
        cfg = EngineConfig(device="cpu", dtype="f32", ctx_size=160, num_seqs=np_,
                           kv=KVConfig(**dict(kv, chunk_rows=CHUNK)), **split)
        if cfg not in engines:
            engines[cfg] = Engine(cfg, progress=False, share_weights=first)
            first = first or engines[cfg]
        return engines[cfg]

    res = {}
    if "fault" in parts:
        eng = engine({}, 1)
        rank = eng.runner.dist.rank
        for i, _ in enumerate(eng.generate_batch([prompts["one"]], 1000, SamplingConfig(temperature=0), stop_at_eog=False)):
            if rank == 1 and i == 3:  # one rank fails mid-decode; its peers wait in a collective
                raise RuntimeError("injected fault in rank 1")
    n1, n8 = (16, 12) if "short" in parts else (32, 24)  # short: three processes on two cores
    if "placements" in parts:
        for name, kv in PLACEMENTS.items():
            res[("one", name)] = run(engine(kv, 1), [prompts["one"]], n1)
            res[("eight", name)] = run(engine(kv, 8), prompts["eight"], n8)
    if "residency" in parts:
        res.update(residency(engine(dict(offload=True, depth=1), 8), prompts["eight"], n8))
        res.update(ring_vote(engine(dict(offload=True, depth=1), 8), prompts["eight"], n8))
    if "delays" in parts:
        res[("delays", "device")] = run(engine({}, 8), prompts["eight"], 64)
        for depth in (1, 4):
            eng = engine(dict(offload=True, depth=depth), 8)
            res[("delays", f"kvpd{depth}")] = with_cache(eng, lambda: run(eng, prompts["eight"], 64),
                                                         _delay_s=(0.0, 3e-4), _seed=depth)
    if "controls" in parts:
        eng = engine(dict(offload=True, depth=2), 8)
        for name, (broken, delay, n) in CONTROLS.items():
            ref = run(engine({}, 8), prompts["eight"], n)
            caught = clean = None
            for seed in range(3):
                got = with_cache(eng, lambda: run(eng, prompts["eight"], n), _delay_s=delay, _seed=seed, **broken)
                if not eng.runner.dist.agree(same(got, ref)):  # every rank leaves the loop together
                    caught = seed
                    # the same delays and seed without the break: the break made the difference
                    clean = same(with_cache(eng, lambda: run(eng, prompts["eight"], n), _delay_s=delay, _seed=seed),
                                 ref)
                    break
            res[("control", name)] = dict(caught=caught, clean=clean)
    if "reference" in parts:
        res[("reference", "device")] = run(engine({}, 4), prompts["ref"], 32, first_logits=True)
        res[("reference", "host-kvpd1")] = run(engine(dict(offload=True, depth=1), 4), prompts["ref"], 32,
                                               first_logits=True)
    eng = first
    spec = eng.kv_spec
    res["ranks"] = eng.runner.dist.gather(dict(kv_heads=spec.num_kv_heads, layers=spec.num_layers,
                                               shard=eng.loaded.shard, weights=sorted(eng.loaded.weights)[:3]))
    if eng.runner.dist.rank == 0:
        torch.save(res, os.path.join(out_dir, "result.pt"))
    eng.runner.dist.close()


def run(eng, prompts, n, first_logits=False):
    """Greedy ids per sequence, each sequence's last logits (or its prompt's last-position
    logits), and a per-step checksum of every logits row."""
    ids = [[] for _ in prompts]
    keep, sums = {}, []

    def grab(j, logits):
        if not first_logits or j not in keep:
            keep[j] = logits.clone()
        sums.append(float(logits.double().sum()))
    for step in eng.generate_batch(prompts, n, SamplingConfig(temperature=0), stop_at_eog=False, on_logits=grab):
        for j, t in enumerate(step):
            if t is not None:
                ids[j].append(t)
    return ids, [keep[j] for j in range(len(prompts))], sums


@contextlib.contextmanager
def transport(eng, **changes):
    """The engine's cache on its own KV config with `changes`, back to that config after
    (the engine is shared); yields the host cache's log lines that name another rank."""
    notes = []
    grab = logging.Handler()
    grab.emit = lambda r: notes.append(r.getMessage())
    logger = logging.getLogger("kvferry.transport.host_cache")
    logger.addHandler(grab)
    try:
        eng.cache.set_transport(dataclasses.replace(eng.cfg.kv, **changes))
        yield notes
    finally:
        logger.removeHandler(grab)
        eng.cache.set_transport(eng.cfg.kv)
        notes[:] = [m for m in notes if "another rank" in m]


def residency(eng, prompts, n):
    """Each rank's budget holds rank + 1 chunks per layer of its own share; the ranks keep
    the fewest (one) and say why once where they could hold more. The run, against the
    same split's device-resident one (the placements part's)."""
    dist = eng.runner.dist
    with transport(eng, device_budget_mib=resident_bytes(eng.kv_spec, dist.rank + 1) / (1 << 20)) as notes:
        chunks = eng.cache.resident_chunks
        before = dict(eng.cache.totals)
        got = run(eng, prompts, n)
        moved = {k: eng.cache.totals[k] - before[k] for k in ("early", "resident")}
    ranks = dist.gather(dict(own=dist.rank + 1, chunks=chunks, moved=moved, notes=notes))
    return {("residency", "eight"): got, ("residency", "ranks"): ranks}


def ring_vote(eng, prompts, n):
    """-kvpd 4 with a ring budget of rank + 3 slots: alone, rank 0 would run look-ahead 1 and
    rank 1 look-ahead 2; together both run 1, and rank 1 says why."""
    dist = eng.runner.dist
    with transport(eng, depth=4, budget_mib=(dist.rank + 3) * eng.cache.slot_bytes / (1 << 20)) as notes:
        depth = eng.cache.depth
        got = run(eng, prompts, n)
    ranks = dist.gather(dict(depth=depth, notes=notes))
    return {("ring", "eight"): got, ("ring", "ranks"): ranks}


def same(a, b):
    return a[0] == b[0] and a[2] == b[2] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def with_cache(eng, fn, **kw):
    """Run fn with the engine's cache swapped for a host cache with test hooks."""
    old = eng.cache
    eng.cache = HostKVCache(eng.kv_spec, eng.cfg.kv, eng.device, eng.dtype, progress=False,
                            agree=eng.runner.agree, **kw)
    try:
        return fn()
    finally:
        eng.cache.close()
        eng.cache = old


def cli_with_fault(argv):
    from kvferry.cli import main as cli
    from kvferry.launch import rank_env
    plain = Engine.generate

    def generate(self, *a, **kw):
        for i, t in enumerate(plain(self, *a, **kw)):
            if rank_env()[0] == 1 and i == 3:
                raise RuntimeError("injected fault in rank 1")
            yield t
    Engine.generate = generate
    return cli(argv)


if __name__ == "__main__":
    if sys.argv[1] == "cli":
        sys.exit(cli_with_fault(sys.argv[2:]))
    try:
        main()
    except Exception as e:  # one line, as kvferry's CLI says it (the launcher reads it)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
