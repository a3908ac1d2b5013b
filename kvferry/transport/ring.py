"""Sizing the ring: the deepest look-ahead up to -kvpd whose slots fit the ring's budget and
the device's free memory; ordered (one slot) where not even depth 1 fits. The cache that moves
units through these slots is transport/host_cache.py."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.config import KVConfig
from kvferry.kv.cache import KVSpec

MiB = 1 << 20
HEADROOM_BYTES = 1 << 30  # keep this much device memory free beyond the ring (activations)
# -kvpb auto: the ring may take this share of the device's memory. A slot holds one chunk of
# every sequence, so the ring grows with -np: 3 slots of 16 sequences x 4096 rows of an
# 8B-shape layer are 768 MiB, which a fixed 128 MiB cap sent to the ordered path (the server's
# 80% of the link bound at one client, 2026-12-05, H100). 1/16 holds that on a 16 GiB device
# and leaves 15/16 of any device to weights and resident chunks.
RING_SHARE = 1 / 16


@dataclass(frozen=True)
class RingPlan:
    depth: int  # 0 = ordered
    slot_bytes: int
    reason: str | None  # why the pipeline was declined, if it was
    note: str | None = None  # why the look-ahead is less than -kvpd asked for, if it is

    @property
    def num_slots(self) -> int:  # look-ahead depth uses depth + 2 slots; ordered, one
        return self.depth + 2 if self.depth else 1

    @property
    def ring_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


def ring_plan(spec: KVSpec, kv: KVConfig, free_bytes: int | None = None, total_bytes: int | None = None) -> RingPlan:
    """Size the ring at the deepest look-ahead up to -kvpd that fits the budget and free
    memory; decline (ordered, one slot) where not even depth 1 fits.
    free_bytes / total_bytes: the device's memory (None: not known, no check / no auto cap)."""
    slot = spec.num_seqs * min(spec.chunk_rows, spec.ctx) * spec.token_bytes  # K + V rows of every sequence
    if kv.depth == 0:
        return RingPlan(0, slot, None)
    if kv.budget_mib == "auto":
        budget, said = (total_bytes or 0) * RING_SHARE, "auto: 1/16 of the device's memory"
    else:
        budget, said = kv.budget_mib * MiB, "-kvpb"

    def misfit(depth: int) -> str | None:
        ring = (depth + 2) * slot
        if budget and ring > budget:
            return (f"the ring needs {ring / MiB:.1f} MiB ({depth + 2} slots of {slot / MiB:.1f} MiB) "
                    f"> budget {budget / MiB:g} MiB ({said}; raise -kvpb, or lower --kv-chunk or -np)")
        if free_bytes is not None and ring + HEADROOM_BYTES > free_bytes:
            return f"the ring needs {ring / MiB:.1f} MiB but only {free_bytes / MiB:.0f} MiB of device memory is free"
        return None

    asked = misfit(kv.depth)
    if asked is None:
        return RingPlan(kv.depth, slot, None)
    for depth in range(kv.depth - 1, 0, -1):
        if misfit(depth) is None:
            return RingPlan(depth, slot, None, f"-kvpd {kv.depth}: {asked}; look-ahead {depth} fits")
    return RingPlan(0, slot, misfit(1))
