"""benchmarks/serve_load.py reads the decode-step histogram of /metrics back into a median and
a p90: checked against steps observed through the server's own Metrics (prometheus-client)."""

import importlib.util
import os

import pytest

from kvferry.server.metrics import Metrics

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "serve_load.py")
_spec = importlib.util.spec_from_file_location("serve_load", _PATH)
serve_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_load)


def _steps(seconds):
    m = Metrics(4)
    for s in seconds:
        m.decode_step(s, 1000)
    return serve_load.parse_counters(m.render().decode())


def test_the_median_and_p90_of_the_steps_come_back_within_a_bucket():
    steps, total_s, kv, buckets = _steps([0.0105] * 80 + [0.040] * 20)
    assert steps == 100 and kv == 100 * 1000 and total_s == pytest.approx(0.0105 * 80 + 0.8)
    p50, p90 = serve_load.bucket_ms(buckets, 0.5), serve_load.bucket_ms(buckets, 0.9)
    assert 10.5 / 1.25 <= p50 <= 10.5 * 1.25
    assert 40 / 1.25 <= p90 <= 40 * 1.25
    # negative control: the same median without the slow tail gives a p90 near the median
    _, _, _, flat = _steps([0.0105] * 100)
    assert serve_load.bucket_ms(flat, 0.9) < 10.5 * 1.25 < 40 / 1.25


def test_no_steps_give_no_quantile():
    assert serve_load.bucket_ms(_steps([])[3], 0.5) is None
