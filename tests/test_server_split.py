"""`kvferry serve` over a split run (`-sm tensor|layer --tp 2`, gloo on CPU, real processes):
rank 0 serves and the other rank replays its engine calls, so greedy answers equal `kvferry run`
with the same split, alone and beside concurrent requests; SIGTERM to the launcher drains
rank 0, which stops the other rank, and the whole run exits 0."""

import concurrent.futures as cf
import signal
import subprocess
import time

import pytest

from conftest import run_cli
from test_server import N, OTHERS, QUESTION, Server, _chat


@pytest.mark.parametrize("mode", ["tensor", "layer"])
def test_split_server_answers_as_split_run_and_stops_on_sigterm(mode):
    ref = run_cli("run", "-p", QUESTION, "--chat", "-n", str(N), "--temp", "0", "--device", "cpu", "-c", "512",
                  "--no-progress", "-sm", mode, "--tp", "2")
    assert ref.returncode == 0, ref.stderr[-2000:]
    server = Server("-np", "4", "-sm", mode, "--tp", "2")
    try:
        alone = _chat(server, QUESTION, temperature=0, max_tokens=N).choices[0].message.content
        assert alone == ref.stdout[:-1]
        with cf.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(_chat, server, p, temperature=0, max_tokens=N) for p in [QUESTION] + OTHERS[:3]]
            together = [f.result().choices[0].message.content for f in futs]
        assert together[0] == alone
        assert all(together[1:]), "every concurrent request got an answer"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, "".join(server.log)[-3000:]
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-f", f"--port {server.port}"], capture_output=True, text=True).stdout
        assert not left.strip(), f"ranks still running after the launcher exited: {left}"
    finally:
        server.close()
