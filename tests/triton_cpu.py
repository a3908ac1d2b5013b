"""Triton kernels in tests: compiled on a GPU, run by Triton's CPU interpreter elsewhere.

Triton reads TRITON_INTERPRET when a function is decorated (its own library functions
included, when Triton is imported) and again at a kernel's first launch, so a test module
loads its kernel module at collection with `load` and keeps the variable set while its tests
run with `interpreter_fixture`."""

import importlib
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _interpret(on: bool):
    """Set TRITON_INTERPRET=1 (on CPU) and return a function that restores the old value."""
    old = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"

    def restore():
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return restore


def load(name: str) -> str | None:
    """Import the kernel module `name` (interpreted on CPU); returns why its kernels cannot
    run here, or None."""
    restore = _interpret(DEVICE == "cpu")
    try:
        import triton.language as tl
        mod = sys.modules.get(name)
        mod = importlib.import_module(name) if mod is None else mod
        if DEVICE == "cpu" and not mod.INTERPRETED:
            mod = importlib.reload(mod)
    except ImportError as e:
        return f"Triton is not installed ({e})"
    finally:
        restore()
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(tl.zeros, InterpretedFunction):
            return "Triton was imported before this module could set TRITON_INTERPRET=1: run this file alone"
    return None


def interpreter_fixture():
    """A module-scoped autouse fixture that keeps TRITON_INTERPRET=1 set on CPU while the
    module's tests run, and only then."""
    @pytest.fixture(scope="module", autouse=True)
    def interpreter_while_these_tests_run():
        restore = _interpret(DEVICE == "cpu")
        yield
        restore()
    return interpreter_while_these_tests_run
