"""--kv-cpu-share: CPU threads attend a share of the host-resident chunks beside the link.

Its output is not bitwise that of device attention (CPU arithmetic, another split of the
rows), so the gates are tolerances against device-resident decode, with share 0 bitwise
today's path. The model's decode runs through the split-KV kernel (Triton's interpreter on
CPU, forced on as tests/test_decode_attention.py does), which is where the CPU's partials
join the device's."""

import pytest
import torch

from kvferry import KvferryError
from kvferry.config import KVConfig
from kvferry.kv.cache import Batch
from kvferry.transport.host_attention import cpu_chunks
from triton_cpu import interpreter_fixture, load

CHUNK = 16  # a 100-token context spans several chunks

interpreter_while_these_tests_run = interpreter_fixture()
needs_kernel = pytest.mark.skipif((why := load("kvferry.model.decode_kernels")) is not None, reason=why or "")


_engines: dict = {}


def _engine(kv, num_seqs, kv_type="auto"):
    """A 2-layer model of SmolLM2's shape with random weights (the interpreted kernel is slow;
    tolerances against device-resident decode need no trained model), weights shared."""
    from kvferry.config import EngineConfig
    from kvferry.engine.generation import Engine
    cfg = EngineConfig(device="cpu", dtype="f32", ctx_size=128, num_seqs=num_seqs,
                       kv=KVConfig(**dict(kv, chunk_rows=CHUNK, kv_type=kv_type)))
    if cfg not in _engines:
        first = next(iter(_engines.values()), None)
        _engines[cfg] = Engine(cfg, preset="smollm2-135m", layers=2, progress=False, share_weights=first)
    return _engines[cfg]


def _decode_logits(kv, prompts, steps=3, kv_type="auto"):
    """Greedy decode through the kernel after a prefill of each prompt -> (ids, logits per step)."""
    eng = _engine(kv, len(prompts), kv_type)
    seqs = list(range(len(prompts)))
    toks = []
    for s, p in zip(seqs, prompts):
        eng.cache.reset(s)
        toks.append(int(eng.prefill(s, p).argmax()))
    pos = [len(p) for p in prompts]
    ids, logits = [list(toks)], []
    eng.model.decode_kernel = True
    try:
        for _ in range(steps):
            lg = eng.decode(seqs, toks, pos)
            logits.append(lg.clone())
            toks = lg.argmax(-1).tolist()
            ids.append(toks)
            pos = [p + 1 for p in pos]
    finally:
        eng.model.decode_kernel = False
    return ids, logits, eng


def _prompts(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 49152, (70 - 9 * i,), generator=g).tolist() for i in range(n)]


def test_cpu_chunks_takes_only_stable_chunks():
    # one sequence at row 40 (its new row in chunk 2 of 16 rows): chunks 0 and 1 are stable
    b = Batch([0], [40], [1])
    assert cpu_chunks(b, 0, 3, 16, 5) == 2
    assert cpu_chunks(b, 0, 3, 16, 1) == 1
    assert cpu_chunks(b, 1, 3, 16, 5) == 1  # after one resident chunk
    # a second, shorter sequence whose new row is in chunk 1: the run stops there
    b2 = Batch([0, 1], [40, 20], [1, 1])
    assert cpu_chunks(b2, 0, 3, 16, 5) == 1
    # a sequence whose new row is in chunk 0: none (the run from `first` stops at the first
    # chunk that is not stable for every sequence, though chunk 1 would be)
    b3 = Batch([0, 1], [40, 10], [1, 1])
    assert cpu_chunks(b3, 0, 3, 16, 5) == 0
    assert cpu_chunks(b3, 1, 3, 16, 5) == 1  # chunk 1: sequence 1 has no rows there


@needs_kernel
@pytest.mark.parametrize("np_", [1, 3])
def test_cpu_share_close_to_device_and_share_zero_bitwise(np_):  # noqa: C901
    prompts = _prompts(np_)
    dev_ids, dev_logits, _ = _decode_logits({}, prompts)
    zero_ids, zero_logits, _ = _decode_logits(dict(offload=True, depth=1), prompts)
    assert zero_ids == dev_ids
    assert all(torch.equal(a, b) for a, b in zip(zero_logits, dev_logits)), "share 0 must be bitwise the ferried path"
    ids, logits, eng = _decode_logits(dict(offload=True, depth=2, cpu_share=0.6), prompts)
    cpu_bytes = eng.cache.totals["cpu"]
    assert cpu_bytes > 0, "no chunk was attended on the CPU"
    for a, b in zip(logits, dev_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
    assert ids == dev_ids
    # negative control: drop the CPU's partials (empty) and the logits move well past the tolerance
    host = eng.cache.host_attn
    real = host.start

    def dropped(*a, **k):
        pend = real(*a, **k)
        pend.future.result()
        pend.buf[1].fill_(float("-inf"))
        pend.buf[0].zero_()
        return pend
    host.start = dropped
    try:
        _, bad, _ = _decode_logits(dict(offload=True, depth=2, cpu_share=0.6), prompts, steps=1)
    finally:
        host.start = real
    assert (bad[0] - dev_logits[0]).abs().max() > 1e-2


@needs_kernel
def test_cpu_share_with_resident_chunks_and_quantized_kv():
    prompts = _prompts(2)
    dev_ids, dev_logits, _ = _decode_logits({}, prompts, kv_type="q8_0")
    ids, logits, eng = _decode_logits(dict(offload=True, depth=1, cpu_share=1.0, device_budget_mib=0.06),
                                      prompts, kv_type="q8_0")
    assert eng.cache.resident_chunks >= 1 and eng.cache.totals["cpu"] > 0
    for a, b in zip(logits, dev_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    assert ids == dev_ids


@needs_kernel
def test_auto_share_measures_cpu_and_link():
    _, _, eng = _decode_logits(dict(offload=True, depth=1, cpu_share="auto"), _prompts(1), steps=1)
    share = eng.cache.cpu_share
    assert 0 < share < 1
    assert eng.cache.stats()["cpu_share"] == round(share, 3)


def test_worker_threads_leave_the_callers_thread_count():
    from kvferry.kv.cache import KVSpec
    from kvferry.transport.host_attention import HostAttention
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a caller's count unlike the worker's
    try:
        h = HostAttention(KVSpec(num_layers=1, num_seqs=1, ctx=32, num_kv_heads=1, head_dim=16, kv_type="f32",
                                 chunk_rows=16), [], [], torch.device("cpu"), threads=3)
        assert torch.get_num_threads() == 1
        # the worker runs its ops on the threads it was given, whatever the caller's count
        assert h.worker_threads() == 3
        h.close()
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("bad, msg", [
    (dict(cpu_share=0.5), "add -nkvo"),
    (dict(offload=True, cpu_share=1.5), "from 0 to 1"),
    (dict(offload=True, cpu_share="half"), "from 0 to 1"),
])
def test_bad_cpu_share_is_one_clear_error(bad, msg):
    with pytest.raises(KvferryError, match=msg):
        KVConfig(**bad)
