"""Every KV placement and type behind the server's scheduler, on the real engine in-process:
ordered host KV (-nkvo -kvpd 0), pageable host KV (--no-kv-pinned) and each KV type
(-ctk f16, bf16, q8_0, q4_0, fp8). Per configuration, the scheduler serves a greedy request
beside two others (so its decodes are batched and its -ub chunks interleave with theirs), and
its text and its first logits must equal what `kvferry run` computes with the same flags
(Engine.generate, the loop cmd_run drives, on an engine with -np 1). test_server.py checks
device KV and pinned -nkvo -kvpd 1 through HTTP, and one of these configurations through the
real `kvferry serve` process."""

import functools

import pytest
import torch

from conftest import make_engine
from kvferry.config import SamplingConfig
from kvferry.engine.sampling import Sampler
from kvferry.engine.textstream import TextStream
from kvferry.server.scheduler import GenParams, Scheduler

PROMPTS = ["Write a haiku about rain.", "Describe a cat in one sentence.", "List three colours."]
N = 16
GREEDY = SamplingConfig(temperature=0)
SMALL = dict(ctx_size=128, ubatch=16)  # 16-token prefill chunks: the prompts take 2-3 each
CONFIGS = {
    "ordered": dict(offload=True, depth=0, chunk_rows=16),  # 16-row chunks: several per pass
    "pageable": dict(offload=True, pinned=False, chunk_rows=16),
    "f16": dict(kv_type="f16"),
    "bf16": dict(kv_type="bf16"),
    "q8_0": dict(kv_type="q8_0"),
    "q4_0": dict(kv_type="q4_0"),
    "fp8": dict(kv_type="fp8"),
}


def _ids(eng, text):
    tok = eng.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@functools.cache
def _f32_first():
    return _run(())[1]


def _run(kv):
    """What `kvferry run --chat --temp 0 -n N` prints (without its newline), and its first logits."""
    eng = make_engine(**SMALL, kv=dict(kv))
    first, stream, text = [], TextStream(eng.tokenizer), ""
    for step in eng.generate_batch([_ids(eng, PROMPTS[0])], N, GREEDY,
                                   on_logits=lambda j, row: first.append(row.clone()) if not first else None):
        text += stream.push(step[0])
    return text + stream.flush(), first[0]


def _serve(kv):
    """The first prompt's text through the scheduler, submitted together with the others, and
    the logits its first token was sampled from."""
    eng = make_engine(**SMALL, num_seqs=4, kv=kv)
    seen = []

    def make_sampler(cfg):
        sample = Sampler(cfg)

        def record(row):
            seen.append(row.clone())
            return sample(row)
        return record if not seen else sample

    sched = Scheduler(eng, make_sampler, queue_limit=4)
    events = [[] for _ in PROMPTS]
    for p, ev in zip(PROMPTS, events):
        sched.submit(GenParams(_ids(eng, p), N, GREEDY), ev.append)
    steps = 0
    while sched.running or sched.waiting:
        sched.step()
        steps += 1
    assert all(ev[-1].kind == "done" for ev in events), [ev[-1] for ev in events]
    assert steps < 2 * N, steps  # the others ran beside it, not one after another
    return "".join(e.text for e in events[0] if e.kind == "text"), seen[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scheduler_greedy_equals_run_for_each_placement_and_kv_type(name):
    kv = CONFIGS[name]
    want_text, want_first = _run(kv)
    text, first = _serve(kv)
    assert text == want_text
    # prefill passes are run's own passes: bitwise the same logits
    assert torch.equal(first, want_first)
    if "kv_type" in kv:
        # negative control: these logits tell the KV type apart from the compute dtype's
        assert not torch.equal(want_first, _f32_first())
