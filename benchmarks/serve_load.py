"""Load generator for `kvferry serve`: a concurrency sweep of streaming clients.

Each level runs `c` clients for --seconds, each sending streaming /v1/completions requests back
to back (--prompt-tokens random token ids when the server has no tokenizer, else a text prompt;
--max-tokens generated with ignore_eos, so every request runs its full length). Per level:
requests completed, errors by status, aggregate generated tokens/s, time to first token and
inter-token latency (median and p90), the server's RSS drift between the first and last
quarter when --pid is given, and from the server's /metrics its decode steps alone (prefill
chunks excluded): mean, median and p90 step time (the last two from the histogram's buckets,
1.25x apart) and the rate at which they attend KV bytes, which for a host
KV cache is set against the link (--link-gbps, e.g. from `kvferry bench --link`). Prints a
markdown table, then one JSON line (or -o FILE.json).

  kvferry serve --device cpu -np 8 -c 2048 --port 8080 &
  python benchmarks/serve_load.py --url http://127.0.0.1:8080 -c 1,4,8,16 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx


async def _one(client: httpx.AsyncClient, body: dict, rec: dict) -> None:
    t0 = time.perf_counter()
    last, stamps, ok = None, [], False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            rec["errors"][r.status_code] = rec["errors"].get(r.status_code, 0) + 1
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                ok = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                rec["errors"]["sse"] = rec["errors"].get("sse", 0) + 1
                return
            if obj.get("usage"):
                rec["tokens"] += obj["usage"]["completion_tokens"]
            if obj.get("choices") and (obj["choices"][0].get("text") or obj["choices"][0].get("token_ids")):
                now = time.perf_counter()
                stamps.append(now)
                if last is None:
                    rec["ttft"].append(now - t0)
                else:
                    rec["itl"].append(now - last)
                last = now
    if ok:
        rec["done"] += 1
    else:
        rec["errors"]["incomplete"] = rec["errors"].get("incomplete", 0) + 1


async def _level(a, concurrency: int, prompt) -> dict:
    rec = dict(done=0, tokens=0, ttft=[], itl=[], errors={}, rss=[])
    stop = time.perf_counter() + a.seconds
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)

    async def client(i):
        async with httpx.AsyncClient(base_url=a.url, headers=headers, timeout=600, limits=limits) as c:
            while time.perf_counter() < stop:
                body = {"prompt": prompt(i), "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                try:
                    await _one(c, body, rec)
                except httpx.HTTPError as e:
                    rec["errors"][type(e).__name__] = rec["errors"].get(type(e).__name__, 0) + 1

    async def sample_rss():
        while time.perf_counter() < stop:
            if a.pid:
                with open(f"/proc/{a.pid}/status") as f:
                    rec["rss"].append(next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")))
            await asyncio.sleep(0.5)

    before = await _decode_counters(a)
    t0 = time.perf_counter()
    await asyncio.gather(sample_rss(), *(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    after = await _decode_counters(a)
    steps, step_s, kv_bytes = (x - y for x, y in zip(after[:3], before[:3]))
    buckets = {le: n - before[3].get(le, 0.0) for le, n in after[3].items()}
    q = len(rec["rss"]) // 4
    drift = (sum(rec["rss"][-q:]) / q) / (sum(rec["rss"][:q]) / q) - 1 if q else None
    return dict(concurrency=concurrency, seconds=round(wall, 1), requests=rec["done"], errors=rec["errors"],
                tokens=rec["tokens"], tok_s=round(rec["tokens"] / wall, 1),
                ttft_ms_p50=_ms(rec["ttft"], 0.5), ttft_ms_p90=_ms(rec["ttft"], 0.9),
                itl_ms_p50=_ms(rec["itl"], 0.5), itl_ms_p90=_ms(rec["itl"], 0.9),
                rss_drift_pct=None if drift is None else round(100 * drift, 2), decode_steps=int(steps),
                step_ms=round(1000 * step_s / steps, 2) if steps else None,
                step_ms_p50=bucket_ms(buckets, 0.5), step_ms_p90=bucket_ms(buckets, 0.9),
                kv_gbps=round(kv_bytes / step_s / 1e9, 2) if step_s else None,
                pct_link=round(100 * kv_bytes / step_s / 1e9 / a.link_gbps, 1) if step_s and a.link_gbps else None)


_STEP_BUCKET = "kvferry_decode_step_seconds_bucket{le=\""


async def _decode_counters(a) -> tuple[float, float, float, dict]:
    """(decode steps, their seconds, KV bytes they attended, {bucket bound: steps at most
    that long}) so far, from /metrics."""
    async with httpx.AsyncClient(base_url=a.url, timeout=30) as c:
        return parse_counters((await c.get("/metrics")).text)


def parse_counters(text: str) -> tuple[float, float, float, dict]:
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    buckets = {float(k[len(_STEP_BUCKET):-2]): v for k, v in vals.items() if k.startswith(_STEP_BUCKET)}
    return (vals.get("kvferry_decode_step_seconds_count", 0.0), vals.get("kvferry_decode_step_seconds_sum", 0.0),
            vals.get("kvferry_decode_kv_bytes_total", 0.0), buckets)


def bucket_ms(buckets: dict, q: float):
    """The q-quantile of the decode steps from the histogram's cumulative buckets, in ms:
    linear within the bucket that holds it (the buckets are 1.25x apart)."""
    bounds = sorted(buckets)
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return None
    lo, below = 0.0, 0.0
    for b in bounds:
        if buckets[b] >= q * total:
            if b == float("inf"):
                return round(1000 * lo, 2)
            frac = (q * total - below) / max(buckets[b] - below, 1e-9)
            return round(1000 * (lo + frac * (b - lo)), 2)
        lo, below = b, buckets[b]
    return None


def _ms(xs, q):
    if not xs:
        return None
    return round(1000 * statistics.quantiles(xs, n=100)[int(q * 100) - 1], 1) if len(xs) > 1 else round(1000 * xs[0], 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key", default=None)
    p.add_argument("-c", "--concurrency", default="1,4,8,16", help="comma list of client counts")
    p.add_argument("--seconds", type=float, default=20, help="per concurrency level")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS drift")
    p.add_argument("--link-gbps", type=float, default=None, help="host-to-device GB/s: report decode steps as %% of it")
    p.add_argument("-o", "--output", default=None, help="also write the JSON rows to this file")
    a = p.parse_args(argv)
    info = httpx.get(a.url + "/v1/models", headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}).json()
    model = info["data"][0]["id"]
    rng = random.Random(0)
    if not info["data"][0].get("meta", {}).get("tokenizer", True):  # --random-weights: token ids only
        def prompt(i):
            return [rng.randrange(1000, 30000) for _ in range(a.prompt_tokens)]
    else:
        words = "the quick brown fox jumps over a lazy dog while rivers run to the sea".split()

        def prompt(i):  # about one token a word; unique per request, so nothing is reused
            return f"[{rng.random():.6f}] " + " ".join(rng.choice(words) for _ in range(a.prompt_tokens - 8))
    rows = [asyncio.run(_level(a, int(c), prompt)) for c in a.concurrency.split(",")]
    cols = ["concurrency", "requests", "errors", "tok_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90",
            "rss_drift_pct", "decode_steps", "step_ms", "step_ms_p50", "step_ms_p90", "kv_gbps", "pct_link"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    out = dict(model=model, url=a.url, prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, rows=rows)
    print(json.dumps(out))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
