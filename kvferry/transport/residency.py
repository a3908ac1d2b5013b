"""Partial residency of a host KV cache (--kv-device-budget): the oldest chunks stay on the device.

Owns the policy (`resident_plan`, the one place that decides which chunks stay) and their
device storage (`ResidentChunks`). The policy: chunk indices 0 .. R-1 of every layer and
every sequence are resident, R the largest count whose device memory fits the budget. The
oldest rows are the natural choice: every later step reads them, a sequence writes them
only while it is that short (or after a reset), and the ferried part of every step is then
the tail past R chunks, so the ring's units are simply chunks R .. n-1 of each layer.

Exactness: a resident chunk is the same rows, the same shapes and the same bytes as the same
chunk delivered through the ring, and the chunking and merge order do not change, so output
stays bitwise identical to a device-resident cache at every budget.

Must not: touch streams or events. Resident rows are written and read on the compute
stream, in order, as the device-resident cache's are. Host memory stays the complete copy:
the host cache writes every new row back, resident or not, so a new budget (set_transport)
refills the resident part from host memory, and host writes (the bench's depth fill) go to
both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvferry.kv.cache import Batch, CodeSpan, KVSpec, plan_writes, write_rows

MiB = 1 << 20


@dataclass(frozen=True)
class ResidentPlan:
    num_chunks: int  # chunk indices 0 .. num_chunks - 1 of every layer stay on the device
    total_chunks: int  # chunks per sequence in the whole context
    nbytes: int  # their device memory (K and V, every layer and sequence)
    nbytes_all: int  # the whole cache's
    note: str | None = None  # one log line where the budget was not taken as given (or was auto)
    level: int = logging.WARNING

    @property
    def share(self) -> float:
        """Resident share of the cache's rows (and bytes)."""
        return self.nbytes / self.nbytes_all if self.nbytes_all else 0.0


def resident_bytes(spec: KVSpec, num_chunks: int) -> int:
    """Device bytes of chunks 0 .. num_chunks - 1 of every layer and sequence."""
    return spec.num_layers * spec.num_seqs * min(num_chunks * spec.chunk_rows, spec.ctx) * spec.token_bytes


def fit_chunks(spec: KVSpec, nbytes: int) -> int:
    """The most chunks per layer whose device memory fits in nbytes."""
    total = -(-spec.ctx // spec.chunk_rows)
    if nbytes >= resident_bytes(spec, total):
        return total
    return max(0, min(total - 1, nbytes // resident_bytes(spec, 1)))  # chunks below the last are whole


def resident_plan(spec: KVSpec, budget_mib: float | str, free_bytes: int, headroom: int) -> ResidentPlan:
    """Chunks per layer to keep on the device for a budget in MiB or "auto". free_bytes: the
    device memory free now (after the weights and the ring); `headroom` of it stays free.
    A budget that holds no chunk of every layer keeps none, one beyond the cache keeps all,
    and one beyond free memory keeps what fits: each says so in `note`."""
    total = -(-spec.ctx // spec.chunk_rows)
    whole = resident_bytes(spec, total)
    room = max(0, free_bytes - headroom)
    plan = dict(total_chunks=total, nbytes_all=whole)

    def done(n, note=None, level=logging.WARNING):
        return ResidentPlan(n, nbytes=resident_bytes(spec, n), note=note, level=level, **plan)

    if budget_mib == "auto":
        n = fit_chunks(spec, room)
        return done(n, f"--kv-device-budget auto: {room / MiB:.0f} MiB free beyond {headroom / MiB:.0f} MiB of "
                       f"headroom; {n} of {total} chunks per layer resident ({resident_bytes(spec, n) / MiB:.1f} "
                       f"of {whole / MiB:.1f} MiB)", logging.INFO)
    want = int(budget_mib * MiB)
    if want == 0:
        return done(0)
    n = fit_chunks(spec, want)
    if resident_bytes(spec, n) > room:
        m = fit_chunks(spec, room)
        return done(m, f"--kv-device-budget {budget_mib:g} MiB does not fit: {room / MiB:.0f} MiB of device "
                       f"memory is free beyond {headroom / MiB:.0f} MiB of headroom, so {m} of {total} chunks "
                       f"per layer are resident ({resident_bytes(spec, m) / MiB:.1f} MiB)")
    if n == 0:
        return done(0, f"--kv-device-budget {budget_mib:g} MiB holds no chunk of every layer (one takes "
                       f"{resident_bytes(spec, 1) / MiB:.2f} MiB): nothing resident, every chunk is ferried")
    if want > whole:
        return done(n, f"--kv-device-budget {budget_mib:g} MiB is more than the whole cache ({whole / MiB:.2f} "
                       "MiB): every chunk is resident", logging.INFO)
    return done(n)


class ResidentChunks:
    """Chunks 0 .. num_chunks - 1 of every layer on the device: per layer K and V uint8
    (num_seqs, rows, H, row_bytes), rows = min(num_chunks * chunk_rows, ctx), the
    device-resident cache's layout cut to those rows."""

    def __init__(self, spec: KVSpec, num_chunks: int, device: torch.device):
        self.spec, self.num_chunks, self.device = spec, num_chunks, device
        self.rows = min(num_chunks * spec.chunk_rows, spec.ctx)
        shape = (spec.num_seqs, self.rows, spec.num_kv_heads, spec.row_bytes)
        self.k = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(spec.num_layers)]
        self.nbytes = resident_bytes(spec, num_chunks)
        self._writes = None

    def fill(self, host_k: list[torch.Tensor], host_v: list[torch.Tensor]) -> None:
        """Copy the resident rows from host memory (setup only: the caller has fenced)."""
        for layer in range(self.spec.num_layers):
            self.k[layer].copy_(host_k[layer][:, :self.rows])
            self.v[layer].copy_(host_v[layer][:, :self.rows])

    def begin(self, batch: Batch) -> int:
        """Plan this pass's writes into resident rows; returns the bytes its attention reads
        in place (every layer)."""
        self._writes = plan_writes(batch, 0, self.rows, True, self.device)
        rows = sum(min(e, self.rows) for e in batch.ends)
        return rows * self.spec.token_bytes * self.spec.num_layers

    def store(self, layer: int, kq: torch.Tensor, vq: torch.Tensor) -> None:
        """This pass's new rows that fall in resident chunks; kq, vq (N, H, row_bytes)."""
        write_rows(self.k[layer], self.v[layer], self._writes, kq, vq)

    def write_rows(self, layer: int, seq_id: int, start: int, kq: torch.Tensor, vq: torch.Tensor) -> None:
        """Host rows [start, start + N) written outside a pass: their resident part too."""
        b = min(start + kq.shape[0], self.rows)
        if start < b:
            self.k[layer][seq_id, start:b].copy_(kq[:b - start])
            self.v[layer][seq_id, start:b].copy_(vq[:b - start])

    def span(self, layer: int, num_chunks: int) -> CodeSpan:
        return CodeSpan(0, num_chunks, self.k[layer], self.v[layer], True)
