"""Sampler behaviour on hand-built logits (the kept set of each filter is known in advance),
plus seeded generation through the engine."""

import math
from collections import Counter

import pytest
import torch

from kvferry import KvferryError
from kvferry.config import SamplingConfig
from kvferry.engine.sampling import Sampler

# probabilities 0.5, 0.3, 0.15, 0.04, 0.01, placed at shuffled ids
PROBS = {7: 0.5, 2: 0.3, 9: 0.15, 0: 0.04, 4: 0.01}
VOCAB = 10


def logits_of(probs=PROBS, vocab=VOCAB, offset=3.0):
    x = torch.full((vocab,), -math.inf)
    for i, p in probs.items():
        x[i] = math.log(p) + offset  # softmax ignores the offset
    return x


def cfg(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    base.update(kw)
    return SamplingConfig(**base)


def draws(c, logits, n):
    s = Sampler(c)
    return [s(logits) for _ in range(n)]


def test_same_seed_gives_the_same_draws():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for c in (cfg(seed=42), SamplingConfig(temperature=0.7, seed=42)):
        assert draws(c, logits, 200) == draws(c, logits, 200)


def test_different_seeds_give_different_draws_on_a_flat_distribution():
    flat = torch.zeros(1000)
    a, b = draws(cfg(seed=1), flat, 50), draws(cfg(seed=2), flat, 50)
    assert a != b
    assert len(set(a)) > 30  # and the draws are spread out, not stuck


def test_seed_minus_one_picks_a_fresh_seed_each_time():
    flat = torch.zeros(1000)
    s1, s2 = Sampler(cfg(seed=-1)), Sampler(cfg(seed=-1))
    assert s1.seed >= 0 and s2.seed >= 0
    assert [s1(flat) for _ in range(20)] != [s2(flat) for _ in range(20)]


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(3)
    s = Sampler(SamplingConfig(temperature=0, top_k=5, top_p=0.5, min_p=0.2, seed=0))
    for _ in range(50):
        x = torch.randn(5000, generator=g)
        assert s(x) == int(torch.argmax(x))
    assert s(logits_of()) == 7


def test_top_k_of_one_is_greedy():
    g = torch.Generator().manual_seed(4)
    s = Sampler(cfg(temperature=1.5, top_k=1, seed=9))
    for _ in range(50):
        x = torch.randn(5000, generator=g)
        assert s(x) == int(torch.argmax(x))


@pytest.mark.parametrize("kw, kept", [
    (dict(top_k=2), {7, 2}),
    (dict(top_p=0.75), {7, 2}),  # 0.5 + 0.3 reaches 0.75
    (dict(top_p=0.85), {7, 2, 9}),  # needs the third (0.95)
    (dict(top_p=0.97), {7, 2, 9, 0}),
    (dict(min_p=0.1), {7, 2, 9}),  # >= 0.05: drops 0.04 and 0.01
    (dict(min_p=0.5), {7, 2}),  # >= 0.25
    (dict(min_p=0.7), {7}),  # >= 0.35
    (dict(top_k=3, min_p=0.5), {7, 2}),
    (dict(top_p=0.97, min_p=0.1), {7, 2, 9}),
    (dict(), {7, 2, 9, 0, 4}),
])
def test_filters_keep_exactly_the_expected_tokens(kw, kept):
    seen = Counter(draws(cfg(seed=5, **kw), logits_of(), 3000))
    assert set(seen) == kept
    # among the kept tokens the draw follows the renormalized probabilities
    total = sum(PROBS[i] for i in kept)
    for i in kept:
        assert seen[i] / 3000 == pytest.approx(PROBS[i] / total, abs=0.03)


def test_temperature_reshapes_the_kept_distribution():
    # temperature 2 turns p into p**0.5 (renormalized); 0.5 turns it into p**2
    for t in (2.0, 0.5):
        seen = Counter(draws(cfg(temperature=t, seed=11), logits_of(), 4000))
        w = {i: p ** (1 / t) for i, p in PROBS.items()}
        for i in PROBS:
            assert seen[i] / 4000 == pytest.approx(w[i] / sum(w.values()), abs=0.03)


@pytest.mark.parametrize("temp", [1e-3, 1e-8, 1e-30, 1e-40, 1e-300, 5e-324])
def test_temperature_towards_zero_approaches_greedy(temp):
    g = torch.Generator().manual_seed(6)
    s = Sampler(cfg(temperature=temp, seed=1))
    for _ in range(20):
        x = torch.randn(2000, generator=g) * 10
        assert s(x) == int(torch.argmax(x))
    # tied best logits share the draw; nothing else is ever drawn
    tied = torch.tensor([1.0, 5.0, 5.0, 0.0, 4.9])
    assert set(draws(cfg(temperature=temp, seed=2), tied, 200)) == {1, 2}


def test_logits_of_any_float_dtype_are_accepted():
    x = torch.randn(300, generator=torch.Generator().manual_seed(8))
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        assert Sampler(cfg(top_k=1))(x.to(dt)) == int(torch.argmax(x.to(dt)))
        assert 0 <= Sampler(cfg(seed=3))(x.to(dt)) < 300


@pytest.mark.parametrize("kw, flag", [
    (dict(temperature=-0.1), "--temp"),
    (dict(top_k=-1), "--top-k"),
    (dict(top_p=0.0), "--top-p"),
    (dict(top_p=1.5), "--top-p"),
    (dict(top_p=-0.2), "--top-p"),
    (dict(min_p=-0.1), "--min-p"),
    (dict(min_p=1.0), "--min-p"),
])
def test_out_of_range_settings_raise(kw, flag):
    with pytest.raises(KvferryError, match=flag):
        SamplingConfig(**kw)


@pytest.mark.parametrize("kw, flag", [
    (dict(temperature=math.nan), "--temp"),
    (dict(temperature=math.inf), "--temp"),
    (dict(top_p=math.nan), "--top-p"),
    (dict(min_p=math.nan), "--min-p"),
    (dict(seed=2**64), "--seed"),
])
def test_non_finite_settings_and_oversized_seeds_raise_before_sampling(kw, flag):
    # NaN compares false with everything, so these need a check besides the range tests
    with pytest.raises(KvferryError, match=flag):
        Sampler(SamplingConfig(**kw))


@pytest.fixture
def one_thread():
    # a short decode gains nothing from a second thread, and OpenMP threads spinning at a
    # barrier slow it down many times over when another process holds a core
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_seeded_generation_repeats(engine, one_thread):
    ids = engine.tokenizer.encode("The three most common colours of a cat are")
    c = SamplingConfig(temperature=0.8, seed=123)
    first = list(engine.generate(ids, 16, c))
    assert len(first) >= 1
    assert list(engine.generate(ids, 16, c)) == first
    # a hot, unfiltered distribution with other seeds goes elsewhere
    hot = [list(engine.generate(ids, 16, SamplingConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=s)))
           for s in (1, 2)]
    assert hot[0] != hot[1]
