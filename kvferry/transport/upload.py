"""Weight upload: one tensor at a time, host (pageable, often memory-mapped) to device.

On a GPU the copy goes through the device's capped pinned staging buffer, so neither a
pinned copy of the tensor nor a pageable-speed copy is needed.
"""

from __future__ import annotations

import torch


def upload(w: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """w: a host tensor -> a new tensor on `device` in `dtype`."""
    w = w.to(dtype).contiguous()
    if device.type != "cuda":
        return w
    from kvferry.transport.staging import get_staging
    dst = torch.empty(w.shape, dtype=dtype, device=device)
    get_staging(device).copy_to_device(dst, w)
    return dst
