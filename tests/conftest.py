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
    from kvferry.engine.generation import default_model_path
    return default_model_path()


_engines = {}
_weights = {}
DEVICE = "cpu"  # pytest --device cuda runs the engine tests (the exactness gates) on a GPU


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for the engine tests: cpu (default) or cuda")


def pytest_configure(config):
    global DEVICE
    DEVICE = config.getoption("--device")


def make_engine(**kw):
    """An engine on the default model (on CPU unless pytest --device says otherwise), cached by
    its config; engines of one dtype share one copy of the weights (loading takes seconds, and
    CI has 24 GiB)."""
    from kvferry.engine.generation import Engine
    kv = kw.pop("kv", {})
    cfg = EngineConfig(device=DEVICE, dtype=kw.pop("dtype", "f32"), kv=KVConfig(**kv), **kw)
    if cfg not in _engines:
        _engines[cfg] = Engine(cfg, progress=False, share_weights=_weights.get(cfg.dtype))
        _weights.setdefault(cfg.dtype, _engines[cfg])
    return _engines[cfg]


@pytest.fixture(scope="session")
def engine():
    return make_engine(ctx_size=512)


# `python -m kvferry ARGS` (runpy runs the package as -m does), which at exit also says on
# stderr whether torch was imported: a check that failed before any model load left it out
_TORCH_MARK = "probe: torch imported:"
_CLI = ("import atexit, runpy, sys\n"
        f"atexit.register(lambda: print({_TORCH_MARK!r}, 'torch' in sys.modules, file=sys.stderr))\n"
        "runpy.run_module('kvferry', run_name='__main__', alter_sys=True)\n")


def run_cli(*args, timeout=300, env=None, input=None):
    """The CLI in a subprocess; the result also has .torch_imported (bool)."""
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.update(env or {})
    res = subprocess.run([sys.executable, "-c", _CLI, *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env=e, input=input)
    lines = res.stderr.splitlines(keepends=True)
    assert lines and lines[-1].startswith(_TORCH_MARK), res.stderr[-2000:]
    res.stderr, res.torch_imported = "".join(lines[:-1]), lines[-1].split()[-1] == "True"
    return res


torch.set_num_threads(max(1, min(4, len(os.sched_getaffinity(0)))))
