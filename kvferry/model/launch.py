"""Launching a Triton kernel without Triton's per-call argument binding: shared by the
decode attention kernels (decode_attention.py) and the fused elementwise kernels
(fused_kernels.py)."""

from __future__ import annotations

import torch


class Launch:
    """kernel[grid](...) without Triton's per-call argument binding, on CUDA.

    Why by hand: Triton's launcher binds and specializes every argument on every call, 34 us
    of host time per partials launch and 15 us per merge on an H200 host (2026-12-06), while
    the decode step launches kernels per layer: at 4k the eager step is bound by that host
    time. The compiled variant Triton would pick depends only on which pointer arguments are
    16-byte aligned, provided the kernel marks every integer that varies between calls
    `do_not_specialize` (the callers' kernels do), and on the tensors' dtypes, which one
    Launch must keep fixed (its owner makes one per dtype). So the alignment is the cache
    key; a new key compiles through Triton's warmup. Constexprs come last in the kernel's
    signature and are fixed per Launch. Under the interpreter (CPU) this is the plain
    launch."""

    def __init__(self, kernel, device: torch.device, consts: dict, options: dict, interpreted: bool):
        self.kernel, self.device, self.consts, self.options = kernel, device, consts, options
        self.interpreted = interpreted
        names = list(kernel.arg_names)
        self.tail = tuple(consts[n] for n in names[len(names) - len(consts):])  # constexprs come last
        self.compiled = {}
        if not interpreted:  # the current stream as Triton's own launcher asks for it (one C call;
            # torch.cuda.current_stream builds a Stream object in Python, per launch)
            from triton.runtime import driver
            self._stream = driver.active.get_current_stream
            self._index = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, grid, *args):
        if self.interpreted:
            return self.kernel[grid](*args, **self.consts, **self.options)
        key = tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
        run = self.compiled.get(key)
        if run is None:
            run = self.compiled[key] = self.kernel.warmup(*args, grid=grid, **self.consts, **self.options)
        run[grid + (1,) * (3 - len(grid))](*args, *self.tail, stream=self._stream(self._index))
