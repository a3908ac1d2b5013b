"""Partial residency (--kv-device-budget): the oldest chunks of every layer stay on the device,
only the rest is ferried, and output stays bitwise that of a device-resident cache.

The transport's gates (tests/test_transport_gates.py: budget 0) again at budgets of a third,
two thirds and all of the cache: 1 and 8 sequences at -kvpd 0/1/4 (one depth where all is
resident and the ring carries nothing), every run under random copy delays, over 1,000
delayed decode steps at each partial budget; a negative control that the gate still catches
at a third; a budget changed mid-decode. Then the budget -> resident chunks arithmetic,
`auto`, the fallbacks and bad values.
"""

import dataclasses
import logging

import pytest

from conftest import make_engine
from kvferry import KvferryError
from kvferry.config import KVConfig, SamplingConfig
from kvferry.kv.cache import KVSpec
from kvferry.transport.ring import HEADROOM_BYTES
from kvferry.transport.residency import fit_chunks, resident_bytes, resident_plan
from test_transport_gates import CHUNK, _assert_same, _prompts, _restore, _run, _with_cache, caught

MiB = 1 << 20
CTX = 3 * CHUNK  # 3 chunks per sequence; every run reaches into the last one
DEPTHS = (0, 1, 4)
N1, N8 = 40, 44  # tokens per sequence: 1 sequence, 8 sequences
DELAY = (0.0, 3e-4)  # every residency gate runs with random copy delays


def _engine(kv, np_=1):
    return make_engine(ctx_size=CTX, num_seqs=np_, kv=dict(kv, chunk_rows=CHUNK))


def _budget_mib(eng, share: float) -> float:
    """A share of the whole host cache, in MiB."""
    return eng.kv_spec.total_bytes * share / MiB


@pytest.fixture(scope="module")
def refs():
    """Per sequence count: the prompts and the device-resident run (shared by the budgets)."""
    out = {}
    for np_, n in ((1, N1), (8, N8)):
        eng = _engine({}, np_)
        prompts = _prompts(eng, np_)
        out[np_] = (prompts, _run(eng, prompts, n))
    return out


def _gate(refs, np_, share, expect_chunks):
    """Returns the number of decode steps run (one token of one sequence each)."""
    prompts, ref = refs[np_]
    n, steps = len(ref[0][0]), 0
    # with every chunk resident the ring has no unit to carry, so the depth changes nothing
    # that runs: one depth is the whole gate there (its assert below: nothing ferried)
    for depth in DEPTHS if expect_chunks < 3 else (1,):
        eng = _engine(dict(offload=True, depth=depth), np_)
        old = _with_cache(eng, _delay_s=DELAY, _seed=depth)
        try:
            eng.cache.set_transport(dataclasses.replace(eng.cfg.kv, device_budget_mib=_budget_mib(eng, share)))
            assert eng.cache.resident_chunks == expect_chunks
            got = _run(eng, prompts, n)
            ferried, resident = eng.cache.totals["early"], eng.cache.totals["resident"]
        finally:
            _restore(eng, old)
        _assert_same({"device": ref, f"kvpd{depth}-budget{share:.2f}": got})
        # the runs read every chunk: resident ones in place, the others through the ring
        assert (resident > 0) == (expect_chunks > 0) and (ferried > 0) == (expect_chunks < 3), (resident, ferried)
        steps += np_ * (n - 1)
    return steps


@pytest.mark.parametrize("share,chunks", [(1 / 3, 1), (2 / 3, 2), (1.0, 3)])
def test_one_sequence_byte_identical_at_every_budget(refs, share, chunks):
    _gate(refs, 1, share, chunks)


@pytest.mark.parametrize("share,chunks", [(1 / 3, 1), (2 / 3, 2), (1.0, 3)])
def test_eight_sequences_byte_identical_under_delays_at_every_budget(refs, share, chunks):
    steps = _gate(refs, 8, share, chunks)
    assert steps >= 1000 or chunks == 3, steps  # decode steps under random copy delays
    assert len({tuple(x) for x in refs[8][1][0]}) == 8, "different prompts must give different outputs"


def test_gate_catches_a_skipped_ready_wait_at_a_third(refs):
    """The negative control still bites with part of the cache resident: reading a slot before
    its delivery is complete reads another chunk's bytes."""
    prompts, ref = refs[8]
    eng = _engine(dict(offload=True, depth=2, device_budget_mib=_budget_mib(_engine({}, 8), 1 / 3)), 8)
    # copies slower than a layer's compute (one ferried chunk per layer here, not several)
    assert caught(eng, prompts, ref, N8, (4e-3, 1e-2), check=_one_resident, _unsafe_skip_ready=True), \
        "the gate did not catch reads before `ready` at a partial budget"


def _one_resident(eng):
    assert eng.cache.resident_chunks == 1



def test_new_budget_refills_the_resident_chunks_from_host_memory(refs):
    """set_transport (the bench's arms) changes the budget of a cache that holds rows: the
    resident chunks are refilled from host memory, so the decode goes on bit for bit."""
    prompts, ref = refs[8]
    eng = _engine(dict(offload=True, depth=1), 8)
    ids, last = [[] for _ in prompts], {}
    budgets = {15: 2 / 3, 30: 1 / 3}  # at decode step: share of the cache
    try:
        for step, toks in enumerate(eng.generate_batch(prompts, N8, SamplingConfig(temperature=0), stop_at_eog=False,
                                                        on_logits=lambda j, x: last.__setitem__(j, x.clone()))):
            for j, t in enumerate(toks):
                ids[j].append(t)
            if step in budgets:
                eng.cache.set_transport(dataclasses.replace(eng.cfg.kv, device_budget_mib=_budget_mib(eng, budgets[step])))
                assert eng.cache.resident_chunks == (2 if step == 15 else 1)
    finally:
        eng.cache.set_transport(eng.cfg.kv)  # the engine is shared: back to budget 0
    _assert_same({"device": ref, "budget-changed": (ids, [last[j] for j in range(8)])})


# ---------------------------------------------------------------------------- the arithmetic
SPEC = KVSpec(num_layers=32, num_seqs=2, ctx=20000, num_kv_heads=8, head_dim=128, kv_type="bf16", chunk_rows=8192)
CHUNK_BYTES = 32 * 2 * 8192 * 2 * 8 * 256  # layers x seqs x rows x (K + V) x heads x row bytes: 2 GiB
WHOLE = 32 * 2 * 20000 * 2 * 8 * 256  # 3 chunks, the last one 3,616 rows


def test_budget_to_resident_chunks():
    assert resident_bytes(SPEC, 1) == CHUNK_BYTES and resident_bytes(SPEC, 3) == WHOLE
    big = 1 << 50
    for budget, chunks in [(0, 0), (2047, 0), (2048, 1), (4095, 1), (4096, 2), (WHOLE / MiB - 1, 2),
                           (WHOLE / MiB, 3), (1e9, 3)]:
        plan = resident_plan(SPEC, budget, big, HEADROOM_BYTES)
        assert plan.num_chunks == chunks, (budget, plan)
        assert plan.nbytes == resident_bytes(SPEC, chunks) <= max(budget * MiB, 0) or chunks == 0
        assert plan.total_chunks == 3
    assert fit_chunks(SPEC, 3 * CHUNK_BYTES) == 3  # more than the cache: all of it, nothing more
    assert resident_plan(SPEC, 4096, big, HEADROOM_BYTES).share == pytest.approx(2 * 8192 / 20000)


def test_budgets_that_do_not_fit_fall_back_with_one_note():
    big = 1 << 50
    assert resident_plan(SPEC, 0, big, HEADROOM_BYTES).note is None
    assert resident_plan(SPEC, 4096, big, HEADROOM_BYTES).note is None
    small = resident_plan(SPEC, 100, big, HEADROOM_BYTES)
    assert small.num_chunks == 0 and "holds no chunk" in small.note and "2048.00 MiB" in small.note
    over = resident_plan(SPEC, 1e9, big, HEADROOM_BYTES)
    assert over.num_chunks == 3 and "more than the whole cache" in over.note
    # 5 GiB free, 1 GiB of it headroom: 4 GiB of room, two chunks, not the three asked for
    tight = resident_plan(SPEC, WHOLE / MiB, 5 << 30, HEADROOM_BYTES)
    assert tight.num_chunks == 2 and "does not fit" in tight.note and "4096 MiB" in tight.note
    none = resident_plan(SPEC, 4096, HEADROOM_BYTES, HEADROOM_BYTES)
    assert none.num_chunks == 0 and "does not fit" in none.note


def test_auto_takes_what_is_free_beyond_the_headroom():
    for free, chunks in [(0, 0), (HEADROOM_BYTES + CHUNK_BYTES - 1, 0), (HEADROOM_BYTES + CHUNK_BYTES, 1),
                         (HEADROOM_BYTES + WHOLE - 1, 2), (HEADROOM_BYTES + WHOLE, 3), (1 << 50, 3)]:
        plan = resident_plan(SPEC, "auto", free, HEADROOM_BYTES)
        assert plan.num_chunks == chunks, (free, plan)
        assert plan.level == logging.INFO and f"{chunks} of 3 chunks" in plan.note


def test_engine_logs_a_budget_that_holds_no_chunk_once(caplog):
    with caplog.at_level(logging.WARNING):
        eng = _engine(dict(offload=True, depth=1, device_budget_mib=0.01))
    assert eng.cache.resident_chunks == 0 and eng.cache.resident is None
    assert sum("holds no chunk" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("kw,msg", [(dict(offload=True, device_budget_mib=-1), "MiB >= 0 or auto"),
                                    (dict(offload=True, device_budget_mib="lots"), "MiB >= 0 or auto"),
                                    (dict(offload=True, device_budget_mib=float("nan")), "MiB >= 0 or auto"),
                                    (dict(device_budget_mib=100), "add -nkvo"),
                                    (dict(device_budget_mib="auto"), "add -nkvo")])
def test_bad_budgets_are_refused(kw, msg):
    with pytest.raises(KvferryError, match=msg):
        KVConfig(**kw)
    assert KVConfig(offload=True, device_budget_mib="auto").device_budget_mib == "auto"
