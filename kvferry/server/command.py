"""`kvferry serve`: its flags, the checks that need no model, and uvicorn's start and stop.

Owns the serve command's flags (the model and KV flags are args.py's), the check that the
server extra is installed (one error line naming `pip install 'kvferry[server]'`), and the
process's life: bind, load the model on the engine thread (/health says 503 until then), serve,
and on SIGTERM or Ctrl-C stop admitting, give running requests --grace seconds, exit 0.
Must not import torch or the web stack at module level: `--help` and flag errors return at once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal

from kvferry import KvferryError
from kvferry.args import add_model_args, add_random_weights_args, engine_config, random_model

log = logging.getLogger(__name__)
INSTALL = "pip install 'kvferry[server]'"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    s.add_argument("--alias", default=None, help="the model id clients name (default: the model file's name)")
    s.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a free slot; beyond it, 429 (default: 64)")
    s.add_argument("--max-body", type=float, default=8, help="largest request body in MiB; beyond it, 413 (default: 8)")
    s.add_argument("--grace", type=float, default=10,
                   help="seconds running requests get to finish after SIGTERM (default: 10)")
    add_random_weights_args(s, " (no tokenizer: prompts go to /v1/completions as token ids)")
    add_model_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(a) -> int:
    if not 0 <= a.port < 65536:
        raise KvferryError(f"--port must be in 0..65535, got {a.port}")
    for flag, v in (("--queue", a.queue), ("--max-body", a.max_body), ("--grace", a.grace)):
        if v < 0 or v != v:
            raise KvferryError(f"{flag} must be >= 0, got {v}")
    if a.max_body <= 0:
        raise KvferryError(f"--max-body must be > 0 MiB, got {a.max_body}")
    shape = random_model(a)  # a bad preset, path or --layers: one line before anything binds
    cfg = engine_config(a)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise KvferryError(f"kvferry serve needs {', '.join(missing)}: {INSTALL}")
    from kvferry.engine.distributed import world_from_env
    rank, world, _ = world_from_env()
    if world > 1 and rank != 0:  # a split run: rank 0 serves, this rank follows its engine calls
        from kvferry.server.split import follow
        follow(_load(cfg, a, shape, lead=False)[0])
        return 0

    import uvicorn

    from kvferry.server.app import Gate, Runtime, ServeOptions, create_app

    opts = ServeOptions(slots=cfg.num_seqs, ctx_size=cfg.ctx_size, queue=a.queue, api_key=a.api_key,
                        max_body_bytes=int(a.max_body * 2**20), grace_s=a.grace, alias=a.alias)
    fatal: list[str] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # stop admitting at once; uvicorn then waits for open requests
            rt.drain()
            super().handle_exit(sig, frame)

    def on_fatal(message: str) -> None:
        fatal.append(message)
        server.should_exit = True

    rt = Runtime(opts, lambda: _load(cfg, a, shape, lead=world > 1), _make_sampler, on_fatal)
    app = create_app(rt)

    config = uvicorn.Config(Gate(app, a.api_key, opts.max_body_bytes), host=a.host, port=a.port,
                            log_level="debug" if a.verbose else "warning", timeout_graceful_shutdown=a.grace + 2,
                            lifespan="on")
    server = Server(config)
    log.info("listening on http://%s:%d (the model loads meanwhile; /health says when it is ready)", a.host, a.port)
    # uvicorn re-raises the signal it handled once it has shut down; a handled SIGTERM is a clean exit
    signal.signal(signal.SIGTERM, lambda *_: None)
    rt.start()
    try:
        server.run()
    finally:
        rt.stop()
    if fatal:
        raise KvferryError(fatal[0])
    if not server.started:
        raise KvferryError(f"could not listen on {a.host}:{a.port} (in use? try another --port)")
    return 0


def _load(cfg, a, shape, lead: bool):
    """On the engine thread: the Engine and the model id clients name (--random-weights' value
    as given, for random weights). `lead`: rank 0 of a split run, whose engine announces its
    calls to the other ranks."""
    from kvferry.engine.generation import Engine, default_model_path
    from kvferry.server.split import Leader
    if shape is not None:
        engine, name = Engine(cfg, random_model=shape, progress=False), a.random_weights
    else:
        path = cfg.model or default_model_path()
        engine = Engine(cfg, progress=False)
        name = os.path.basename(os.path.normpath(path)).removesuffix(".gguf")
    dist = engine.runner.dist
    if dist is None or dist.world_size == 1:  # a split run's ranks would have to step together
        log.info("warm-up: a decode step of 1 .. %d sequences in %.1f s", cfg.num_seqs, engine.warm_up())
    return (Leader(engine) if lead else engine), name


def _make_sampler(sampling):
    from kvferry.engine.sampling import Sampler
    return Sampler(sampling)
