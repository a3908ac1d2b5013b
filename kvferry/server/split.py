"""A split run behind the server (`kvferry serve -sm tensor|layer`, under `--tp N` or torchrun):
rank 0 serves HTTP and runs the scheduler; every other rank replays rank 0's engine calls.

Owns the call protocol. A prefill chunk and a decode step run collectives inside the model
(the all-reduces of a tensor split, the hand-over between a layer split's ranks), so every
rank must make the same call with the same arguments in the same order. Before each such call,
and before a slot reset (it changes the cache the next calls read), rank 0 broadcasts
(op, args) through the process group's object broadcast; a follower makes the call and waits
for the next. ("stop",) ends the followers, sent when rank 0's engine closes.
Must not: know HTTP or the scheduler (rank 0's engine is wrapped as the scheduler sees it),
or sample (tokens come to the followers as the next call's arguments).
"""

from __future__ import annotations

import logging

from kvferry import KvferryError

log = logging.getLogger(__name__)


class Leader:
    """Rank 0's engine: each call is announced to the followers, then made here. Whatever
    the scheduler or the metrics read (cfg, tokenizer, counters) is this rank's."""

    def __init__(self, engine):
        self._engine = engine
        self._dist = engine.runner.dist
        self.cache = _Cache(self)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def prefill(self, seq_id, ids, start=0):
        self._dist.share(("prefill", (seq_id, list(ids), start)))
        return self._engine.prefill(seq_id, ids, start)

    def decode(self, seq_ids, tokens, positions):
        self._dist.share(("decode", (list(seq_ids), list(tokens), list(positions))))
        return self._engine.decode(seq_ids, tokens, positions)

    def reset(self, seq_id):
        self._dist.share(("reset", (seq_id,)))
        self._engine.cache.reset(seq_id)

    def close(self):
        try:
            self._dist.share(("stop", ()))
        finally:
            self._engine.close()


class _Cache:
    def __init__(self, leader: Leader):
        self._leader = leader

    def reset(self, seq_id):
        self._leader.reset(seq_id)


def follow(engine) -> None:
    """A follower's life after its engine loaded: make rank 0's calls until it says stop."""
    dist = engine.runner.dist
    calls = {"prefill": engine.prefill, "decode": engine.decode, "reset": engine.cache.reset}
    log.info("rank %d follows rank 0's engine calls", dist.rank)
    try:
        while True:
            op, args = dist.share(None)
            if op == "stop":
                return
            try:
                calls[op](*args)
            except KvferryError:  # a request's bad input: rank 0 meets the same check and fails the request
                log.debug("%s failed here as on rank 0", op, exc_info=True)
    finally:
        engine.close()
