"""Peer comparison: Hugging Face transformers' offloaded static and dynamic caches against
kvferry's pipelined host cache, same model shape and depths, in one run.

  python benchmarks/peers.py --preset llama3-8b -d 4096,16384,32768,65536 -n 32 -r 2 --out DIR

Both sides use random bf16 weights of the preset's shape and time greedy decode of -n
tokens after filling the cache to each depth (HF: a real prefill; kvferry: random KV rows,
which is the same amount of KV to move). Writes DIR/peers.md and DIR/peers.json with
tok/s, and the link bound measured by kvferry's bench in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def hf_model(preset: str, layers: int | None, device: str):
    import transformers
    from kvferry.model.arch import preset_config
    mc = preset_config(preset, layers)
    cfg = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_eps, rope_theta=mc.rope_theta,
        max_position_embeddings=mc.max_position, tie_word_embeddings=mc.tie_embeddings)
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    return model, cfg


def hf_decode(model, cfg, kind: str, depth: int, n: int, device: str) -> float:
    """Fill an offloaded cache with a prefill of `depth` tokens, time n greedy steps -> tok/s."""
    from transformers import DynamicCache, StaticCache
    offload = device.startswith("cuda")
    if kind == "static":
        cache = StaticCache(config=cfg, max_cache_len=depth + n + 1, offloading=offload)
    else:
        cache = DynamicCache(config=cfg, offloading=offload)
    g = torch.Generator().manual_seed(depth)
    ids = torch.randint(0, cfg.vocab_size, (1, depth), generator=g).to(device)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            pos = torch.tensor([depth + i], device=device)
            out = model(tok, past_key_values=cache, use_cache=True, cache_position=pos)
            tok = out.logits[:, -1:].argmax(-1)
        tok.item()
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("-d", "--depths", default="4096,16384,32768,65536")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=".")
    ap.add_argument("--replot", default=None, help="only redraw the plot from an earlier peers.json")
    a = ap.parse_args()
    if a.replot:
        os.makedirs(a.out, exist_ok=True)
        with open(a.replot) as f:
            plot(json.load(f), os.path.join(a.out, "peers.png"), a.preset)
        return
    depths = [int(x) for x in a.depths.split(",")]
    layers = ["--layers", str(a.layers)] if a.layers else []
    # kvferry first (its own process: it measures the link and the device-resident step too)
    kv = subprocess.run([sys.executable, "-m", "kvferry", "bench", "--random-weights", a.preset, *layers,
                         "-p", "0", "-n", str(a.n), "-d", a.depths, "-r", str(a.r), "-nkvo", "0,1", "-kvpd", "1",
                         "--device", a.device, "-o", "json"], capture_output=True, text=True)
    if kv.returncode:
        sys.exit(f"kvferry bench failed: {kv.stderr[-2000:]}")
    kv_rows = json.loads(kv.stdout)
    model, cfg = hf_model(a.preset, a.layers, a.device)
    results = []
    for d in depths:
        row = {"depth": d}
        for kind in ("static", "dynamic"):
            try:
                tps = [hf_decode(model, cfg, kind, d, a.n, a.device) for _ in range(a.r)]
                row[f"hf_{kind}_offloaded_tps"] = round(statistics.mean(tps), 2)
            except Exception as e:  # record why a peer could not run, keep the others
                row[f"hf_{kind}_offloaded_tps"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
        host = next(r for r in kv_rows if r["depth"] == d and r["nkvo"] == "1")
        dev = next(r for r in kv_rows if r["depth"] == d and r["nkvo"] == "0")
        row.update(kvferry_kvpd1_tps=host["tps"], kvferry_device_tps=dev["tps"],
                   bound_tps=round(1000.0 / host["bound_ms"], 2), kvferry_pct_bound=host["pct_bound"])
        results.append(row)
        print(json.dumps(row), flush=True)
    lines = ["| depth | HF static offloaded t/s | HF dynamic offloaded t/s | kvferry -nkvo -kvpd 1 t/s | kvferry device-resident t/s | bound t/s | kvferry % of bound |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['depth']} | {r['hf_static_offloaded_tps']} | {r['hf_dynamic_offloaded_tps']} | "
                     f"{r['kvferry_kvpd1_tps']} | {r['kvferry_device_tps']} | {r['bound_tps']} | {r['kvferry_pct_bound']} |")
    from kvferry.bench.report import write_md_json
    write_md_json(a.out, "peers", lines, results)
    plot(results, os.path.join(a.out, "peers.png"), a.preset)


def plot(results, path, preset):
    """t/s against depth for each cache, with the link bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = [r["depth"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label in (("kvferry_kvpd1_tps", "kvferry -nkvo -kvpd 1"), ("hf_static_offloaded_tps", "HF StaticCache offloaded"),
                       ("hf_dynamic_offloaded_tps", "HF DynamicCache offloaded"), ("kvferry_device_tps", "kvferry device-resident")):
        ys = [r[key] if isinstance(r[key], (int, float)) else float("nan") for r in results]
        ax.plot(d, ys, marker="o", label=label)
    ax.plot(d, [r["bound_tps"] for r in results], "k--", label="bound: max(device step, bytes / link)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("depth (tokens in the KV cache)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{preset}, random bf16 weights, batch 1")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
