"""`--tp N`: start N local processes of a split run, as torchrun would, and end them together.

Owns the children (one per rank, with torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on a free loopback port), their input and output (standard
input and stdout to rank 0 only; stderr passed through, each rank's logs already prefixed by
the rank), and their end: the first rank that fails ends the run, the others are killed, and
the run says one `error:` line, that rank's. SIGTERM goes to rank 0, which decides how the run
ends (a server drains and then stops the other ranks). Must not import torch (the parent only
waits).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time


# what a rank says (instead of an `error:` line) when a collective failed because another rank
# left the run; the launcher drops these lines, the failing rank's error line says why
PEER_LOST = "stopped: another rank left the run"


def rank_env() -> tuple[int, int]:
    """(rank, world_size) from torchrun's environment; (0, 1) outside a split run."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def strip_tp(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    return out


def launch(cmd: list[str], n: int) -> int:
    """Run `cmd` as ranks 0 .. n-1; returns the exit code of the run (0, or the first failure's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, errors, lost = [], [], set()  # errors: (time, rank, line) of each rank's `error:` line
    lock = threading.Lock()

    def pump(rank, stream):
        for line in stream:
            if line.startswith("error:"):
                msg = line.rstrip("\n")[len("error:"):].strip()
                msg = msg if msg.startswith(f"rank {rank}: ") else f"rank {rank}: {msg}"
                with lock:
                    errors.append((time.monotonic(), rank, msg))
            elif PEER_LOST in line:
                lost.add(rank)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    threads = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        p = subprocess.Popen(cmd, env=env, stdin=None if r == 0 else subprocess.DEVNULL,
                             stdout=None if r == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        t = threading.Thread(target=pump, args=(r, p.stderr), daemon=True)
        t.start()
        threads.append(t)
    # without this, the default SIGTERM would end this parent alone and leave the ranks running
    old_term = signal.signal(signal.SIGTERM, lambda *_: procs[0].poll() is None and procs[0].terminate())
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if failed is None:
                gone = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                failed = next((r for r in gone if r not in lost), gone[0] if gone else None)
            if failed is not None:  # one rank is gone: the others would wait for it
                _kill(procs)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _kill(procs)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old_term)
    for p in procs:
        p.wait()
    for t in threads:
        t.join(timeout=5)
    codes = [p.returncode for p in procs]
    if failed is None:
        failed = next((r for r, c in enumerate(codes) if c != 0), None)
    if failed is None:
        return 0
    if errors:  # the first rank to say why is the one that failed first; its peers fail after it
        print(f"error: {min(errors)[2]}", file=sys.stderr)
    else:
        print(f"error: rank {failed} exited with code {codes[failed]}", file=sys.stderr)
    return codes[failed] if codes[failed] and codes[failed] > 0 else 1


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
