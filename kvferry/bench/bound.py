"""The performance model: token time >= max(device-resident step, ferried bytes / link).

Pure arithmetic, unit-tested against hand-computed numbers. Times in ms, bandwidth in
GB/s (1 GB = 1e9 bytes), as the link probe reports it.
"""

from __future__ import annotations


def transfer_ms(nbytes: float, gbps: float) -> float:
    """Time to move nbytes at gbps."""
    if gbps <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {gbps}")
    return nbytes / (gbps * 1e9) * 1e3


def bound_ms(device_step_ms: float | None, ferried_bytes: float, link_gbps: float) -> float:
    """The best step time the link allows: the larger of the device-resident step and the
    link time of the bytes that must cross it (device_step_ms None: link term alone)."""
    link = transfer_ms(ferried_bytes, link_gbps)
    return link if device_step_ms is None else max(device_step_ms, link)


def pct_of_bound(measured_ms: float, bound: float) -> float:
    """Achieved speed as % of the bound (100 = at the bound)."""
    return 100.0 * bound / measured_ms


def decode_kv_bytes(token_bytes_all_layers: int, depth: int, n_gen: int, num_seqs: int = 1) -> float:
    """Mean KV bytes one decode step reads over n_gen steps starting at `depth` rows
    (the rows before each step's position)."""
    mean_rows = depth + (n_gen - 1) / 2.0
    return token_bytes_all_layers * mean_rows * num_seqs


def roofline_pct(step_ms: float, weight_bytes: float, kv_bytes: float, mem_gbps: float) -> float:
    """Device-resident step as % of the memory roofline (every byte read once)."""
    return pct_of_bound(step_ms, transfer_ms(weight_bytes + kv_bytes, mem_gbps))
