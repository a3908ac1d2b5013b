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
    except KeyboardInterrupt:  # Ctrl-C: the shell's convention, 128 + SIGINT, and no traceback
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected failure still gets one line unless -v
        if verbose:
            raise
        print(f"error: {type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return 1
