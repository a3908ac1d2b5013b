"""Command line: builds the top-level parser and dispatches to a command.

  kvferry run    generate text (stdout carries only the generated text; logs go to stderr)
  kvferry bench  llama-bench-style measurements against the link bound
  kvferry serve  an OpenAI-compatible HTTP server with continuous batching

Each command owns its flags (run.py, bench/command.py, server/command.py); the flags they share and their
mapping onto the config dataclasses live in args.py. Nothing here imports torch, so
`--help` and flag errors return at once. Only __main__.py and the console script import
this module.
"""

from __future__ import annotations

import logging
import sys

from kvferry import KvferryError
from kvferry.args import Parser


def build_parser() -> Parser:
    from kvferry import run
    from kvferry.bench import command as bench
    from kvferry.server import command as serve

    p = Parser(prog="kvferry", description="Long-context decoding with the KV cache in host memory.")
    sub = p.add_subparsers(dest="cmd", parser_class=Parser)
    run.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    return p


def main(argv=None) -> int:
    from kvferry.launch import PEER_LOST, launch, rank_env, strip_tp
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv or "--verbose" in argv
    rank, world_size = rank_env()
    where = f"rank {rank}: " if world_size > 1 else ""  # a split run's error line names its rank
    # a split run's other ranks log warnings only (all with -v), each line marked with its rank
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO if rank == 0 else logging.WARNING,
                        stream=sys.stderr,
                        format=("" if world_size == 1 else f"[rank {rank}] ") + "%(levelname).1s %(name)s: %(message)s")
    for noisy in ("urllib3", "matplotlib", "PIL", "httpx", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        parser = build_parser()
        a = parser.parse_args(argv)
        if not getattr(a, "func", None):
            parser.print_help(sys.stderr)
            return 2
        sm = getattr(a, "split_mode", "none")
        if world_size > 1 and sm == "none":
            raise KvferryError(f"this process is one of {world_size} ranks (torchrun): add -sm tensor or -sm layer")
        if getattr(a, "tp", None) is not None:
            if a.tp < 1:
                raise KvferryError(f"--tp must be >= 1 (processes to start), got {a.tp}")
            if sm == "none":
                raise KvferryError("--tp starts one process per device for a split run: add -sm tensor or -sm layer")
            if world_size > 1:
                raise KvferryError("--tp starts the processes itself: under torchrun, leave it out")
            return launch([sys.executable, "-m", "kvferry", *strip_tp(argv)], a.tp)
        return a.func(a)
    except KvferryError as e:
        if verbose:
            logging.getLogger("kvferry").exception("error")
        print(f"error: {where}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the shell's convention, 128 + SIGINT, and no traceback
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected failure still gets one line unless -v
        if verbose:
            raise
        lost = world_size > 1 and _peer_lost(e)
        if lost:  # not this rank's fault: the failing rank says why in its own error line
            print(f"[rank {rank}] {PEER_LOST} ({lost})", file=sys.stderr)
        else:
            print(f"error: {where}{type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return 1


def _peer_lost(e: Exception) -> str | None:
    if "torch" not in sys.modules:  # no collective has run
        return None
    from kvferry.engine.distributed import peer_lost
    return peer_lost(e)
