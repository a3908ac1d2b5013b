"""The scheduler on a fake engine (no torch, no model): a long prompt is prefilled in -ub chunks
with the running decodes in between, running sequences decode in one call per step, a cancel
frees the slot at the next step, the wait queue is bounded, and stop strings cut the text."""

from types import SimpleNamespace

import pytest

from kvferry.config import SamplingConfig
from kvferry.server.scheduler import GenParams, QueueFull, Scheduler


class FakeTok:
    eog_ids = {0}

    def decode(self, ids, skip_special=True):
        return "".join(chr(96 + i) for i in ids)


class FakeEngine:
    """Logits are just the token to emit next: the running count of passes for that slot."""

    kv_token_bytes = 10

    def __init__(self, slots=2, ubatch=4, ctx=64, script=None):
        self.cfg = SimpleNamespace(num_seqs=slots, ubatch=ubatch, ctx_size=ctx)
        self.tokenizer = FakeTok()
        self.calls = []
        self.cache = SimpleNamespace(reset=lambda s: self.calls.append(("reset", s)))
        self.script = script or (lambda slot, pos: 1 + pos % 20)

    def prefill(self, slot, ids, start):
        self.calls.append(("prefill", slot, len(ids)))
        return self.script(slot, start + len(ids))

    def decode(self, slots, tokens, positions):
        self.calls.append(("decode", tuple(slots)))
        return [self.script(s, p + 1) for s, p in zip(slots, positions)]


def _sched(eng, queue=4):
    return Scheduler(eng, lambda cfg: (lambda logits: logits), queue)


def _params(n_prompt, max_tokens=8, stop=()):
    return GenParams(list(range(1, n_prompt + 1)), max_tokens, SamplingConfig(temperature=0), tuple(stop))


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    eng = FakeEngine(ubatch=4)
    s = _sched(eng)
    events = []
    s.submit(_params(2, max_tokens=20), events.append)
    s.step()  # short prompt: one chunk, then it decodes
    s.submit(_params(16), events.append)  # 4 chunks of 4
    for _ in range(4):
        s.step()
    kinds = [c[0] + (str(c[2]) if c[0] == "prefill" else str(len(c[1]))) for c in eng.calls if c[0] != "reset"]
    # each of the long prompt's chunks is followed by a decode of the running request
    assert kinds == ["prefill2", "decode1", "prefill4", "decode1", "prefill4", "decode1", "prefill4", "decode1",
                     "prefill4", "decode2"]


def test_decode_steps_are_timed_with_the_kv_bytes_they_attend():
    """/metrics' decode-step histogram and KV byte counter: one observation per batched step,
    the bytes of every decoding request's rows (prompt + tokens so far, the new one included)."""
    steps = []
    metrics = SimpleNamespace(decode_step=lambda sec, nbytes: steps.append((sec, nbytes)),
                              queue=lambda *a: None, prompt_tokens=lambda n: None, generated=lambda n: None,
                              first_token=lambda s: None, finished=lambda *a: None)
    ticks = iter(range(1000))
    s = Scheduler(FakeEngine(), lambda cfg: (lambda logits: logits), 4, metrics, clock=lambda: next(ticks))
    s.submit(_params(3, max_tokens=3), lambda e: None)
    s.submit(_params(2, max_tokens=3), lambda e: None)
    for _ in range(6):
        s.step()
    # step 1 prefills the 3-token prompt (its first token) and decodes it at row 3 (4 rows);
    # step 2 prefills the other and decodes both (5 + 3 rows; the first then has its 3 tokens);
    # step 3 decodes the second alone (4 rows) and ends it
    assert [b for _, b in steps] == [40, 80, 40]
    assert all(sec == 1 for sec, _ in steps), "one clock tick before the decode, one after sampling"

    class DeviceTimed(FakeEngine):  # an engine that times its decode passes itself (CUDA)
        def last_decode_seconds(self):
            return 0.25

    steps.clear()
    s = Scheduler(DeviceTimed(), lambda cfg: (lambda logits: logits), 4, metrics, clock=lambda: next(ticks))
    s.submit(_params(3, max_tokens=3), lambda e: None)
    for _ in range(3):
        s.step()
    assert steps and all(sec == 0.25 for sec, _ in steps)


def test_one_big_chunk_would_stall_the_decodes():
    # negative control: with -ub as large as the prompt, the whole prompt runs in one pass
    eng = FakeEngine(ubatch=64)
    s = _sched(eng)
    s.submit(_params(2, max_tokens=20), lambda e: None)
    s.step()
    s.submit(_params(16), lambda e: None)
    s.step()
    assert [c for c in eng.calls if c[0] == "prefill"][-1] == ("prefill", 1, 16)


def test_cancel_frees_the_slot_and_queue_is_bounded():
    s = _sched(FakeEngine(slots=1), queue=1)
    a = s.submit(_params(2, max_tokens=50), lambda e: None)
    s.step()
    s.submit(_params(2), lambda e: None)  # waits
    with pytest.raises(QueueFull):
        s.submit(_params(2), lambda e: None)
    assert s.num_busy == 1 and s.num_waiting == 1
    s.cancel(a)
    s.step()
    assert s.slots[0] is not a and s.slots[0] is not None and s.num_waiting == 0  # the waiter took it


def test_finish_reasons_and_stop_strings():
    eng = FakeEngine(script=lambda slot, pos: pos)  # emits tokens 2, 3, 4, ... -> "bcde..."
    s = _sched(eng)
    ev = []
    s.submit(_params(2, max_tokens=10, stop=["ef"]), ev.append)
    for _ in range(10):
        s.step()
    text = "".join(e.text for e in ev if e.kind == "text")
    assert text == "bcd" and ev[-1].finish_reason == "stop" and ev[-1].completion_tokens == 5
    ev.clear()
    s.submit(_params(2, max_tokens=3), ev.append)
    for _ in range(5):
        s.step()
    assert "".join(e.text for e in ev if e.kind == "text") == "bcd" and ev[-1].finish_reason == "length"

