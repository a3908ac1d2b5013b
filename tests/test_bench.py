"""kvferry bench: the bound arithmetic by hand, and the benchmark end to end on CPU."""

import csv
import io
import json
import re
import sys

import pytest
import torch

from conftest import run_cli
from kvferry import KvferryError
from kvferry.bench import bound as B

BENCH = ["bench", "-p", "8", "-n", "4", "-d", "0,40", "-r", "2", "-nkvo", "0,1", "-kvpd", "0,1",
         "--kv-chunk", "16", "-c", "64", "--device", "cpu"]


def test_bound_arithmetic_matches_hand_computed_numbers():
    # 32 layers x 8 kv heads x 128 dims x 2 (K, V) x 2 bytes = 131072 bytes per token of context
    per_token = 32 * 8 * 128 * 2 * 2
    assert per_token == 131072
    kv = B.decode_kv_bytes(per_token, 32768, 1)
    assert kv == 4294967296  # 32768 rows: 4 GiB per decode step
    assert B.transfer_ms(kv, 55.0) == pytest.approx(78.090, abs=1e-3)  # 4.295e9 B / 55e9 B/s
    assert B.bound_ms(5.5, kv, 55.0) == pytest.approx(78.090, abs=1e-3)  # link-bound
    assert B.bound_ms(100.0, kv, 55.0) == 100.0  # compute-bound
    assert B.bound_ms(None, 55e6, 55.0) == pytest.approx(1.0)
    assert B.pct_of_bound(80.0, 78.09) == pytest.approx(97.6125)
    # mean rows over 128 steps from depth 4096: 4096 + 63.5
    assert B.decode_kv_bytes(1000, 4096, 128, num_seqs=2) == pytest.approx(2 * 1000 * 4159.5)
    # 16 GB of weights + 4 GB of KV at 4000 GB/s: 5 ms floor; 10 ms measured is 50%
    assert B.roofline_pct(10.0, 16e9, 4e9, 4000.0) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        B.transfer_ms(1, 0)


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    png = tmp_path_factory.mktemp("bench") / "tg.png"
    r = run_cli(*BENCH, "-o", "json", "--plot", str(png), "--no-kv-pinned", "-pin", "1,0")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout), png


def test_bench_writes_json_rows_for_every_arm_test_and_depth(bench_json):
    rows, _ = bench_json
    # arms: device, host pinned kvpd 0/1, host pageable kvpd 0/1; tests pp8 and tg4; depths 0 and 40
    assert len(rows) == 5 * 2 * 2
    assert {(r["nkvo"], r["pin"], r["kvpd"]) for r in rows} == {
        ("0", "-", "-"), ("1", "1", "0"), ("1", "1", "1"), ("1", "0", "0"), ("1", "0", "1")}
    for r in rows:
        assert r["tps"] > 0 and r["step_ms"] > 0
        if r["test"] == "tg4":
            assert r["same"] is True, f"arm {r} produced different tokens than the first arm"
            assert r["bound_ms"] >= r["compute_ms"] and r["pct_bound"] > 0
            if r["nkvo"] == "1" and r["depth"] == 40:
                assert r["ferried_mib"] > 0 and r["copy_ms"] > 0


def test_bench_plot_is_a_png(bench_json):
    _, png = bench_json
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_md_and_csv_outputs():
    md = run_cli(*BENCH[:-4], "-nkvo", "1", "-kvpd", "1", "-d", "0", "-r", "1", "-c", "64", "--device", "cpu", "-o", "md")
    assert md.returncode == 0, md.stderr[-2000:]
    lines = md.stdout.strip().splitlines()
    assert lines[0].startswith("| model") and "t/s" in lines[0] and "% bound" in lines[0]
    assert len(lines) == 2 + 2  # header, rule, pp8, tg4
    c = run_cli(*BENCH[:-4], "-nkvo", "0", "-d", "0", "-r", "1", "-c", "64", "--device", "cpu", "-o", "csv")
    assert c.returncode == 0, c.stderr[-2000:]
    rows = list(csv.DictReader(io.StringIO(c.stdout)))
    assert [r["test"] for r in rows] == ["pp8", "tg4"] and all(float(r["tps"]) > 0 for r in rows)


def test_device_budget_arm_reports_resident_share_and_bounds_by_the_ferried_bytes():
    # 16-row chunks of 30 layers x 1536 bytes: 0.70 MiB each; 1.5 MiB keeps chunks 0-1 (rows
    # 0-31) on the device, so at depth 40 attention reads ~3/4 of its KV in place
    args = [*BENCH[:-4], "-nkvo", "0,1", "-kvpd", "1", "--kv-device-budget", "0,1.5", "-d", "40", "-p", "0",
            "-r", "1", "-c", "64", "--device", "cpu", "-o", "json", "--kv-debug", "1"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    # --kv-debug's line: the bytes ferried and read in place, and with the probed link the bound
    steps = [ln for ln in r.stderr.splitlines() if "kv step" in ln]
    assert steps and all("% of the KV read in place" in ln and "bound max(device step, " in ln for ln in steps)
    assert any("chunks 0 .. 1 of every layer resident" in ln for ln in steps), steps[-1]
    rows = {(x["nkvo"], x["kvdb"]): x for x in json.loads(r.stdout)}
    assert set(rows) == {("0", "-"), ("1", "0"), ("1", "1.5")}
    full, part = rows[("1", "0")], rows[("1", "1.5")]
    assert full["resident_pct"] == 0 and full["resident_mib"] == 0
    assert 60 < part["resident_pct"] < 80 and part["resident_mib"] == pytest.approx(2 * 0.703, abs=0.01)
    assert 0 < part["ferried_mib"] < full["ferried_mib"] / 2
    for x in (full, part):  # the bound: max(device step, ferried bytes / link)
        assert x["same"] is True
        assert x["copy_ms"] == pytest.approx(B.transfer_ms(x["ferried_mib"] * 2**20, x["link_gbps"]), rel=0.02, abs=2e-3)
        assert x["bound_ms"] == pytest.approx(max(x["compute_ms"], x["copy_ms"]), abs=2e-3)


def test_idle_time_is_what_no_span_covers():
    from kvferry.bench.ops import idle_us
    assert idle_us([]) == 0.0
    assert idle_us([(0, 10), (5, 12), (20, 25), (21, 22), (30, 31)]) == 8 + 5  # overlaps and nesting
    assert idle_us([(20, 25), (0, 10)]) == 10  # in any order
    assert idle_us([(0, 10), (10, 20)]) == 0  # touching spans leave no gap


def test_profile_splits_each_step_into_host_and_wait_time():
    args = [*BENCH[:-4], "-nkvo", "0", "-d", "0", "-r", "1", "-c", "64", "--device", "cpu", "-p", "0", "-o", "json"]
    plain = json.loads(run_cli(*args).stdout)
    assert "host_ms" not in plain[0], "the split is only there with --profile"
    assert "idle_ms" not in plain[0]
    r = run_cli(*args, "--profile")
    assert r.returncode == 0, r.stderr[-2000:]
    row, = json.loads(r.stdout)
    assert 0 < row["host_ms"] <= row["step_ms"] and abs(row["host_ms"] + row["wait_ms"] - row["step_ms"]) < 1e-2
    # and a profiled pass names where the step's time goes: the weights' matmuls lead on CPU
    ops = row["top_ops"]
    assert ops and all(us > 0 and calls > 0 for _, us, calls in ops)
    assert [us for _, us, _ in ops] == sorted((us for _, us, _ in ops), reverse=True)
    assert any("linear" in name or "addmm" in name or "mm" in name for name, _, _ in ops[:3]), ops
    assert "top 12 by time per step" in r.stderr or "by time per step" in r.stderr
    assert "idle_ms" not in row, "kernel idle time is a CUDA figure"


@pytest.mark.parametrize("args,needle", [
    (["-d", "abc"], "-d expects a comma list of integers"),
    (["-nkvo", "2"], "-nkvo expects 0 or 1"),
    (["-r", "0"], "-r must be >= 1"),
    (["-p", "0", "-n", "0"], "nothing to run"),
    (["--bogus"], "unrecognized arguments: --bogus (see `kvferry bench --help`)"),
    (["--random-weights", "llama3-8b", "--layers", "-3"], "--layers must be >= 1, got -3"),
    (["--random-weights", "llama3-8b", "--layers", "0"], "--layers must be >= 1, got 0"),
    (["--random-weights", "llama3-8b", "--layers", "33"], "llama3-8b has 32 layers"),
    (["--layers", "2"], "--layers applies only with --random-weights"),
    (["--random-weights", "llama9"], "unknown preset 'llama9'"),
    (["--random-weights", "/nonexistent/config.json"], "/nonexistent/config.json: no such file"),
    (["--random-weights", "{broken}"], "broken.json is not valid JSON: Expecting value at line 1, column 16"),
    (["--random-weights", "{short}"], "short.json lacks 'hidden_size'"),
    (["--plot", "/nonexistent/tg.png"], "the directory /nonexistent does not exist"),
    (["--plot", "tg.png", "-n", "0"], "needs a tg test: give -n a value > 0"),
    (["--kv-accuracy", "--random-weights", "llama3-8b"], "--kv-accuracy needs a real model"),
    (["--kv-accuracy", "-ctk", "q8_0,q5_k"], "unknown KV type 'q5_k'"),
    (["--kv-accuracy", "-n", "abc"], "-n expects a comma list of integers"),
])
def test_bench_bad_flag_is_one_error_line_before_any_model_load(tmp_path, args, needle):
    (tmp_path / "broken.json").write_text('{"model_type": }')
    (tmp_path / "short.json").write_text('{"model_type": "llama", "num_attention_heads": 4}')
    args = [x.format(broken=tmp_path / "broken.json", short=tmp_path / "short.json") for x in args]
    r = run_cli("bench", "--device", "cpu", "-c", "64", *args)
    assert r.returncode == 1
    err = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith(("I ", "W "))]
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not r.torch_imported  # so neither the model nor the run had started


def test_plot_without_matplotlib_is_refused_with_the_install_command(monkeypatch):
    from kvferry.bench.command import check_plot
    check_plot("tg.png", [4])  # matplotlib is installed for the tests: accepted
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not
    with pytest.raises(KvferryError, match=r"pip install 'kvferry\[bench\]' \(or pip install matplotlib\)"):
        check_plot("tg.png", [4])


def test_link_probe_runs_on_cpu():
    r = run_cli("bench", "--link", "--device", "cpu", "--link-mib", "8")
    assert r.returncode == 0, r.stderr
    assert "| size MiB |" in r.stdout and "| 8 |" in r.stdout and "device memory" in r.stdout
    assert re.search(r"matrix products [0-9.]+ ms alone, [0-9.]+ ms beside 64 MiB copies at [0-9.]+ GB/s \([+-][0-9.]+%\)",
                     r.stdout), r.stdout


def test_contention_probe_times_the_work_while_the_copies_run():
    from kvferry.bench.link import probe_contention
    r = probe_contention(torch.device("cpu"), copy_mib=8, reps=1)
    assert r["alone_ms"] > 0 and r["beside_ms"] > 0
    assert r["copy_gbps"] > 0.5, "the copies must have run beside the timed work"
    assert r["slowdown_pct"] == round(100 * (r["beside_ms"] / r["alone_ms"] - 1), 1)


def test_kv_accuracy_sees_the_encoding_and_nothing_else():
    from conftest import make_engine
    from kvferry.bench.accuracy import format_table, measure
    ref = make_engine(ctx_size=160, kv=dict(kv_type="f32"))
    engines = {"f32": ref, "q4_0": make_engine(ctx_size=160, kv=dict(kv_type="q4_0")),
               # negative control: f32 KV again, in another cache layout (host, ordered): no difference at all
               "f32 again": make_engine(ctx_size=160, kv=dict(kv_type="f32", offload=True, depth=0))}
    rows = {r.kv_type: r for r in measure(engines, ref.tokenizer, n_gen=6, progress=False)}
    same = rows["f32 again"]
    assert (same.logit_max_abs, same.top1_pct, same.greedy_same, same.prefix_mean) == (0.0, 100.0, 6, 6.0)
    assert rows["q4_0"].logit_max_abs > 0.05, "q4_0 KV must move the logits"
    assert "| q4_0 |" in format_table(list(rows.values()), "md")
