"""`kvferry run` end to end: the README's command, -nkvo prints the same text with telemetry
on stderr, and Ctrl-C stops it cleanly."""

import os
import signal
import subprocess
import sys

from conftest import ROOT, run_cli


def test_readme_chat_command_answers():
    r = run_cli("run", "-p", "What is the capital of France?", "--chat", "-n", "24", "--temp", "0", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    assert "loading" not in r.stdout, "logs belong on stderr"


def test_host_cache_prints_same_text_and_telemetry():
    args = ["run", "-p", "List three colours:", "-n", "16", "--temp", "0", "--device", "cpu", "--no-progress", "--kv-chunk", "8"]
    dev = run_cli(*args)
    host = run_cli(*args, "-nkvo", "-kvpd", "2", "--kv-debug", "2")
    assert dev.returncode == 0 and host.returncode == 0, host.stderr[-2000:]
    assert host.stdout == dev.stdout
    steps = [ln for ln in host.stderr.splitlines() if "kv step" in ln]
    assert len(steps) >= 15, host.stderr[-2000:]
    assert "pipelined depth 2" in steps[-1] and "early" in steps[-1] and "copies busy" in steps[-1]
    # 1 MiB holds 2 chunks of 8 rows (30 layers x 1536 bytes a row): rows 0-15 read in place
    part = run_cli(*args, "-nkvo", "--kv-device-budget", "1", "--kv-debug", "1")
    assert part.returncode == 0 and part.stdout == dev.stdout, part.stderr[-2000:]
    last = [ln for ln in part.stderr.splitlines() if "kv step" in ln][-1]
    assert "chunks 0 .. 1 of every layer resident" in last and "% of the KV read in place" in last, last


def test_ctrl_c_ends_the_line_and_exits_130_without_traceback():
    # a real SIGINT in the middle of a long generation, as a terminal's Ctrl-C sends it
    p = subprocess.Popen([sys.executable, "-m", "kvferry", "run", "-p", "Once upon a time", "-n", "4000", "-s", "1",
                          "--device", "cpu", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        first = p.stdout.read(1)  # the first piece of generated text: decoding has begun
        assert first, p.stderr.read().decode()[-2000:]
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    out, err = (first + out).decode(), err.decode()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.splitlines()[-1] == "interrupted", err[-2000:]
    assert out.endswith("\n") and not out.endswith("\n\n") and len(out) > 1
