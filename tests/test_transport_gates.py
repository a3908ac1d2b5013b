"""Exactness gates: where the KV cache lives and how it travels must not change output bytes.

Device-resident, host ordered (-kvpd 0) and host pipelined (-kvpd 1, 4) must give the same
token ids and bitwise-equal last-step logits, for one sequence and for 8 concurrent
sequences with different prompts (each carrying a unique nonce). The same under random
delays on the copy path. On CUDA (`pytest --device cuda`, where the decode kernel reads the
codes) every KV type runs these three; the CPU oracle runs the float cache (and q8_0 for one
sequence). Negative controls (skip the `ready` wait, recycle a slot early, skip the write-back
wait, trust a wrong prefetch) show that the gate catches a broken ordering.
"""

import logging
import uuid

import pytest
import torch

import conftest
from conftest import make_engine
from kvferry.config import KVConfig, SamplingConfig
from kvferry.kv import quant
from kvferry.kv.cache import KVSpec
from kvferry.transport.host_cache import HostKVCache
from kvferry.transport.ring import ring_plan

CHUNK = 24  # small chunks: a 100-token context spans several chunks and slots
PLACEMENTS = {
    "device": {},
    "host-ordered": dict(offload=True, depth=0),
    "host-kvpd1": dict(offload=True, depth=1),
    "host-kvpd4": dict(offload=True, depth=4),
}
# every KV type where the decode kernel runs (CUDA); the CPU oracle keeps a float and a block type
KV_TYPES = list(quant.KV_TYPES) if conftest.DEVICE == "cuda" else ["auto", "q8_0"]
KV_TYPES_8SEQ = KV_TYPES if conftest.DEVICE == "cuda" else ["auto"]  # the 8-sequence runs: CI time on CPU
TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "rivers", "bees", "comets", "violins"]


def _prompts(eng, n):
    out = []
    for t in TOPICS[:n]:
        nonce = uuid.uuid4().hex[:8]
        out.append(eng.tokenizer.encode(f"[task {nonce}] Write two sentences about {t}:"))
    return out


def _run(eng, prompts, n_predict):
    """Greedy ids per sequence and each sequence's last logits."""
    ids = [[] for _ in prompts]
    last = {}

    def grab(j, logits):
        last[j] = logits.clone()
    for step in eng.generate_batch(prompts, n_predict, SamplingConfig(temperature=0), stop_at_eog=False, on_logits=grab):
        for j, t in enumerate(step):
            if t is not None:
                ids[j].append(t)
    return ids, [last[j] for j in range(len(prompts))]


def _engine(kv, np_=1, kv_type="auto"):
    return make_engine(ctx_size=160, num_seqs=np_, kv=dict(kv, chunk_rows=CHUNK, kv_type=kv_type))


def _assert_same(results):
    ref_ids, ref_logits = results["device"]
    for name, (ids, logits) in results.items():
        assert ids == ref_ids, f"{name}: token ids differ from device-resident"
        for j, (a, b) in enumerate(zip(logits, ref_logits)):
            assert torch.equal(a, b), f"{name}: last logits of sequence {j} differ bitwise"


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_one_sequence_byte_identical_across_placements(kv_type):
    prompts = None
    results = {}
    for name, kv in PLACEMENTS.items():
        eng = _engine(kv, kv_type=kv_type)
        prompts = prompts or _prompts(eng, 1)
        results[name] = _run(eng, prompts, 48)
    _assert_same(results)


@pytest.mark.parametrize("kv_type", KV_TYPES_8SEQ)
def test_eight_sequences_byte_identical_across_placements(kv_type):
    prompts = None
    results = {}
    for name, kv in PLACEMENTS.items():
        eng = _engine(kv, np_=8, kv_type=kv_type)
        prompts = prompts or _prompts(eng, 8)
        results[name] = _run(eng, prompts, 40)
    _assert_same(results)
    assert len({tuple(x) for x in results["device"][0]}) == 8, "different prompts must give different outputs"


def _with_cache(eng, **kw):
    """Swap the engine's cache for a host cache with test hooks (delays, broken orderings)."""
    old = eng.cache
    kv = eng.cfg.kv
    eng.cache = HostKVCache(eng.kv_spec, kv, eng.device, eng.dtype, progress=False, **kw)
    return old


def _restore(eng, old):
    eng.cache.close()
    eng.cache = old


@pytest.mark.parametrize("kv_type", KV_TYPES_8SEQ)
def test_random_copy_delays_change_nothing_over_1000_decode_steps(kv_type):
    ref_eng = _engine({}, np_=8, kv_type=kv_type)
    prompts = _prompts(ref_eng, 8)
    ref = _run(ref_eng, prompts, 64)
    steps = 0
    for depth in (0, 1, 4):
        eng = _engine(dict(offload=True, depth=depth), np_=8, kv_type=kv_type)
        for seed in range(2):
            old = _with_cache(eng, _delay_s=(0.0, 3e-4), _seed=seed)
            try:
                got = _run(eng, prompts, 64)
            finally:
                _restore(eng, old)
            _assert_same({"device": ref, f"kvpd{depth}-delayed": got})
            steps += 8 * 63  # decode steps (one token of one sequence each)
    assert steps >= 1000


@pytest.mark.parametrize("broken,delay,n", [
    # copies slower than a layer's compute, so that reading before `ready` reads old bytes
    # (the prefetch at the end of a pass gives the first units a head start)
    (dict(_unsafe_skip_ready=True), (1e-3, 4e-3), 24),
    (dict(_unsafe_early_recycle=True), (1e-3, 4e-3), 24),
    # write-backs slowed down: a pass that does not wait for the previous pass's
    # write-backs reads rows that are not in host memory yet
    (dict(_unsafe_skip_writeback_wait=True), {1: (0.01, 0.02)}, 6),
    # the end of a pass prefetches the next pass's first units on a guess; using them for
    # a pass that was not guessed (the 8-way decode after the last prefill) reads rows
    # of the wrong sequence
    (dict(_unsafe_trust_prefetch=True), None, 6),
])
def test_gate_catches_a_broken_ordering(broken, delay, n):
    ref_eng = _engine({}, np_=8)
    prompts = _prompts(ref_eng, 8)
    ref = _run(ref_eng, prompts, n)
    eng = _engine(dict(offload=True, depth=2), np_=8)
    assert caught(eng, prompts, ref, n, delay, **broken), f"the gate did not catch {broken}"


def caught(eng, prompts, ref, n, delay, check=None, **broken) -> bool:
    """Whether a run of `eng` broken by `broken` (and delayed) differs from `ref` within four
    seeds; `check(eng)` runs on the broken cache first."""
    for seed in range(4):
        old = _with_cache(eng, _delay_s=delay, _seed=seed, **broken)
        try:
            if check:
                check(eng)
            got = _run(eng, prompts, n)
        finally:
            _restore(eng, old)
        try:
            _assert_same({"device": ref, "broken": got})
        except AssertionError:
            return True
    return False


def test_decode_passes_use_the_prefetched_units():
    eng = _engine(dict(offload=True, depth=2), np_=8)
    _run(eng, _prompts(eng, 8), 12)
    st = eng.cache.stats()
    # every decode pass after the first was guessed by the pass before; the prefills of
    # the other sequences were not
    assert st["prefetch_hits"] >= 10 and st["prefetch_misses"] >= 7, st


def test_slow_write_backs_change_nothing():
    """The same slow write-back lane as the negative control, with the wait in place."""
    ref_eng = _engine({}, np_=8)
    prompts = _prompts(ref_eng, 8)
    ref = _run(ref_eng, prompts, 6)
    eng = _engine(dict(offload=True, depth=2), np_=8)
    old = _with_cache(eng, _delay_s={1: (0.01, 0.02)})
    try:
        got = _run(eng, prompts, 6)
    finally:
        _restore(eng, old)
    _assert_same({"device": ref, "slow-write-backs": got})


@pytest.mark.parametrize("pinned", [True, False])
def test_graph_passes_write_back_once_per_pass(pinned):
    """A decode pass on CUDA graphs hands its rows over as static buffers, and the cache writes
    all layers' rows back in one job, once the last layer's exist. On CPU (no graphs) this
    marks every pass's rows static (held here, as a graph's outputs are), with slow write-backs:
    the output stays the device cache's, one write-back job per pass, pinned and pageable (the
    staging queue). Negative control: without the next pass's wait for that job, the gate
    catches the early reads."""
    ref_eng = _engine({}, np_=8)
    prompts = _prompts(ref_eng, 8)
    ref = _run(ref_eng, prompts, 6)
    eng = _engine(dict(offload=True, depth=2, pinned=pinned), np_=8)
    held, jobs, slow = [], [], {1: (0.01, 0.02)}

    def as_graph_passes(eng):
        cache = eng.cache
        write, submit = cache.write_codes, cache.writeback.submit

        def write_static(layer, kq, vq, static=False):
            held.append((kq, vq))
            write(layer, kq, vq, static=True)

        def count(pairs, *a, **k):
            jobs.append(len(pairs))
            submit(pairs, *a, **k)
        cache.write_codes, cache.writeback.submit = write_static, count

    old = _with_cache(eng, _delay_s=slow)
    assert eng.cache.pinned == pinned
    as_graph_passes(eng)
    try:
        got = _run(eng, prompts, 6)
        passes = eng.cache.steps
    finally:
        _restore(eng, old)
    assert len(jobs) == passes and all(n % eng.kv_spec.num_layers == 0 for n in jobs), (jobs, passes)
    _assert_same({"device": ref, "graph-write-backs": got})
    assert caught(eng, prompts, ref, 6, slow, check=as_graph_passes, _unsafe_skip_writeback_wait=True)


@pytest.mark.parametrize("broken", [{}, dict(_unsafe_skip_writeback_wait=True)])
def test_pageable_deliveries_behind_slow_write_backs(broken):
    """Pageable host KV: deliveries and write-backs on the staging queues (the compiled worker
    where it builds), write-backs slowed down: the output stays that of a device-resident cache
    (a delivery is held until its waits are marked: its gates, tests/test_staging.py).
    Negative control: without the write-back waits, the gate catches the reads of rows not yet
    written back."""
    ref_eng = _engine({}, np_=8)
    prompts = _prompts(ref_eng, 8)
    ref = _run(ref_eng, prompts, 6)
    eng = _engine(dict(offload=True, depth=2, pinned=False), np_=8)
    caught = False
    for seed in range(4 if broken else 1):
        old = _with_cache(eng, _delay_s={1: (0.01, 0.02)}, _seed=seed, **broken)
        assert not eng.cache.pinned
        try:
            got = _run(eng, prompts, 6)
        finally:
            _restore(eng, old)
        try:
            _assert_same({"device": ref, "pageable-slow-write-backs": got})
        except AssertionError:
            if not broken:
                raise
            caught = True
            break
    assert caught == bool(broken), f"the gate did not catch {broken} on the staging queues"


def test_budget_too_small_falls_back_to_ordered_with_identical_output(caplog):
    ref_eng = _engine({})
    prompts = _prompts(ref_eng, 1)
    ref = _run(ref_eng, prompts, 24)
    with caplog.at_level(logging.WARNING):
        eng = _engine(dict(offload=True, depth=1, budget_mib=0.01))
    assert eng.cache.depth == 0 and "budget" in eng.cache.decline_reason
    assert sum("declined" in r.message for r in caplog.records) == 1, "the reason is logged once"
    _assert_same({"device": ref, "fallback": _run(eng, prompts, 24)})


def test_pageable_host_cache_matches_pinned_and_device():
    prompts = None
    results = {}
    for name, kv in {"device": {}, "pinned": dict(offload=True, depth=1),
                     "pageable": dict(offload=True, depth=1, pinned=False),
                     "pageable-ordered": dict(offload=True, depth=0, pinned=False),
                     "pageable-kvpd4": dict(offload=True, depth=4, pinned=False)}.items():
        eng = _engine(kv)
        prompts = prompts or _prompts(eng, 1)
        results[name] = _run(eng, prompts, 32)
    _assert_same(results)


def _llama3_8b_spec(ctx, num_seqs=1, chunk_rows=8192):
    return KVSpec(num_layers=32, num_seqs=num_seqs, ctx=ctx, num_kv_heads=8, head_dim=128, kv_type="bf16",
                  chunk_rows=chunk_rows)


def test_ring_is_bounded_at_128k_on_llama3_8b_shape():
    kv = KVConfig(offload=True, depth=1, budget_mib=128)
    sizes = []
    for ctx in (4096, 32768, 131072):
        plan = ring_plan(_llama3_8b_spec(ctx), kv)
        assert plan.depth == 1 and plan.reason is None
        assert plan.ring_bytes <= kv.budget_mib * 2**20
        sizes.append(plan.ring_bytes)
    assert sizes[1] == sizes[2], "the ring must not grow with the context"


def test_auto_ring_budget_holds_a_server_batch_on_a_large_device_only():
    """-kvpb auto (the default) scales with the device: 16 sequences at 4k on an 8B shape
    (3 slots of 256 MiB) pipeline on an 80 GiB device and decline, saying why, on 8 GiB."""
    kv = KVConfig(offload=True, depth=1)
    assert kv.budget_mib == "auto"
    spec = _llama3_8b_spec(4096, num_seqs=16)
    big = ring_plan(spec, kv, free_bytes=70 << 30, total_bytes=80 << 30)
    assert big.depth == 1 and big.reason is None and big.ring_bytes == 768 << 20
    small = ring_plan(spec, kv, free_bytes=6 << 30, total_bytes=8 << 30)
    assert small.depth == 0 and "auto" in small.reason and "512 MiB" in small.reason
    assert ring_plan(spec, KVConfig(offload=True, depth=1, budget_mib=128), 70 << 30, 80 << 30).depth == 0


def test_ring_runs_the_deepest_look_ahead_that_fits():
    """The default -kvpd 2 on 16 sequences at 4k of an 8B shape: 4 slots of 256 MiB where the
    auto budget holds them (80 GiB device), look-ahead 1 with a note where it holds 3 slots
    (12 GiB: 768 MiB), ordered with the reason where it holds fewer (8 GiB)."""
    kv = KVConfig(offload=True)
    assert kv.depth == 2
    spec = _llama3_8b_spec(4096, num_seqs=16)
    big = ring_plan(spec, kv, free_bytes=70 << 30, total_bytes=80 << 30)
    assert (big.depth, big.num_slots, big.reason, big.note) == (2, 4, None, None)
    mid = ring_plan(spec, kv, free_bytes=10 << 30, total_bytes=12 << 30)
    assert (mid.depth, mid.num_slots, mid.reason) == (1, 3, None)
    assert "-kvpd 2: the ring needs 1024.0 MiB" in mid.note and "look-ahead 1 fits" in mid.note
    small = ring_plan(spec, kv, free_bytes=6 << 30, total_bytes=8 << 30)
    assert (small.depth, small.num_slots) == (0, 1) and "needs 768.0 MiB" in small.reason
    # free memory counts too: 768 MiB + 1 GiB of headroom fit in 1900 MiB, 1 GiB + 1 GiB do not
    tight = ring_plan(spec, KVConfig(offload=True, budget_mib=0), free_bytes=1900 << 20)
    assert tight.depth == 1 and "only 1900 MiB of device memory is free" in tight.note


def test_host_write_waits_for_deliveries_in_flight():
    eng = _engine(dict(offload=True, depth=1))
    prompts = _prompts(eng, 1)
    old = _with_cache(eng, _delay_s=(0.02, 0.03))
    try:
        cache = eng.cache
        eng.prefill(0, prompts[0])
        before = cache.host_k[0][0, :8].clone()
        # queue a delivery that reads rows 0..7 of layer 0, then overwrite those rows
        cache.begin(__import__("kvferry.kv.cache", fromlist=["Batch"]).Batch([0], [len(prompts[0])], [1]))
        slot = (cache._unit0) % cache.num_slots
        zeros = torch.zeros_like(cache.host_k[0][0, :8])
        cache.write_host_rows(0, 0, 0, zeros, zeros)  # must wait for the delivery first
        assert torch.equal(cache.slot_k[slot][0, :8].cpu(), before), "the delivery saw the later write"
        assert torch.equal(cache.host_k[0][0, :8], zeros)
        cache.fence()
        cache.batch = None
    finally:
        _restore(eng, old)
