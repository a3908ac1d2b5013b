"""`kvferry bench --kv-accuracy`: what each KV type costs in output quality, against f32 KV.

For a fixed set of chat prompts, the f32-KV engine generates a greedy continuation. Every
other KV type then (1) reads the same tokens back, teacher-forced, and is compared position
by position with f32 KV: the largest absolute logit difference and how often its top token
is f32's top token; and (2) generates its own greedy continuation, compared with f32's:
how many prompts give the identical continuation and the mean length of the common prefix.
All engines share one copy of the weights and the compute dtype; only the KV type differs,
so every difference is the KV encoding's (llama.cpp's perplexity/KL tool answers the same
question over a corpus; this is the quick, per-prompt form of it).
"""

from __future__ import annotations

import dataclasses
import json

from tqdm import tqdm

from kvferry import KvferryError
from kvferry.config import SamplingConfig

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn rain.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, friends' into Spanish.",
    "Give one tip for writing clear code.",
]
REFERENCE = "f32"


@dataclasses.dataclass
class Accuracy:
    kv_type: str
    logit_max_abs: float  # teacher-forced, over the prompt's last position and every generated one
    top1_pct: float  # teacher-forced positions whose top token is f32 KV's
    greedy_same: int  # prompts whose free-running greedy continuation equals f32 KV's
    prefix_mean: float  # mean length of the common greedy prefix
    prompts: int
    tokens: int


def _greedy(eng, ids, n):
    out = []
    for step in eng.generate_batch([ids], n, SamplingConfig(temperature=0), stop_at_eog=False):
        out.append(step[0])
    return out


def _forced_logits(eng, ids, cont):
    """Logits of the prompt's last position and of each continuation position but the last."""
    eng.cache.reset(0)
    rows = [eng.prefill(0, ids).float()]
    pos = len(ids)
    for t in cont[:-1]:
        rows.append(eng.decode([0], [t], [pos])[0].float())
        pos += 1
    import torch  # here, not at the top: flags are checked before torch loads
    return torch.stack(rows)


def measure(engines: dict, tokenizer, n_gen: int, progress: bool = True) -> list[Accuracy]:
    """engines: kv type -> Engine, with REFERENCE among them; all on one model and dtype."""
    ref = engines[REFERENCE]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    bar = tqdm(total=len(prompts) * len(engines), desc="kv accuracy", unit="prompt", disable=(not progress) or None)
    ref_cont, ref_logits = [], []
    for ids in prompts:
        cont = _greedy(ref, ids, n_gen)
        ref_cont.append(cont)
        ref_logits.append(_forced_logits(ref, ids, cont))
        bar.update()
    out = []
    for kv, eng in engines.items():
        if kv == REFERENCE:
            continue
        err, agree, total, same, prefix = 0.0, 0, 0, 0, 0
        for ids, cont, lref in zip(prompts, ref_cont, ref_logits):
            lg = _forced_logits(eng, ids, cont)
            err = max(err, (lg - lref).abs().max().item())
            agree += int((lg.argmax(-1) == lref.argmax(-1)).sum())
            total += lg.shape[0]
            mine = _greedy(eng, ids, n_gen)
            same += mine == cont
            prefix += next((i for i, (a, b) in enumerate(zip(mine, cont)) if a != b), min(len(mine), len(cont)))
            bar.update()
        out.append(Accuracy(kv, round(err, 4), round(100 * agree / total, 1), same, round(prefix / len(prompts), 1),
                            len(prompts), n_gen))
    bar.close()
    return out


def format_table(rows: list[Accuracy], fmt: str) -> str:
    if fmt in ("json", "jsonl"):
        return "\n".join(json.dumps(dataclasses.asdict(r)) for r in rows) if fmt == "jsonl" else \
            json.dumps([dataclasses.asdict(r) for r in rows])
    n = rows[0].tokens if rows else 0
    lines = [f"| KV type | max abs logit diff vs {REFERENCE} | top-1 agreement | greedy {n} tokens identical | "
             "mean common prefix |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.kv_type} | {r.logit_max_abs:.4f} | {r.top1_pct:.1f}% | {r.greedy_same}/{r.prompts} | "
                     f"{r.prefix_mean:.1f} |")
    return "\n".join(lines)


def run(a, n_gens: list[int]) -> int:
    """The --kv-accuracy command: -ctk names the KV types to compare with f32 KV, over the
    largest of -n's (already parsed) generation lengths."""
    from kvferry.args import engine_config

    if a.random_weights:
        raise KvferryError("--kv-accuracy needs a real model (output quality means nothing with random weights): "
                           "drop --random-weights")
    if a.split_mode != "none":
        raise KvferryError("--kv-accuracy runs on one device: drop -sm")
    kinds = [x.strip() for x in str(a.kv_type).split(",") if x.strip() and x.strip() != REFERENCE]
    if not kinds or kinds == ["auto"]:
        kinds = ["bf16", "f16", "q8_0", "q4_0", "fp8"]
    n_gen = max(n_gens)
    if n_gen < 1:
        raise KvferryError("--kv-accuracy compares generated tokens: give -n a value > 0")
    base = dict(nkvo="0", kvpd="0", kvpb="0", chunk=str(a.kv_chunk).split(",")[0],
                fa=str(a.flash_attn).split(",")[0], cg=str(a.cuda_graphs).split(",")[0])
    ctx = 512 + n_gen
    # every KV type checked (by building its config) before the model loads
    cfgs = {kv: dataclasses.replace(engine_config(a, ctk=kv, **base), ctx_size=ctx, num_seqs=1)
            for kv in [REFERENCE] + kinds}
    from kvferry.engine.generation import Engine  # torch, and the model: only for good flags
    engines = {REFERENCE: Engine(cfgs[REFERENCE], progress=False)}
    try:
        for kv in kinds:
            engines[kv] = Engine(cfgs[kv], progress=False, share_weights=engines[REFERENCE])
        rows = measure(engines, engines[REFERENCE].tokenizer, n_gen)
    finally:
        for e in reversed(list(engines.values())):
            e.close()
    print(format_table(rows, a.output))
    return 0
