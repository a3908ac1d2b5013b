"""`kvferry run` end to end: the README's command, and -nkvo prints the same text with telemetry on stderr."""

from conftest import run_cli


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
