"""CPU threads attend a share of the host-resident KV (--kv-cpu-share): the link ferries one
part of a layer's chunks to the device while the CPU reads another part straight from host
memory, so a decode step moves more KV per second than the link alone carries.

Which chunks: per decode pass, chunks [first, first + n) of every layer, right after the
device-resident ones (transport/residency.py), all of whose rows are stable (written by an
earlier pass, so in host memory once that pass's write-backs are done). The newest chunk,
which holds this pass's row, is always ferried.

Per layer: `start` copies the layer's queries to the host (an event on the compute stream)
and hands the pieces of the CPU chunks to a thread pool; `finish` waits for them and copies
their (output, log-sum-exp) into the decode kernel's partials at those chunks' split slots,
where the kernel's merge folds them in like its own. A chunk of C rows is cut into `pieces`
runs of rows (fixed by shape, so every run gives the same bits): piece p of chunk c lands in
split slot c * num_splits + p, and the chunk's other slots hold an empty partial (log-sum-exp
-inf, output 0). Output is not bitwise that of device-resident attention (CPU arithmetic,
another split of the rows): its gates are tolerances (tests/test_host_attention.py).

How the CPU runs it: torch's CPU flash-attention op, once per sequence and layer, over the
sequence's CPU rows viewed as a batch of pieces (no copy): the op's threads split the work by
(piece, KV head). Attending a whole chunk per call, they could split it only by KV head (8 for
an 8B shape: 36 GB/s on a 16-core H100 host); a Python thread per piece spent more time
holding the GIL than attending (8 GB/s with 14 threads, 2026-12-06). The calls run on one
worker thread, so the engine's thread goes on enqueueing the device's part meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvferry.kv import quant
from kvferry.kv.cache import Batch, KVSpec

PIECE_ROWS = 512  # rows per CPU task: 2 MiB of bf16 K and V for 8 KV heads of dim 128
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def default_threads() -> int:
    """Workers: the cores this process may use, less one for the engine's thread and one for
    the copy workers and the driver."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, n - 2)


def cpu_chunks(batch: Batch, first: int, nchunks: int, chunk_rows: int, want: int) -> int:
    """How many chunks from `first` on the CPU attends this pass: at most `want`, each stable
    for every sequence (no rows of it, or all of them written before this pass)."""
    n = 0
    for c in range(first, min(first + want, nchunks)):
        lo, hi = c * chunk_rows, (c + 1) * chunk_rows
        if not all(end <= lo or start >= hi for start, end in zip(batch.starts, batch.ends)):
            break
        n += 1
    return n


class HostAttention:
    """The worker and the per-layer buffers for one host cache. `host_k`, `host_v`: per layer
    uint8 (num_seqs, ctx, H, row_bytes) host tensors (the cache's own). `threads`: torch's
    threads for the worker's ops (default: the cores less two)."""

    def __init__(self, spec: KVSpec, host_k, host_v, device: torch.device, threads: int | None = None):
        self.spec, self.host_k, self.host_v, self.device = spec, host_k, host_v, device
        self.threads = threads or default_threads()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-cpu-attn")
        self._set_worker_threads()
        self._bufs: dict = {}  # (B, n, num_splits, G, parity) -> host result buffers and their free event
        self._parity = 0

    def _set_worker_threads(self) -> None:
        """torch keeps its thread count per OS thread, taken from a process-wide default at the
        thread's first use, and setting it sets that default too. So the worker first takes the
        default (get), then sets its own, and the caller puts the default back: the engine's
        thread keeps its count. (Set without the get first, a worker later takes the restored
        default instead.)"""
        n = torch.get_num_threads()

        def one():
            torch.get_num_threads()  # this thread's count is initialized now, from the default
            torch.set_num_threads(self.threads)
        self.pool.submit(one).result()
        torch.set_num_threads(n)

    def worker_threads(self) -> int:
        """The worker's torch thread count (a check for tests)."""
        return self.pool.submit(torch.get_num_threads).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- per layer ---------------------------------------------------------------------------
    def start(self, layer: int, q: torch.Tensor, batch: Batch, first: int, n: int, kernel, stable_wait) -> "Pending":
        """Queue the CPU's part of `layer`: chunks first .. first + n - 1 of every batch entry.
        q (B, Hq, D) on the device; `kernel` the decode kernel (scale, num_splits, partials);
        `stable_wait()` returns once the rows read here are in host memory."""
        spec, c = self.spec, self.spec.chunk_rows
        hkv, d, ns = spec.num_kv_heads, spec.head_dim, kernel.num_splits
        b = len(batch.seq_ids)
        g = q.shape[1] // hkv
        pieces = min(ns, max(1, c // PIECE_ROWS))
        while c % pieces:  # pieces of equal rows: a chunk viewed as (pieces, rows)
            pieces -= 1
        buf = self._buffers(b, n, ns, g, d)
        o, lse, free = buf
        if free is not None:
            free.synchronize()  # the layer before last's results have been copied out of this buffer
        if q.device.type == "cuda":
            qh = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
            qh.copy_(q, non_blocking=True)
            q_ready = torch.cuda.Event()
            q_ready.record(torch.cuda.current_stream(self.device))
        else:
            qh, q_ready = q.clone(), None
        k_dt = quant.FLOAT_TYPES.get(spec.kv_type, q.dtype)  # float codes are read as they are
        ov = o.view(b, hkv, n, ns, g, d)
        lv = lse.view(b, hkv, n, ns, g)
        # per batch entry: its CPU chunks are full (stable) up to the first it has no rows in
        full = [min(n, max(0, (end - 1) // c - first)) if end > first * c else 0 for end in batch.ends]
        nbytes = sum(full) * c * 2 * hkv * spec.row_bytes

        @torch.inference_mode()  # the buffers are inference tensors (the engine's passes run in that mode)
        def work():
            stable_wait()
            if q_ready is not None:
                q_ready.synchronize()
            for j, s in enumerate(batch.seq_ids):
                m = full[j]
                if m < n:  # chunks without rows of this entry: empty partials
                    ov[j, :, m:, :pieces].zero_()
                    lv[j, :, m:, :pieces].fill_(float("-inf"))
                if not m:
                    continue
                lo, hi = first * c, (first + m) * c
                k = quant.dequantize(self.host_k[layer][s, lo:hi], spec.kv_type, d, k_dt)
                v = quant.dequantize(self.host_v[layer][s, lo:hi], spec.kv_type, d, k_dt)
                r = c // pieces  # (m * pieces, rows, H, D) -> (m * pieces, H, rows, D), a view
                k = k.view(m * pieces, r, hkv, d).transpose(1, 2)
                v = v.view(m * pieces, r, hkv, d).transpose(1, 2)
                qj = qh[j].view(1, hkv, g, d).to(k_dt).expand(m * pieces, hkv, g, d).contiguous()
                out, l = _flash(qj, k, v, 0.0, False, scale=kernel.scale)[:2]
                ov[j, :, :m, :pieces].copy_(out.view(m, pieces, hkv, g, d).permute(2, 0, 1, 3, 4))
                lv[j, :, :m, :pieces].copy_(l.view(m, pieces, hkv, g).permute(2, 0, 1, 3))

        return Pending(buf, self.pool.submit(work), first, n, ns, kernel, nbytes)

    def _buffers(self, b, n, ns, g, d):
        """Two sets of result buffers, alternating by layer, so the CPU fills one while the
        device copies the other; slots no piece writes stay empty partials."""
        self._parity ^= 1
        key = (b, n, ns, g, self._parity)
        buf = self._bufs.get(key)
        if buf is None:
            if len(self._bufs) > 16:
                self._bufs.clear()
            pin = self.device.type == "cuda"
            o = torch.zeros(b * self.spec.num_kv_heads, n * ns, g, d, dtype=torch.float32, pin_memory=pin)
            lse = torch.full((b * self.spec.num_kv_heads, n * ns, g), float("-inf"), dtype=torch.float32,
                             pin_memory=pin)
            buf = self._bufs[key] = [o, lse, None]
        return buf

    def probe_rates(self, link_probe, seconds: float = 0.3) -> tuple[float, float]:
        """(CPU attention GB/s, link GB/s), measured at the same time, as they will run: the
        CPU's over this cache's own host rows (its type and layout, from memory, not cache),
        `link_probe(seconds)` the ring's copies. Both read host memory, so each slows the other."""
        res = {}
        t = threading.Thread(target=lambda: res.__setitem__("link", link_probe(seconds)))
        t.start()
        try:
            cpu = self.pool.submit(self._probe_cpu, seconds).result()
        finally:
            t.join()
        return cpu, res["link"]

    @torch.inference_mode()
    def _probe_cpu(self, seconds: float) -> float:
        """On the worker: chunks of the cache's rows through the same op as `start`."""
        spec, d, hkv, c = self.spec, self.spec.head_dim, self.spec.num_kv_heads, self.spec.chunk_rows
        k_dt = quant.FLOAT_TYPES.get(spec.kv_type, torch.bfloat16)
        c = min(c, spec.ctx)
        pieces = max(1, c // PIECE_ROWS)
        while c % pieces:
            pieces -= 1
        q = torch.zeros(pieces, hkv, 4, d, dtype=k_dt)
        spans = [(lay, s, r) for lay in range(spec.num_layers) for s in range(spec.num_seqs)
                 for r in range(0, spec.ctx - c + 1, c)]
        t0, nbytes, i = time.perf_counter(), 0, 0
        while time.perf_counter() - t0 < seconds or i < 2:
            lay, s, r = spans[i % len(spans)]
            k = quant.dequantize(self.host_k[lay][s, r:r + c], spec.kv_type, d, k_dt)
            v = quant.dequantize(self.host_v[lay][s, r:r + c], spec.kv_type, d, k_dt)
            _flash(q, k.view(pieces, c // pieces, hkv, d).transpose(1, 2),
                   v.view(pieces, c // pieces, hkv, d).transpose(1, 2), 0.0, False, scale=1.0)
            if i == 1:  # the first is a warm-up
                t0, nbytes = time.perf_counter(), 0
            else:
                nbytes += 2 * c * hkv * spec.row_bytes
            i += 1
        return nbytes / (time.perf_counter() - t0) / 1e9


class Pending:
    """One layer's CPU part in flight."""

    def __init__(self, buf: list, future, first, n, num_splits, kernel, nbytes):
        self.buf, self.future = buf, future
        self.first, self.n, self.num_splits, self.kernel, self.nbytes = first, n, num_splits, kernel, nbytes

    @property
    def chunk_end(self) -> int:
        return self.first + self.n

    def finish(self) -> None:
        """Wait for the CPU, then put its partials where the kernel's merge reads them (queued
        on the compute stream)."""
        self.future.result()
        p0, p1 = self.first * self.num_splits, self.chunk_end * self.num_splits
        dev_o, dev_lse = self.kernel.o_part[:, p0:p1], self.kernel.lse_part[:, p0:p1]
        dev_o.copy_(self.buf[0], non_blocking=True)
        dev_lse.copy_(self.buf[1], non_blocking=True)
        if dev_o.device.type == "cuda":  # the buffer is free again once these copies are done
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev_o.device))
            self.buf[2] = ev
