"""The split's arithmetic and its flags: shares per rank, the one-line errors before any
weight is read, and `--tp` end to end through the CLI (stdout once, the same text, the
prompt on standard input)."""

import pytest

from conftest import run_cli
from kvferry import KvferryError
from kvferry.model.arch import preset_config
from kvferry.model.shard import plan_shard, split_bounds


def test_uneven_heads_split_larger_share_first():
    assert split_bounds(3, (), 2, "KV heads") == [(0, 2), (2, 3)]
    assert split_bounds(3, (), 3, "KV heads") == [(0, 1), (1, 2), (2, 3)]
    assert split_bounds(8, (3.0, 1.0), 2, "KV heads") == [(0, 6), (6, 8)]
    assert split_bounds(30, (), 2, "layers") == [(0, 15), (15, 30)]


def test_a_share_that_cannot_be_met_names_the_head_count():
    with pytest.raises(KvferryError, match="3 KV heads"):
        split_bounds(3, (), 4, "KV heads")
    with pytest.raises(KvferryError, match="3 KV heads"):
        split_bounds(3, (1.0, 0.0), 2, "KV heads")
    with pytest.raises(KvferryError, match="one per rank"):
        split_bounds(3, (1.0, 1.0, 1.0), 2, "KV heads")


def test_shards_cover_the_model_once():
    cfg = preset_config("smollm2-135m")
    shards = [plan_shard(cfg, "tensor", (), r, 2) for r in range(2)]
    assert [s.local_config(cfg).num_heads for s in shards] == [6, 3]
    assert sum(s.local_config(cfg).intermediate_size for s in shards) == cfg.intermediate_size
    layer = [plan_shard(cfg, "layer", (), r, 2) for r in range(2)]
    assert layer[1].local_name("layers.20.wq") == "layers.5.wq" and layer[0].local_name("layers.20.wq") is None


def test_bad_split_flags_fail_before_torch():
    for args, msg in ((["-sm", "rows"], "-sm must be one of"), (["-ts", "1,x", "-sm", "tensor"], "-ts expects"),
                      (["-ts", "1,1"], "add -sm tensor"), (["--tp", "2"], "--tp starts one process")):
        r = run_cli("run", "-p", "hi", "--device", "cpu", *args)
        assert r.returncode == 1 and r.stderr.startswith("error:") and msg in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not r.torch_imported


def test_too_many_ranks_is_one_error_line_naming_the_heads():
    r = run_cli("run", "-p", "hi", "--device", "cpu", "-sm", "tensor", "--tp", "4", "--no-progress")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "3 KV heads" in errors[0], r.stderr[-2000:]


def test_tp2_prints_the_same_text_once():
    args = ["run", "-n", "12", "--temp", "0", "--device", "cpu", "--no-progress"]
    one = run_cli(*args, "-p", "List three colours:")
    # the prompt on standard input: rank 0 reads it and shares it with rank 1
    split = run_cli(*args, "-f", "-", "-sm", "tensor", "--tp", "2", "-nkvo", input="List three colours:\n")
    assert one.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    assert split.stdout == one.stdout


def test_bench_reports_each_ranks_bytes_and_bounds_by_the_slowest():
    r = run_cli("bench", "--random-weights", "smollm2-135m", "--layers", "2", "-sm", "tensor", "--tp", "2",
                "-nkvo", "1", "-d", "256", "-p", "0", "-n", "4", "-r", "1", "--device", "cpu", "--link-mib", "4",
                "-o", "jsonl")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [__import__("json").loads(ln) for ln in r.stdout.splitlines()]
    assert len(rows) == 1, "rank 0 reports, once"
    row = rows[0]
    b0, b1 = (float(x) for x in row["ferried_mib_ranks"].split("/"))
    assert row["ranks"] == 2 and abs(b0 - 2 * b1) < 0.02, row  # 2 + 1 KV heads
    links = [float(x) for x in row["link_gbps_ranks"].split("/")]
    slowest_ms = max(b * 2**20 / (g * 1e9) * 1e3 for b, g in zip((b0, b1), links))
    assert abs(row["copy_ms"] - slowest_ms) <= 0.01 + 0.02 * slowest_ms, row


def test_a_ring_that_does_not_fit_on_one_rank_is_declined_on_all():
    # 2 + 1 KV heads: rank 0's ring (3 x 24 KiB) is over the 0.05 MiB budget, rank 1's (3 x 12 KiB) is not
    r = run_cli("run", "-p", "List three colours:", "-n", "4", "--temp", "0", "--device", "cpu", "--no-progress",
                "-c", "160", "--kv-chunk", "24", "-sm", "tensor", "--tp", "2", "-nkvo", "-kvpb", "0.05")
    assert r.returncode == 0, r.stderr[-2000:]
    declines = [ln for ln in r.stderr.splitlines() if "declined" in ln and "W " in ln]
    assert any(ln.startswith("[rank 0]") and "budget" in ln for ln in declines), r.stderr[-2000:]
    assert any(ln.startswith("[rank 1]") and "another rank" in ln for ln in declines), r.stderr[-2000:]
