"""`kvferry serve` end to end: the real server on a loopback port (a subprocess, the default
model in f32), driven by the `openai` client and httpx. Two servers for the module: device KV
(-np 8, --queue 8, an API key, a 1 MiB body cap) and host KV (-nkvo -kvpd 1, -np 8, --queue 0),
the second also ends the file with SIGTERM."""

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import ROOT, run_cli

KEY = "test-key"
QUESTION = "What is the capital of France?"
OTHERS = ["List three colours.", "Write a haiku about rain.", "What is 2 + 2?", "Name a planet.",
          "Say hello in Spanish.", "What do bees make?", "Describe a cat in one sentence."]
N = 24


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvferry", "serve", "--device", "cpu", "--dtype", "f32",
                                      "-c", "512", "--port", str(self.port), *flags], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, "".join(self.log)[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("server did not become ready: " + "".join(self.log)[-3000:])

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def health(self):
        return httpx.get(self.url + "/health", timeout=5).json()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def dev():
    s = Server("-np", "8", "--queue", "8", "--api-key", KEY, "--max-body", "1")
    yield s
    s.close()


@pytest.fixture(scope="module")
def host():
    s = Server("-np", "8", "--queue", "0", "-nkvo", "-kvpd", "1")
    yield s
    s.close()


def _chat(server, text, **kw):
    r = server.client().chat.completions.create(model=kw.pop("model", None) or _model(server),
                                                messages=[{"role": "user", "content": text}], **kw)
    return r


def _model(server):
    return server.client().models.list().data[0].id


# ---------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def run_greedy():
    """`kvferry run --chat` greedy text per placement."""
    out = {}
    for name, flags in (("dev", []), ("host", ["-nkvo", "-kvpd", "1"])):
        r = run_cli("run", "-p", QUESTION, "--chat", "-n", str(N), "--temp", "0", "--device", "cpu", "-c", "512",
                    "--no-progress", *flags)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = r.stdout[:-1]  # run ends the text with a newline
    return out


@pytest.mark.parametrize("which", ["dev", "host"])
def test_greedy_equals_run_alone_and_beside_seven_others(request, run_greedy, which):
    server = request.getfixturevalue(which)
    alone = {p: _chat(server, p, temperature=0, max_tokens=N).choices[0].message.content for p in [QUESTION] + OTHERS}
    assert alone[QUESTION] == run_greedy[which]
    with cf.ThreadPoolExecutor(8) as ex:
        together = dict(zip([QUESTION] + OTHERS, ex.map(
            lambda p: _chat(server, p, temperature=0, max_tokens=N).choices[0].message.content, [QUESTION] + OTHERS)))
    assert together == alone
    # negative control: the comparison sees a different answer
    assert alone[OTHERS[0]] != alone[QUESTION]


HAIKU = "Write a haiku about rain."
KV_FLAGS = ("-nkvo", "-kvpd", "0", "--no-kv-pinned", "-ctk", "q4_0", "--kv-chunk", "16", "-ub", "16")


def test_kv_flags_reach_the_served_engine(dev):
    """Ordered, pageable, q4_0 host KV through the real `kvferry serve` (every placement and KV
    type on its own: test_server_kv.py, in-process): the same text as `kvferry run` with those
    flags, beside a second request."""
    run = run_cli("run", "-p", HAIKU, "--chat", "-n", str(N), "--temp", "0", "--device", "cpu", "-c", "512",
                  "--no-progress", *KV_FLAGS)
    assert run.returncode == 0, run.stderr[-2000:]
    s = Server("-np", "2", *KV_FLAGS)
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            got = list(ex.map(lambda p: _chat(s, p, temperature=0, max_tokens=N).choices[0].message.content,
                              [HAIKU, OTHERS[0]]))
    finally:
        s.close()
    assert got[0] == run.stdout[:-1]
    # negative control: q4_0 changes this answer, so the comparison sees whether the flags arrived
    assert _chat(dev, HAIKU, temperature=0, max_tokens=N).choices[0].message.content != got[0]


def test_random_weights_serve_token_ids():
    s = Server("--random-weights", "smollm2-135m", "--layers", "2", "-np", "2")
    try:
        models = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["smollm2-135m"] and models[0]["meta"]["tokenizer"] is False
        body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        ids = r["choices"][0]["token_ids"]
        assert len(ids) == 4 and all(0 <= i < 49152 for i in ids) and r["usage"]["completion_tokens"] == 4
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"] == ids
        # no tokenizer: text prompts are refused with an error object, not served
        r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": "hello"}, timeout=60)
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    finally:
        s.close()


def test_streaming_reassembles_to_the_same_text_with_usage(dev):
    full = _chat(dev, OTHERS[1], temperature=0, max_tokens=N)
    chunks = list(_chat(dev, OTHERS[1], temperature=0, max_tokens=N, stream=True,
                        stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert full.usage.completion_tokens == N and full.choices[0].finish_reason == "length"
    # completions: the raw SSE ends with [DONE]
    with httpx.stream("POST", dev.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_text(dev):
    full = _chat(dev, QUESTION, temperature=0, max_tokens=N).choices[0].message.content
    word = full.split()[3]
    r = _chat(dev, QUESTION, temperature=0, max_tokens=N, stop=[word])
    assert r.choices[0].finish_reason == "stop" and full.startswith(r.choices[0].message.content)
    assert word not in r.choices[0].message.content


# ---------------------------------------------------------------------------- bad input
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = "word " * 600
BAD = {
    "malformed json": ("/v1/chat/completions", b"{bad", 400),
    "body not an object": ("/v1/chat/completions", b"[1, 2]", 400),
    "missing messages": ("/v1/chat/completions", {"max_tokens": 2}, 400),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400),
    "messages not a list": ("/v1/chat/completions", {"messages": "hi"}, 400),
    "message not an object": ("/v1/chat/completions", {"messages": ["hi"]}, 400),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "missing role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    "content wrong type": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    "user content missing": ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    "image content part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    "max_tokens zero": ("/v1/chat/completions", {**GOOD, "max_tokens": 0}, 400),
    "max_tokens negative": ("/v1/chat/completions", {**GOOD, "max_tokens": -3}, 400),
    "max_tokens float": ("/v1/chat/completions", {**GOOD, "max_tokens": 2.5}, 400),
    "max_tokens string": ("/v1/chat/completions", {**GOOD, "max_tokens": "5"}, 400),
    "temperature negative": ("/v1/chat/completions", {**GOOD, "temperature": -1}, 400),
    "temperature too high": ("/v1/chat/completions", {**GOOD, "temperature": 7}, 400),
    "temperature NaN": ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', 400),
    "top_p zero": ("/v1/chat/completions", {**GOOD, "top_p": 0}, 400),
    "top_p above one": ("/v1/chat/completions", {**GOOD, "top_p": 1.5}, 400),
    "top_k negative": ("/v1/chat/completions", {**GOOD, "top_k": -1}, 400),
    "min_p one": ("/v1/chat/completions", {**GOOD, "min_p": 1.0}, 400),
    "unknown model": ("/v1/chat/completions", {**GOOD, "model": "gpt-17"}, 404),
    "prompt beyond context": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400),
    "prompt plus max_tokens beyond context": ("/v1/chat/completions", {**GOOD, "max_tokens": 600}, 400),
    "stop wrong type": ("/v1/chat/completions", {**GOOD, "stop": 5}, 400),
    "stop empty string": ("/v1/chat/completions", {**GOOD, "stop": [""]}, 400),
    "too many stops": ("/v1/chat/completions", {**GOOD, "stop": list("abcde")}, 400),
    "seed negative": ("/v1/chat/completions", {**GOOD, "seed": -5}, 400),
    "seed too big": ("/v1/chat/completions", {**GOOD, "seed": 2**64}, 400),
    "seed string": ("/v1/chat/completions", {**GOOD, "seed": "7"}, 400),
    "n above one": ("/v1/chat/completions", {**GOOD, "n": 2}, 400),
    "stream_options without stream": ("/v1/chat/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400),
    "stream not a bool": ("/v1/chat/completions", {**GOOD, "stream": "yes"}, 400),
    "logprobs": ("/v1/chat/completions", {**GOOD, "logprobs": True}, 400),
    "completion empty prompt": ("/v1/completions", {"prompt": ""}, 400),
    "completion two prompts": ("/v1/completions", {"prompt": ["a", "b"]}, 400),
    "completion token out of vocabulary": ("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 2}, 400),
    "completion prompt wrong type": ("/v1/completions", {"prompt": {"a": 1}}, 400),
    "bad key": ("/v1/chat/completions", GOOD, 401),
    "oversized body": ("/v1/chat/completions", {**GOOD, "pad": "x" * (2 << 20)}, 413),
    "unknown route": ("/v1/nothing", GOOD, 404),
}


def test_bad_input_matrix_is_4xx_error_objects_and_server_still_serves(dev):
    assert len(BAD) >= 25
    seen = {}
    with httpx.Client(base_url=dev.url, timeout=30) as c:
        for name, (path, body, status) in BAD.items():
            key = "wrong" if name == "bad key" else KEY
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(path, content=content, headers={"Authorization": f"Bearer {key}"})
            err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            seen[name] = (r.status_code, err)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            assert err and set(err) == {"message", "type", "param", "code"} and err["message"], (name, r.text[:300])
        # negative control: the good body passes the same path
        ok = c.post("/v1/chat/completions", json=GOOD, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    assert dev.proc.poll() is None
    assert dev.health()["slots_processing"] == 0


def test_health_and_metrics_are_open_without_the_key(dev):
    assert httpx.get(dev.url + "/health").json()["status"] == "ok"
    m = httpx.get(dev.url + "/metrics").text
    for name in ("kvferry_requests_running", "kvferry_requests_waiting", "kvferry_prompt_tokens_total",
                 "kvferry_generation_tokens_total", "kvferry_time_to_first_token_seconds_bucket",
                 "kvferry_request_tokens_per_second_bucket", "kvferry_kv_ferried_bytes_total",
                 "kvferry_kv_ring_declined", "kvferry_staging_pinned_bytes", "kvferry_decode_step_seconds_bucket",
                 "kvferry_decode_kv_bytes_total"):
        assert name in m, name


def test_host_cache_metrics_count_ferried_bytes(host):
    _chat(host, "hi", temperature=0, max_tokens=4)
    m = httpx.get(host.url + "/metrics").text
    line = next(ln for ln in m.splitlines() if ln.startswith('kvferry_kv_ferried_bytes_total{direction="host_to_device"}'))
    assert float(line.split()[-1]) > 0


# ---------------------------------------------------------------------------- slots
def _busy_within(server, want, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if server.health()["slots_processing"] == want:
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_slot_within_two_seconds(dev):
    assert _busy_within(dev, 0, 10)
    with httpx.stream("POST", dev.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True},
                      timeout=60) as r:
        it = r.iter_lines()
        next(it)
        assert dev.health()["slots_processing"] == 1  # control: busy while the client reads
        time.sleep(1.0)
        assert dev.health()["slots_processing"] == 1
    t0 = time.time()
    assert _busy_within(dev, 0, 2.0), "slot still busy 2 s after the client left"
    assert time.time() - t0 < 2.0


def test_queue_full_is_429(host):
    streams, ctx = [], []
    try:
        for i in range(8):
            cm = httpx.stream("POST", host.url + "/v1/completions", timeout=60,
                              json={"prompt": f"Story {i}:", "max_tokens": 300, "ignore_eos": True, "stream": True})
            r = cm.__enter__()
            ctx.append(cm)
            assert r.status_code == 200
            streams.append(r.iter_lines())  # kept: a dropped line iterator closes its response
            next(streams[-1])
        r = httpx.post(host.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        for cm in ctx:
            cm.__exit__(None, None, None)
    assert _busy_within(host, 0, 5)
    r = httpx.post(host.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200  # control: with slots free the same request is served


# ---------------------------------------------------------------------------- load
def _rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS"))


def test_short_load_no_5xx_complete_responses_flat_memory(dev):
    seconds, clients = 16, 16
    results, rss, stop = [], [], time.time() + seconds

    def client(i):
        c = dev.client()
        k = 0
        while time.time() < stop:
            k += 1
            try:
                if k % 2:
                    chunks = list(c.chat.completions.create(model=_MODEL[0], messages=[{"role": "user", "content": f"Count to {i + k}."}],
                                                             max_tokens=16, stream=True, stream_options={"include_usage": True}))
                    ok = chunks[-1].usage is not None and any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
                else:
                    r = c.completions.create(model=_MODEL[0], prompt=f"Fact {i}.{k}:", max_tokens=16)
                    ok = r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
                results.append(("ok" if ok else "incomplete", None))
            except openai.APIStatusError as e:
                results.append(("status", e.status_code))

    _MODEL.append(_model(dev))
    _chat(dev, "warm up", max_tokens=4)
    with cf.ThreadPoolExecutor(clients) as ex:
        futs = [ex.submit(client, i) for i in range(clients)]
        while time.time() < stop:
            rss.append(_rss(dev.proc.pid))
            time.sleep(0.2)
        for f in futs:
            f.result()
    statuses = [s for k, s in results if k == "status"]
    assert not [s for s in statuses if s >= 500], statuses
    assert all(k == "ok" for k, _ in results if k != "status"), results
    assert sum(k == "ok" for k, _ in results) >= clients, len(results)
    q = len(rss) // 4
    first, last = sum(rss[:q]) / q, sum(rss[-q:]) / q
    assert abs(last - first) / first < 0.02, (first, last)


_MODEL = []


# ---------------------------------------------------------------------------- shutdown (last: ends the host server)
def test_sigterm_finishes_running_request_and_exits_0(host):
    with httpx.stream("POST", host.url + "/v1/completions", timeout=60,
                      json={"prompt": "Once", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        host.proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert host.proc.wait(timeout=15) == 0, "".join(host.log)[-2000:]
    assert time.time() - t0 < 12


# ---------------------------------------------------------------------------- the command's own errors
def test_missing_model_is_one_error_line_and_exit_1():
    r = run_cli("serve", "-m", "/nonexistent.gguf", "--device", "cpu", "--port", str(_free_port()), timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: model file not found"), r.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--random-weights", "llama9"], "--random-weights: unknown preset 'llama9'"),
    (["--random-weights", "smollm2-135m", "--layers", "0"], "--layers must be >= 1, got 0"),
    (["--random-weights", "smollm2-135m", "--layers", "31"], "--layers 31: smollm2-135m has 30 layers"),
    (["--random-weights", "/nonexistent/config.json"], "--random-weights: /nonexistent/config.json: no such file"),
    (["--layers", "2"], "--layers applies only with --random-weights"),
])
def test_random_weights_flag_errors_before_torch(flags, message):
    r = run_cli("serve", *flags, "--device", "cpu", "--port", str(_free_port()), timeout=60)
    assert r.returncode == 1 and not r.torch_imported
    assert r.stderr.strip().splitlines()[-1].startswith("error: " + message), r.stderr[-2000:]


def test_without_the_server_extra_the_error_names_the_install(monkeypatch):
    from kvferry import KvferryError
    from kvferry.args import Parser
    from kvferry.server import command
    p = Parser(prog="kvferry")
    command.add_parser(p.add_subparsers(dest="cmd", parser_class=Parser))
    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KvferryError, match=r"pip install 'kvferry\[server\]'"):
        command.cmd_serve(p.parse_args(["serve", "--device", "cpu"]))
