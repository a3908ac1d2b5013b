"""The server's Prometheus metrics, through prometheus-client, in a registry of its own.

Owns: the request gauges and token counters the scheduler updates (its `metrics` hooks), the
latency histograms, and a collector that reads the engine's transport counters at scrape time
(KV bytes ferried each way, whether the delivery ring declined, staging bytes pinned).
Must not: touch the engine from the scrape beyond reading its counters (the engine thread
owns it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
# decode steps: 1 ms to 12 s in steps of 1.25x, fine enough to tell a slow tail from a slow
# median (a 4k host-KV step of an 8B shape is about 10 ms; the latency buckets above jump from
# 10 to 25 ms)
_STEP_BUCKETS = tuple(round(0.001 * 1.25 ** i, 6) for i in range(43))


class Metrics:
    def __init__(self, slots: int):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("kvferry_requests_running", "requests holding a sequence slot", registry=r)
        self.waiting = Gauge("kvferry_requests_waiting", "requests waiting for a slot", registry=r)
        Gauge("kvferry_slots", "sequence slots (-np)", registry=r).set(slots)
        self.prompt = Counter("kvferry_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.gen = Counter("kvferry_generation_tokens", "tokens generated", registry=r)
        self.done = Counter("kvferry_requests_finished", "requests finished, by reason", ["reason"], registry=r)
        self.rejected = Counter("kvferry_requests_rejected", "requests refused before admission, by status",
                                ["status"], registry=r)
        self.ttft = Histogram("kvferry_time_to_first_token_seconds", "from admission to the queue to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.rate = Histogram("kvferry_request_tokens_per_second", "a request's decode rate after its first token",
                              buckets=_RATE_BUCKETS, registry=r)
        self.step = Histogram("kvferry_decode_step_seconds", "one batched decode step (every decoding request, "
                              "one token each, sampled)", buckets=_STEP_BUCKETS, registry=r)
        self.step_kv = Counter("kvferry_decode_kv_bytes", "KV bytes the decode steps attended (every decoding "
                               "request's rows, all layers): over the steps' seconds, the rate to set against the "
                               "link for a host KV cache", registry=r)
        self._engine = None
        r.register(_TransportCollector(self))

    def attach(self, engine) -> None:
        self._engine = engine

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- the scheduler's hooks (engine thread) -------------------------------------------------
    def queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def prompt_tokens(self, n: int) -> None:
        self.prompt.inc(n)

    def generated(self, n: int) -> None:
        self.gen.inc(n)

    def decode_step(self, seconds: float, kv_bytes: int) -> None:
        self.step.observe(seconds)
        self.step_kv.inc(kv_bytes)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, reason: str, num_generated: int, t_first: float | None, t_end: float) -> None:
        self.done.labels(reason).inc()
        if t_first is not None and num_generated > 1 and t_end > t_first:
            self.rate.observe((num_generated - 1) / (t_end - t_first))


class _TransportCollector:
    """The engine's transport counters, read when /metrics is scraped."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        eng = self.m._engine
        c = eng.transport_counters() if eng is not None else {}
        f = CounterMetricFamily("kvferry_kv_ferried_bytes", "KV bytes copied between host cache and device",
                                labels=["direction"])
        f.add_metric(["host_to_device"], c.get("kv_h2d_bytes", 0))
        f.add_metric(["device_to_host"], c.get("kv_d2h_bytes", 0))
        yield f
        yield GaugeMetricFamily("kvferry_kv_ring_declined", "1 when the pipelined ring declined (ordered path runs)",
                                value=c.get("ring_declined", 0))
        yield GaugeMetricFamily("kvferry_staging_pinned_bytes", "bytes held by the pinned staging buffer",
                                value=c.get("staging_pinned_bytes", 0))
        yield GaugeMetricFamily("kvferry_kv_host_bytes", "bytes of the KV cache in host memory",
                                value=c.get("kv_host_bytes", 0))
