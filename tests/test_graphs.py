"""CUDA graphs of decode passes replay the eager pass's launches, so they give its bits: the
whole-pass graph of a device-resident cache (engine/graphs.py, ResidentDecodeGraph) against
the same engine with graphs off, and against a pipelined host cache (segmented graphs).
CUDA only: graphs do not exist on CPU."""

import pytest
import torch

from kvferry.config import EngineConfig, KVConfig, SamplingConfig
from kvferry.engine.generation import Engine
from kvferry.engine.graphs import ResidentDecodeGraph
from kvferry.model.arch import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

# a random 4-layer model with GQA (2 kv heads of 4 query heads), head dim 64
SHAPE = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=64, intermediate_size=512, max_position=512, name="tiny (random)")
_engines = {}


def _engine(np_, kv=None):
    # chunks of 64 rows over a 256-row context: several chunks, most of them past the rows
    cfg = EngineConfig(device="cuda", dtype="bf16", ctx_size=256, num_seqs=np_, kv=KVConfig(**dict(kv or {},
                                                                                                chunk_rows=64)))
    if cfg not in _engines:
        eng = Engine(cfg, random_model=SHAPE, progress=False)
        for name in ("embed", "lm_head"):  # larger logits: clear greedy choices
            if name in eng.model.w:
                eng.model.w[name].mul_(20)
        _engines[cfg] = eng
    return _engines[cfg]


def _greedy(eng, n_predict, graphs, corrupt_at=None):
    """Greedy ids and every step's logits of num_seqs sequences (random prompts of 9 to 20
    tokens); `corrupt_at`: before that decode step, flip one exponent bit of every value of
    the first sequence's second V row in layer 3 (the negative control)."""
    eng.runner.set_options(flash_attn=True, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (9 + 5 * j,), generator=g).tolist() for j in range(eng.cfg.num_seqs)]
    logits, ids, step = [], [], [0]

    def grab(j, lg):
        logits.append(lg.clone())
    for out in eng.generate_batch(prompts, n_predict, SamplingConfig(temperature=0), stop_at_eog=False,
                                  on_logits=grab):
        ids.append(list(out))
        step[0] += 1
        if step[0] == corrupt_at:
            eng.cache.v[3][0, 1, :, 1::2] ^= 0x40  # an exponent bit of every bf16 value of the row
    return ids, torch.stack(logits)


@pytest.mark.parametrize("np_", [1, 3])
def test_the_whole_pass_graph_gives_the_eager_bits(np_):
    eng = _engine(np_)
    eager = _greedy(eng, 40, graphs=False)
    graphed = _greedy(eng, 40, graphs=True)
    assert any(isinstance(g, ResidentDecodeGraph) for g in eng.runner._graphs.values())
    assert graphed[0] == eager[0]
    assert torch.equal(graphed[1], eager[1])
    # negative control: an exponent bit flipped in every value of one old V row shows
    broken = _greedy(eng, 40, graphs=True, corrupt_at=5)
    assert not torch.equal(broken[1], eager[1])


def test_the_whole_pass_graph_matches_a_pipelined_host_cache():
    dev = _greedy(_engine(3), 24, graphs=True)
    host = _greedy(_engine(3, kv=dict(offload=True, depth=1)), 24, graphs=True)
    assert host[0] == dev[0] and torch.equal(host[1], dev[1])


def test_a_graph_is_captured_again_for_a_new_cache():
    eng = _engine(1)
    first = _greedy(eng, 8, graphs=True)
    old = eng.cache
    eng.cache = eng.make_cache(eng.cfg, progress=False)
    try:
        assert _greedy(eng, 8, graphs=True)[0] == first[0]
        graphs = [g for g in eng.runner._graphs.values() if isinstance(g, ResidentDecodeGraph)]
        assert graphs and all(g.cache_ref() is eng.cache for g in graphs)
        with pytest.raises(ValueError, match="another cache"):
            graphs[0].run([0], None, old)
    finally:
        eng.cache = old


def test_a_decode_pass_is_timed_from_when_the_device_reaches_it():
    """Engine.last_decode_seconds (the server's decode-step metric on a GPU): a pass issued
    behind other device work is timed without that work, which the host clock counts."""
    import time
    eng = _engine(1)
    eng.cache.reset(0)
    eng.prefill(0, list(range(1, 10)))
    eng.decode([0], [1], [9])  # captures the graph
    eng.decode([0], [1], [10])
    alone = eng.last_decode_seconds()
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):  # tens of ms of matmuls queued ahead of the next pass
        a = a @ a.T / 64
    t0 = time.perf_counter()
    eng.decode([0], [1], [11])
    timed = eng.last_decode_seconds()
    wall = time.perf_counter() - t0
    assert 0 < timed < wall / 4 and timed < 3 * alone, (alone, timed, wall)
