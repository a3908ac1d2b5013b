"""`kvferry run`: read the prompt, generate, print the text.

Owns the run command's flags, reading and checking the prompt, and stdout. Everything the
user typed is checked before torch is imported or the model loads, so a mistake costs no
load time. stdout carries only the generated text; logs go to stderr.
"""

from __future__ import annotations

import logging
import sys

from kvferry import KvferryError
from kvferry.args import add_model_args, engine_config
from kvferry.config import SamplingConfig
from kvferry.launch import rank_env

log = logging.getLogger("kvferry")


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="generate text")
    r.add_argument("-p", "--prompt", default=None, help="prompt text")
    r.add_argument("-f", "--file", default=None,
                   help="read the prompt from a UTF-8 file, - for standard input; one trailing newline is dropped "
                        "(with -np > 1: one prompt per line)")
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


def cmd_run(a) -> int:
    if a.n_predict < 0:
        raise KvferryError(f"-n must be >= 0 (tokens to generate), got {a.n_predict}")
    # a split run's rank 0 reads standard input (the others have none) and shares it after the load
    stdin_shared = a.file == "-" and rank_env()[1] > 1
    prompts = read_prompts(a) if not stdin_shared or rank_env()[0] == 0 else []
    sampling = SamplingConfig(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed)
    cfg = engine_config(a)
    if len(prompts) > cfg.num_seqs:
        raise KvferryError(f"{len(prompts)} prompts but -np is {cfg.num_seqs}: raise -np to decode them together")

    from kvferry.engine.generation import Engine  # torch, and the model load: only for good input
    from kvferry.engine.textstream import TextStream

    eng = Engine(cfg, progress=not a.no_progress)
    dist = eng.runner.dist
    if stdin_shared:
        prompts = dist.share(prompts)
    out = _Stdout(quiet=dist is not None and dist.rank != 0)  # a split run prints once, from rank 0
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
                out.write(stream.push(t))
            out.write(stream.flush() + "\n")
        else:
            outs = [[] for _ in ids]
            for step in eng.generate_batch(ids, a.n_predict, sampling):
                for j, t in enumerate(step):
                    if t is not None:
                        outs[j].append(t)
            for j, o in enumerate(outs):
                out.write(f"[{j}] {tok.decode(o)}\n")
        _log_stats(eng)
    except KeyboardInterrupt:
        out.end_line()  # the shell prompt then starts on a line of its own
        raise
    finally:
        eng.close()
    return 0


class _Stdout:
    """stdout for the generated text, flushed per piece; remembers whether the last line is
    still open, so that an interrupt can end it."""

    def __init__(self, quiet: bool = False):
        self.line_open = False
        self.quiet = quiet

    def write(self, text: str) -> None:
        if text and not self.quiet:
            # set before writing: an interrupt can land inside the write, and the text in
            # stdout's buffer still comes out at exit
            self.line_open = not text.endswith("\n")
            sys.stdout.write(text)
            sys.stdout.flush()

    def end_line(self) -> None:
        if self.line_open:
            self.write("\n")


def _log_stats(eng):
    st = eng.cache.stats()
    if st:
        log.info("transport: %s", ", ".join(f"{k}={v}" for k, v in st.items()))


# ---------------------------------------------------------------------------- the prompt
def read_prompts(a) -> list[str]:
    """The prompts: -p's text, or -f's file (- = standard input); with -np > 1, each
    non-blank line of the file is one prompt. Refuses an empty prompt and text that is not
    UTF-8, which the tokenizer would otherwise reject after the model load."""
    if a.prompt is not None and a.file is not None:
        raise KvferryError("pass the prompt with -p or with -f, not both")
    if a.file is not None:
        where = f"-f {a.file}" if a.file != "-" else "standard input (-f -)"
        text = _read_text(a.file, where)
        if a.parallel > 1:
            prompts = [ln for ln in text.splitlines() if ln.strip()]
            if not prompts:
                raise KvferryError(f"{where} holds no prompt: with -np > 1, each non-blank line is one")
            return prompts
        if text.endswith("\n"):  # as llama.cpp: the newline that ends the file does not end the prompt
            text = text[:-1]
        if not text:
            raise KvferryError(f"{where} is empty: it should hold the prompt")
        return [text]
    if a.prompt is None:
        raise KvferryError("no prompt: pass -p TEXT, -f FILE, or -f - to read standard input")
    if not a.prompt:
        raise KvferryError("-p is empty: pass the prompt text")
    _check_encodable(a.prompt)
    return [a.prompt]


def _read_text(path: str, where: str) -> str:
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise KvferryError(f"cannot read the prompt from {where}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise KvferryError(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}, "
                           f"offset {e.start}): convert it, e.g. with iconv -t UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text mode reads


def _check_encodable(text: str) -> None:
    # bytes of the command line that are not UTF-8 reach Python as lone surrogates
    # (surrogateescape), which the tokenizer rejects with a TypeError
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        raise KvferryError(f"-p is not valid UTF-8 ({what} at character {e.start}): use a UTF-8 locale "
                           "or pass the prompt in a UTF-8 file with -f FILE") from None
