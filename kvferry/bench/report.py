"""Benchmark output: llama-bench-style markdown, csv, json, jsonl, and the depth plot."""

from __future__ import annotations

import json
import os

from kvferry import KvferryError


COLUMNS = ["model", "size_gib", "params_b", "backend", "nkvo", "pin", "kvpd", "kvpb", "kvdb", "ctk", "chunk", "fa", "cg", "np", "test", "depth",
           "tps", "tps_std", "step_ms", "resident_pct", "resident_mib", "ferried_mib", "link_gbps", "copy_ms", "compute_ms", "bound_ms", "pct_bound",
           "roofline_pct", "ring_mib", "declined", "peak_dev_mib", "pinned_mib", "same", "host_ms", "wait_ms",
           "sm", "ranks", "ferried_mib_ranks", "link_gbps_ranks"]


def format_rows(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "jsonl":
        return "\n".join(json.dumps(r) for r in rows)
    if fmt == "csv":
        import csv
        import io
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().rstrip("\n")
    profile = any("host_ms" in r for r in rows)  # --profile
    head = ["model", "size", "params", "backend", "nkvo", "pin", "kvpd", "kvpb", "kvdb", "ctk", "fa", "cg", "np", "test", "t/s",
            "step ms", "resident %", "ferried MiB", "link GB/s", "copy ms", "compute ms", "bound ms", "% bound", "% roofline", "ring MiB",
            "peak dev MiB", "pinned MiB", "same"] + (["host ms", "wait ms"] if profile else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if h not in ("model", "backend", "test") else "---" for h in head) + "|"]
    for r in rows:
        def f(k):
            v = r.get(k)
            return "" if v is None or v == "" else str(v)
        lines.append("| " + " | ".join([
            f("model"), f"{r['size_gib']} GiB", f"{r['params_b']} B", f("backend"), f("nkvo"), f("pin"), f("kvpd"), f("kvpb"), f("kvdb"),
            f("ctk"), f("fa"), f("cg"), f("np"), f"{r['test']} @ d{r['depth']}", f"{r['tps']:.2f} ± {r['tps_std']:.2f}", f("step_ms"),
            f("resident_pct"),
            # a split run: each rank's bytes and link, rank 0 first (the bound uses the slowest)
            f("ferried_mib_ranks") or f("ferried_mib"), f("link_gbps_ranks") or f("link_gbps"), f("copy_ms"), f("compute_ms"), f("bound_ms"), f("pct_bound"),
            f("roofline_pct"), f("ring_mib"), f("peak_dev_mib"), f("pinned_mib"), f("same")]
            + ([f("host_ms"), f("wait_ms")] if profile else [])) + " |")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tg = [r for r in rows if r["test"].startswith("tg")]
    if not tg:
        raise KvferryError("--plot needs a tg test (-n > 0)")
    fig, ax = plt.subplots(figsize=(8, 5))
    arms = {}
    for r in tg:
        label = "device-resident" if r["nkvo"] == "0" else (f"host, kvpd {r['kvpd']}" if r["kvpd"] != "0" else "host, ordered")
        if r["pin"] == "0":
            label += ", pageable"
        if len({x["ctk"] for x in tg}) > 1:
            label += f", {r['ctk']}"
        for flag in ("fa", "cg"):
            if len({x.get(flag) for x in tg}) > 1:
                label += f", {flag} " + ("on" if r[flag] == "1" else "off")
        arms.setdefault(label, []).append(r)
    for label, rs in arms.items():
        rs.sort(key=lambda r: r["depth"])
        ax.errorbar([r["depth"] for r in rs], [r["tps"] for r in rs], yerr=[r["tps_std"] for r in rs],
                    marker="o", capsize=3, label=label)
    host = sorted((r for r in tg if r["nkvo"] == "1"), key=lambda r: r["depth"])
    if host:
        by_depth = {}
        for r in host:  # the tightest (smallest) bound per depth
            if r["depth"] not in by_depth or r["bound_ms"] < by_depth[r["depth"]]["bound_ms"]:
                by_depth[r["depth"]] = r
        d = sorted(by_depth)
        np_ = host[0]["np"]
        ax.plot(d, [1000.0 * np_ / by_depth[x]["bound_ms"] for x in d], "k--", label="bound: max(device step, bytes / link)")
    ax.set_xlabel("depth (tokens already in the KV cache)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title or f"{tg[0]['model']} on {tg[0]['backend']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_md_json(out_dir: str, name: str, lines: list[str], rows) -> None:
    """Write ``name``.md (the lines) and ``name``.json (the rows) under out_dir, and print the
    markdown: the usual ending of a benchmark script."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print("\n".join(lines))
