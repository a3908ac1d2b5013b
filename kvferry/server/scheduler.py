"""Continuous batching: requests in the engine's `-np` sequence slots, one step at a time.

Owns the wait queue (bounded: `submit` raises QueueFull beyond it), the slots, and the loop
one engine thread runs: admit waiting requests into free slots, prefill one chunk of at most
`-ub` prompt tokens of the oldest request still in prefill, then decode every other running
request together in one `engine.decode(...)` call. So a long prompt delays the running decodes
by one chunk per step, not by its whole length, and a finished or cancelled request frees its
slot in the step that ends it. Per request: its sampler, its text stream (stop strings are
matched on the text, which is held back while it may still become one) and its finish reason.

Must not import torch or know HTTP: the engine and the sampler factory are handed in (the
tests drive this with a fake engine), and events go to each request's `sink` callable, called
on the engine thread.

Prefill passes are the ones `kvferry run` makes (the same chunks of -ub tokens from position
0), so greedy output equals run's; decode passes batch whoever is running, which on CPU changes
the last bits of the logits (matrix kernels block rows by batch size) but not greedy tokens in
practice (the server tests compare tokens, not logits).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvferry.config import SamplingConfig
from kvferry.engine.textstream import TextStream

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the wait queue holds --queue requests."""


class NotAccepting(Exception):
    """The server is shutting down."""


@dataclass(frozen=True)
class GenParams:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Event:
    """What a request's sink receives: text as it is released, then one `done` or `error`."""
    kind: str  # "text", "done" or "error"
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # done: stop, length or cancelled
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class Job:
    id: int
    params: GenParams
    sink: Callable[[Event], None]
    t_submit: float
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    pos: int = 0  # position the next decode writes
    last: int | None = None  # token to feed the next decode
    num_generated: int = 0
    sampler: Callable | None = None
    stream: TextStream | None = None
    text: str = ""
    sent: int = 0  # characters of `text` released
    cancelled: bool = False
    t_first: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.params.prompt_ids)


class _NoMetrics:
    def __getattr__(self, name):
        return lambda *a, **k: None


class Scheduler:
    """`engine`: has cfg (num_seqs, ubatch, ctx_size), tokenizer (or None), cache.reset(seq),
    prefill(seq, ids, start) -> logits and decode(seqs, tokens, positions) -> logits rows.
    `make_sampler(SamplingConfig)` -> callable(logits_row) -> token id."""

    def __init__(self, engine, make_sampler, queue_limit: int, metrics=None, clock=time.perf_counter):
        self.engine, self.make_sampler, self.queue_limit = engine, make_sampler, queue_limit
        self.num_slots, self.ubatch = engine.cfg.num_seqs, engine.cfg.ubatch
        self.tokenizer = engine.tokenizer
        self.kv_token_bytes = getattr(engine, "kv_token_bytes", 0)  # one token's K and V, all layers
        self.metrics = metrics or _NoMetrics()
        self.clock = clock
        self.slots: list[Job | None] = [None] * self.num_slots
        self.running: list[Job] = []  # in admission order: the oldest prefill goes first
        self.waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self.accepting = True
        self._stop = False
        self._deadline: float | None = None  # draining: running requests are cancelled after it

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, params: GenParams, sink: Callable[[Event], None]) -> Job:
        with self._cv:
            if not self.accepting:
                raise NotAccepting("the server is shutting down")
            free = self.slots.count(None)
            if len(self.waiting) >= free + self.queue_limit:
                raise QueueFull(f"all {self.num_slots} slots are busy and {len(self.waiting)} requests are "
                                f"waiting (--queue {self.queue_limit}): retry later")
            job = Job(next(self._ids), params, sink, self.clock())
            self.waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: the slot is freed at the next step."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def drain(self, grace_s: float) -> None:
        """Stop admitting: waiting requests fail now, running ones may finish within grace_s."""
        with self._cv:
            self.accepting = False
            self._deadline = self.clock() + grace_s
            waiting, self.waiting = list(self.waiting), collections.deque()
            self._cv.notify()
        for job in waiting:
            job.sink(Event("error", text="the server is shutting down"))

    def stop(self) -> None:
        with self._cv:
            self.accepting = False
            self._stop = True
            self._deadline = self.clock()
            self._cv.notify()

    @property
    def num_busy(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the engine thread --------------------------------------------------------------------
    def run(self) -> None:
        """The engine thread's loop, until stop() (running requests are cancelled then)."""
        while True:
            with self._cv:
                while not self.running and not self.waiting and not self._stop:
                    self._cv.wait()
                if self._stop and not self.running:
                    return
            self.step()

    def step(self) -> None:
        """One scheduling step: free cancelled slots, admit, one prefill chunk, one batched decode."""
        now = self.clock()
        for job in list(self.running):
            if job.cancelled:
                self._finish(job, "cancelled")
            elif self._deadline is not None and now >= self._deadline:
                self._fail(job, "the server shut down before this request finished")
        self._admit()
        pre = next((j for j in self.running if j.prefilling), None)
        if pre is not None:
            self._prefill_chunk(pre)
        dec = [j for j in self.running if not j.prefilling]
        if dec:
            self._decode(dec)

    def _admit(self) -> None:
        with self._cv:
            while self.waiting and None in self.slots:
                job = self.waiting.popleft()
                if job.cancelled:
                    continue
                job.slot = self.slots.index(None)
                self.slots[job.slot] = job
                self.running.append(job)
        self.metrics.queue(self.num_busy, self.num_waiting)

    def _prefill_chunk(self, job: Job) -> None:
        ids, p = job.params.prompt_ids, job.prefilled
        part = ids[p:p + self.ubatch]
        try:
            if p == 0:
                self.engine.cache.reset(job.slot)
                job.sampler = self.make_sampler(job.params.sampling)
                job.stream = TextStream(self.tokenizer) if self.tokenizer is not None else None
            logits = self.engine.prefill(job.slot, part, p)
        except Exception as e:  # one request's failure must not take the server down
            log.exception("prefill failed")
            self._fail(job, f"prefill failed: {e}")
            return
        job.prefilled += len(part)
        if not job.prefilling:
            self.metrics.prompt_tokens(len(ids))
            job.pos = len(ids)
            self._accept(job, job.sampler(logits))

    def _decode(self, jobs: list[Job]) -> None:
        t0 = self.clock()
        try:
            logits = self.engine.decode([j.slot for j in jobs], [j.last for j in jobs], [j.pos for j in jobs])
            tokens = [j.sampler(logits[r]) for r, j in enumerate(jobs)]  # the step ends when its tokens are known
        except Exception as e:
            log.exception("decode failed")
            for j in jobs:
                self._fail(j, f"decode failed: {e}")
            return
        dt = self.clock() - t0
        # on a GPU the engine times the pass on the device: the clock would also count a
        # prefill chunk issued just before it and still running there
        on_device = getattr(self.engine, "last_decode_seconds", lambda: None)()
        if on_device is not None:
            dt = on_device
        self.metrics.decode_step(dt, sum(j.pos + 1 for j in jobs) * self.kv_token_bytes)
        log.debug("decode step: %d sequences, %.2f ms", len(jobs), 1e3 * dt)
        for j, token in zip(jobs, tokens):
            j.pos += 1
            self._accept(j, token)

    # -- one new token -------------------------------------------------------------------------
    def _accept(self, job: Job, token: int) -> None:
        now = self.clock()
        if job.t_first is None:
            job.t_first = now
            self.metrics.first_token(now - job.t_submit)
        eog = self.tokenizer.eog_ids if self.tokenizer is not None and not job.params.ignore_eos else ()
        if token in eog:
            self._finish(job, "stop")
            return
        job.num_generated += 1
        job.last = token
        self.metrics.generated(1)
        delta = job.stream.push(token) if job.stream is not None else ""
        if self._release(job, delta, [token]):
            self._finish(job, "stop")
        elif job.num_generated >= job.params.max_tokens or job.pos + 1 > self.engine.cfg.ctx_size:
            self._finish(job, "length")

    def _release(self, job: Job, delta: str, token_ids: list[int], final: bool = False) -> bool:
        """Send the text that can no longer be part of a stop string; True if one was found."""
        job.text += delta
        stops, text = job.params.stop, job.text
        upto, hit = len(text), False
        if stops:
            found = [i for i in (text.find(s, job.sent) for s in stops) if i >= 0]
            if found:
                upto, hit = min(found), True
            elif not final:
                upto -= _held_back(text, stops)
        out = text[job.sent:upto]
        job.sent = max(job.sent, upto)
        if out or token_ids:
            job.sink(Event("text", text=out, token_ids=token_ids if job.stream is None else []))
        return hit

    def _finish(self, job: Job, reason: str) -> None:
        if reason != "cancelled" and job.stream is not None:
            if self._release(job, job.stream.flush(), [], final=True) and reason == "length":
                reason = "stop"
        self._free(job)
        n = len(job.params.prompt_ids)
        self.metrics.finished(reason, job.num_generated, job.t_first, self.clock())
        job.sink(Event("done", finish_reason=reason, prompt_tokens=n, completion_tokens=job.num_generated))

    def _fail(self, job: Job, message: str) -> None:
        self._free(job)
        self.metrics.finished("error", job.num_generated, job.t_first, self.clock())
        job.sink(Event("error", text=message))

    def _free(self, job: Job) -> None:
        with self._cv:
            if job in self.running:
                self.running.remove(job)
                self.slots[job.slot] = None
        self.metrics.queue(self.num_busy, self.num_waiting)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
