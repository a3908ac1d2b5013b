"""`kvferry bench`: its flags, and every check that can fail before a model loads.

Owns the flag definitions, the sweep's arms (one EngineConfig each), the list of tests, the
random-weight shape (--random-weights, --layers) and --plot's preconditions, gathered in a
BenchPlan. Must not import torch: a mistyped flag, a bad --layers or an unwritable --plot
path is reported at once, not after the model load or the whole run. runner.py measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import sys

from kvferry import KvferryError
from kvferry.args import Parser, add_model_args, add_random_weights_args, engine_config, random_model
from kvferry.config import EngineConfig
from kvferry.model.arch import ModelConfig

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="llama-bench-style measurements against the link bound")
    _add_flags(p)
    p.set_defaults(func=cmd_bench)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Bench flags parsed on their own, for scripts that drive runner.Bench directly."""
    p = Parser(prog="kvferry bench")
    _add_flags(p)
    return p.parse_args(argv)


def _add_flags(p) -> None:
    p.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, comma list; 0 = none (default: 512)")
    p.add_argument("-n", "--n-gen", default="128", help="generation lengths, comma list; 0 = none (default: 128)")
    p.add_argument("-d", "--n-depth", default="0", help="depths: rows in the cache before each test, comma list (default: 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions per arm (default: 5)")
    p.add_argument("-o", "--output", default="md", choices=["md", "csv", "json", "jsonl"], help="output format (default: md)")
    p.add_argument("--plot", default=None, help="write a PNG of t/s against depth with the link bound (needs a tg test and matplotlib)")
    add_random_weights_args(p)
    p.add_argument("--depth-fill", default="auto", choices=["auto", "random", "prefill"],
                   help="how depth rows get into the cache: random KV rows, or a real prefill (default: random for random weights)")
    p.add_argument("--profile", action="store_true",
                   help="tg rows also split each step into host time (enqueueing the step: Python, launches, "
                        "copies issued) and the wait for the device after it (host-bound where the wait is ~0), "
                        "and log each arm's top kernels per step (CUDA; ops on CPU) from a profiled pass of up "
                        "to 8 untimed steps (json: top_ops; on CUDA also idle_ms, the step's time with no kernel "
                        "running)")
    p.add_argument("--link", action="store_true",
                   help="only probe the link: pinned, pageable and staged copies per size, as %% of pinned; the "
                        "device's memory; and one-token matrix products timed alone and beside host-to-device "
                        "copies (what the ring's copies cost the device's own work)")
    p.add_argument("--link-mib", default=None,
                   help="copy sizes of the link probe in MiB, comma list (default: 1,4,16,64,256,1024,4096 "
                        "with --link; 256 for a benchmark's own link figure)")
    p.add_argument("--kv-accuracy", action="store_true",
                   help="compare the KV types of -ctk with f32 KV on a real model: logit error and top-1 agreement "
                        "(teacher-forced) and greedy agreement over -n tokens, on six built-in chat prompts")
    p.add_argument("-pin", "--kv-pinned-sweep", default=None,
                   help="host cache pinned (1) or pageable (0), comma list to sweep (default: --kv-pinned)")
    add_model_args(p, sweep=True)


@dataclasses.dataclass(frozen=True)
class BenchPlan:
    pp: list[int]  # prompt sizes of the pp tests
    tg: list[int]  # generation lengths of the tg tests
    depths: list[int]
    arms: list[dict]  # one per swept combination, flag name -> value ("-" where it does not apply)
    base: EngineConfig  # the device-resident engine that loads the weights
    cfgs: list[EngineConfig]  # one per arm
    random_model: ModelConfig | None  # --random-weights' shape, None for a model file


def make_plan(a) -> BenchPlan:
    pp = [x for x in _ints(a.n_prompt, "-p") if x > 0]
    tg = [x for x in _ints(a.n_gen, "-n") if x > 0]
    depths = _ints(a.n_depth, "-d")
    if a.repetitions < 1:
        raise KvferryError(f"-r must be >= 1, got {a.repetitions}")
    if not pp and not tg:
        raise KvferryError("nothing to run: give -p or -n a value > 0")
    arms = _arms(a)
    ctx = max(1, max(depths) + max(pp + tg) + 1)
    first = arms[0]
    base = engine_config(a, nkvo="0", kvpd="0", kvpb="0", kvdb="0", ctk=first["ctk"], chunk=first["chunk"], fa=first["fa"], cg=first["cg"])
    cfgs = [engine_config(a, nkvo=arm["nkvo"], pinned=arm["pin"] != "0", kvpd=arm["kvpd"] if arm["kvpd"] != "-" else "0",
                          kvpb=arm["kvpb"] if arm["kvpb"] != "-" else "0",
                          kvdb=arm["kvdb"] if arm["kvdb"] != "-" else "0", ctk=arm["ctk"], chunk=arm["chunk"], fa=arm["fa"], cg=arm["cg"])
            for arm in arms]
    base = dataclasses.replace(base, ctx_size=ctx)
    cfgs = [dataclasses.replace(c, ctx_size=ctx) for c in cfgs]
    model = random_model(a)
    if a.plot:
        check_plot(a.plot, tg)
    return BenchPlan(pp, tg, depths, arms, base, cfgs, model)


def check_plot(path: str, tg: list[int]) -> None:
    """--plot's preconditions, checked before the run instead of failing after it."""
    if not tg:
        raise KvferryError("--plot draws decode speed against depth, so it needs a tg test: give -n a value > 0")
    if importlib.util.find_spec("matplotlib") is None:
        raise KvferryError("--plot needs matplotlib: pip install 'kvferry[bench]' (or pip install matplotlib)")
    if os.path.isdir(path):
        raise KvferryError(f"--plot {path} is a directory: give a file name such as tg.png")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise KvferryError(f"--plot {path}: the directory {d} does not exist")
    if not os.access(d, os.W_OK):
        raise KvferryError(f"--plot {path}: the directory {d} is not writable")


def _ints(v: str, flag: str, lo: int = 0) -> list[int]:
    try:
        out = [int(x) for x in str(v).split(",") if x.strip() != ""]
    except ValueError:
        raise KvferryError(f"{flag} expects a comma list of integers, got '{v}'") from None
    if not out or any(x < lo for x in out):
        raise KvferryError(f"{flag} values must be >= {lo}, got '{v}'")
    return out


def _arms(a) -> list[dict]:
    lists = {
        "nkvo": [x.strip() for x in str(a.no_kv_offload).split(",")],
        "pin": [x.strip() for x in (a.kv_pinned_sweep or ("1" if a.kv_pinned else "0")).split(",")],
        "kvpd": [x.strip() for x in str(a.kv_pipeline_depth).split(",")],
        "kvpb": [x.strip() for x in str(a.kv_pipeline_budget).split(",")],
        "kvdb": [x.strip() for x in str(a.kv_device_budget).split(",")],
        "ctk": [x.strip() for x in str(a.kv_type).split(",")],
        "chunk": [x.strip() for x in str(a.kv_chunk).split(",")],
        "fa": [x.strip() for x in str(a.flash_attn).split(",")],
        "cg": [x.strip() for x in str(a.cuda_graphs).split(",")],
    }
    arms, seen = [], set()
    for combo in itertools.product(*lists.values()):
        arm = dict(zip(lists, combo))
        if arm["nkvo"] not in ("0", "1"):
            raise KvferryError(f"-nkvo expects 0 or 1, got '{arm['nkvo']}'")
        if arm["pin"] not in ("0", "1"):
            raise KvferryError(f"-pin expects 0 or 1, got '{arm['pin']}'")
        for flag in ("fa", "cg"):
            arm[flag] = {"on": "1", "off": "0"}.get(arm[flag].lower(), arm[flag])
            if arm[flag] not in ("0", "1"):
                raise KvferryError(f"-{flag} expects on/off (or 1/0), got '{arm[flag]}'")
        if arm["nkvo"] == "0":  # transport flags do not apply to a device-resident cache
            arm["kvpd"], arm["kvpb"], arm["kvdb"], arm["pin"] = "-", "-", "-", "-"
        key = tuple(arm.values())
        if key not in seen:
            seen.add(key)
            arms.append(arm)
    return arms


def cmd_bench(a) -> int:
    a.link_mib = _ints(a.link_mib or ("1,4,16,64,256,1024,4096" if a.link else "256"), "--link-mib", 1)
    if a.link:
        return _link_only(a)
    if a.kv_accuracy:
        from kvferry.bench.accuracy import run
        return run(a, _ints(a.n_gen, "-n"))
    plan = make_plan(a)
    from kvferry.bench.report import format_rows, plot_rows
    from kvferry.bench.runner import Bench  # torch, and the model load: only for a good plan

    bench = Bench(a, plan)
    try:
        rows, meta = bench.run()
    finally:
        bench.close()
    dist = bench.eng.runner.dist
    if dist is not None and dist.rank != 0:  # a split run reports once, from rank 0
        return 0
    print(format_rows(rows, a.output))
    sys.stdout.flush()
    if a.plot:
        plot_rows(rows, a.plot)
        log.info("wrote %s", a.plot)
    return 0


def _link_only(a) -> int:
    from kvferry.bench.link import link_sweep, probe_contention, probe_device_memory, sweep_table
    from kvferry.engine.runner import resolve_device
    from kvferry.transport.staging import StagedQueues
    from tqdm import tqdm
    dev = resolve_device(a.device)
    staged = StagedQueues(dev, a.staging_cap << 20)
    try:
        bar = tqdm(total=len(a.link_mib), desc="link", unit="size", disable=None)
        rows = link_sweep(dev, staged, a.link_mib, progress=bar.update)
        bar.close()
        mem = probe_device_memory(dev)
        beside = probe_contention(dev)
    finally:
        staged.close()
    if a.output == "md":
        print(sweep_table(rows))
        print(f"\ndevice memory: {mem:.1f} GB/s (device-to-device copy, read + write)")
        print(f"device work beside host-to-device copies: one-token matrix products {beside['alone_ms']:.2f} ms "
              f"alone, {beside['beside_ms']:.2f} ms beside {beside['copy_mib']} MiB copies at "
              f"{beside['copy_gbps']:.1f} GB/s ({beside['slowdown_pct']:+.1f}%)")
    else:
        print(json.dumps(dict(rows=rows, device_memory_gbps=round(mem, 1), copy_contention=beside)))
    return 0
