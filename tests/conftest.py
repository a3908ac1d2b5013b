import os
import subprocess
import sys

# idle OpenMP threads spin by default, which starves a second process on a 2-core machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvferry.config import EngineConfig, KVConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def gguf_path():
    from kvferry.engine.engine import default_model_path
    return default_model_path()


_engines = {}
_weights = {}


def make_engine(**kw):
    """A CPU engine on the default model, cached by its config; engines of one dtype share
    one copy of the weights (loading takes seconds, and CI has 24 GiB)."""
    from kvferry.engine.engine import Engine
    kv = kw.pop("kv", {})
    cfg = EngineConfig(device="cpu", dtype=kw.pop("dtype", "f32"), kv=KVConfig(**kv), **kw)
    if cfg not in _engines:
        _engines[cfg] = Engine(cfg, progress=False, share_weights=_weights.get(cfg.dtype))
        _weights.setdefault(cfg.dtype, _engines[cfg])
    return _engines[cfg]


@pytest.fixture(scope="session")
def engine():
    return make_engine(ctx_size=512)


def run_cli(*args, timeout=300, env=None):
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvferry", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=e)


torch.set_num_threads(max(1, min(4, len(os.sched_getaffinity(0)))))
