"""Split-mode gates (CPU, gloo, real processes): within one split configuration every KV
placement gives the same bits, also under copy delays, and the single-device negative
controls are caught; a split run matches one device within tolerance; a failing rank ends
the run with one error line.

Each configuration is one process group (tests/split_worker.py) that runs many checks; the
module runs each group once and the tests read its results.
"""

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from conftest import ROOT, make_engine
from kvferry.config import SamplingConfig

TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "rivers", "bees", "comets", "violins"]
RUNS = {  # name: (ranks, mode, ratios, parts)
    "tensor2": (2, "tensor", "", "placements,residency,delays,controls,reference"),
    "tensor3": (3, "tensor", "", "placements,short,reference"),  # three processes on CI's two cores
    "layer2": (2, "layer", "", "placements,residency,delays,controls,reference"),
}
DELAYED = ["tensor2", "layer2"]  # also a different --kv-device-budget per rank  # the copy-delay gate and the negative controls, one configuration per mode
_results = {}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    tok = make_engine(ctx_size=160, num_seqs=4, kv=dict(chunk_rows=24)).tokenizer

    def enc(t):
        return tok.encode(f"[task {uuid.uuid4().hex[:8]}] Write two sentences about {t}:")
    p = dict(one=enc("owls"), eight=[enc(t) for t in TOPICS], ref=[enc(t) for t in TOPICS[:4]])
    path = tmp_path_factory.mktemp("split") / "prompts.json"
    path.write_text(json.dumps(p))
    return p, str(path)


def _launch(args, n, timeout):
    code = "import sys; from kvferry.launch import launch; sys.exit(launch(sys.argv[2:], int(sys.argv[1])))"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, str(n), sys.executable, *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def result(name, prompts, tmp_path_factory):
    if name not in _results:
        n, mode, ratios, parts = RUNS[name]
        out = tmp_path_factory.mktemp(name)
        r = _launch([os.path.join(ROOT, "tests", "split_worker.py"), str(out), mode, ratios, parts, prompts[1]],
                    n, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        _results[name] = torch.load(out / "result.pt", weights_only=False)
    return _results[name]


def _same(a, b):
    return a[0] == b[0] and a[2] == b[2] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("name", list(RUNS))
def test_placements_are_bitwise_identical_within_a_split(name, prompts, tmp_path_factory):
    res = result(name, prompts, tmp_path_factory)
    for batch in ("one", "eight"):
        ref = res[(batch, "device")]
        for place in ("host-ordered", "host-kvpd1", "host-kvpd4"):
            assert _same(res[(batch, place)], ref), f"{name} {batch}: {place} differs from device-resident"
    assert len({tuple(x) for x in res[("eight", "device")][0]}) == 8, "different prompts, different outputs"


@pytest.mark.parametrize("name", DELAYED)
def test_ranks_with_different_budgets_keep_the_same_resident_chunks(name, prompts, tmp_path_factory):
    res = result(name, prompts, tmp_path_factory)
    ranks = res[("residency", "ranks")]
    assert [r["own"] for r in ranks] == [1, 2]  # each rank's own budget, in chunks per layer
    assert [r["chunks"] for r in ranks] == [1, 1], ranks  # the fewest any rank holds
    # the rank whose own plan was larger says why, once; the other says nothing
    assert [len(r["notes"]) for r in ranks] == [0, 1], ranks
    assert "1 of 7 chunks per layer resident, not the 2" in ranks[1]["notes"][0]
    # part read in place, part ferried, and the bits of the same split's device-resident run
    assert all(r["moved"]["resident"] > 0 and r["moved"]["early"] > 0 for r in ranks), ranks
    assert _same(res[("residency", "eight")], res[("eight", "device")]), f"{name}: residency differs"


@pytest.mark.parametrize("name", DELAYED)
def test_ranks_with_different_ring_budgets_run_the_same_look_ahead(name, prompts, tmp_path_factory):
    res = result(name, prompts, tmp_path_factory)
    ranks = res[("ring", "ranks")]
    assert [r["depth"] for r in ranks] == [1, 1], ranks  # the deepest that fits on every rank
    assert [len(r["notes"]) for r in ranks] == [0, 1], ranks  # rank 1 could run 2, and says why
    assert "fits only look-ahead 1" in ranks[1]["notes"][0]
    assert _same(res[("ring", "eight")], res[("eight", "device")]), f"{name}: the agreed ring differs"


@pytest.mark.parametrize("name", DELAYED)
def test_copy_delays_change_nothing_over_1000_decode_steps(name, prompts, tmp_path_factory):
    res = result(name, prompts, tmp_path_factory)
    ref = res[("delays", "device")]
    steps = 0
    for depth in (1, 4):
        got = res[("delays", f"kvpd{depth}")]
        assert _same(got, ref), f"{name}: kvpd{depth} with delays differs"
        steps += sum(len(x) - 1 for x in got[0])
    assert steps >= 1000


@pytest.mark.parametrize("control", ["skip_ready", "early_recycle", "skip_writeback_wait", "trust_prefetch"])
@pytest.mark.parametrize("name", DELAYED)
def test_split_gate_catches_a_broken_ordering(name, control, prompts, tmp_path_factory):
    got = result(name, prompts, tmp_path_factory)[("control", control)]
    assert got["caught"] is not None, f"{name}: {control} not caught"
    # the same delays and seed without the break give the reference's bits: the break is what the gate saw
    assert got["clean"], f"{name}: the run without {control} differs too (seed {got['caught']})"


@pytest.mark.parametrize("name", list(RUNS))
def test_split_matches_one_device(name, prompts, tmp_path_factory):
    res = result(name, prompts, tmp_path_factory)
    eng = make_engine(ctx_size=160, num_seqs=4, kv=dict(chunk_rows=24))
    ids = [[] for _ in prompts[0]["ref"]]
    first = {}

    def grab(j, logits):
        first.setdefault(j, logits.clone())
    for step in eng.generate_batch(prompts[0]["ref"], 32, SamplingConfig(temperature=0), stop_at_eog=False,
                                   on_logits=grab):
        for j, t in enumerate(step):
            if t is not None:
                ids[j].append(t)
    for place in ("device", "host-kvpd1"):
        got_ids, got_logits, _ = res[("reference", place)]
        assert got_ids == ids, f"{name} {place}: greedy continuations differ from one device"
        for j, lg in enumerate(got_logits):
            diff = (lg - first[j]).abs().max().item()
            assert diff <= 1e-4, f"{name} {place}: prompt {j} last-position logits differ by {diff}"


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_holds_only_its_share(name, prompts, tmp_path_factory):
    n, mode, _, _ = RUNS[name]
    ranks = result(name, prompts, tmp_path_factory)["ranks"]
    assert len(ranks) == n
    if mode == "tensor":
        assert [r["kv_heads"] for r in ranks] == {2: [2, 1], 3: [1, 1, 1]}[n]
        assert all(r["layers"] == 30 for r in ranks)
    else:
        assert [r["layers"] for r in ranks] == [15, 15] and all(r["kv_heads"] == 3 for r in ranks)


def test_a_failing_rank_ends_the_run_with_one_error_line(prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("fault")
    r = _launch([os.path.join(ROOT, "tests", "split_worker.py"), str(out), "tensor", "", "fault", prompts[1]], 2,
                timeout=180)
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: rank 1: RuntimeError: injected fault in rank 1"], r.stderr[-3000:]


def test_under_torchrun_a_failing_rank_says_one_error_line_and_no_traceback():
    # kvferry's CLI as a user runs it under torchrun; rank 1 fails after 3 tokens, rank 0 is in a collective
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "split_worker.py"), "cli", "run", "-p", "Write about owls:", "-n", "200",
           "--temp", "0", "--device", "cpu", "--no-progress", "-sm", "tensor", "-nkvo"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: rank 1: RuntimeError: injected fault in rank 1 (run with -v for the traceback)"], \
        r.stderr[-3000:]
    # the ranks print no traceback (torchrun's own report has one, of torchrun's code)
    assert "split_worker.py\", line" not in r.stderr and "kvferry/" not in r.stderr, r.stderr[-3000:]
