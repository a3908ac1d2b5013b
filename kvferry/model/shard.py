"""A rank's share of the model in a split run (`-sm tensor` / `-sm layer`).

Owns the arithmetic of the split (which KV heads, query heads, MLP rows and layers a rank
holds) and cutting a full weight down to that share, which the loader does tensor by tensor
before the upload, so a rank's device never holds more than its share. Must not know how
ranks talk to each other: the engine (engine/distributed.py) hands the model its collectives.

Tensor split (by KV head, gpt-fast's layout): rank r holds KV heads [h0, h1), the query
heads of those groups, the matching rows of wq/wk/wv (and biases), the columns of wo, MLP
rows [f0, f1) of w_gate/w_up and those columns of w_down. Its attention and MLP outputs are
partial sums, added up by one all-reduce each. The MLP is cut in the heads' proportion, so
a rank's share of the work is the same in both halves of a layer.

Layer split: rank r holds layers [l0, l1), renumbered 0 .. l1 - l0 - 1, and their KV only.

Embeddings, the final norm and the output layer stay whole on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvferry import KvferryError
from kvferry.model.arch import ModelConfig

# per-layer weights cut by rows (dim 0) or columns (dim 1), and by which range
_Q_ROWS = ("wq", "bq")
_KV_ROWS = ("wk", "wv", "bk", "bv")
_FFN_ROWS = ("w_gate", "w_up")


def split_bounds(total: int, ratios: tuple[float, ...], world_size: int, what: str) -> list[tuple[int, int]]:
    """[start, end) of each rank's share of `total` units, in proportion to `ratios` (even
    without them); every rank must get at least one unit."""
    if ratios and len(ratios) != world_size:
        raise KvferryError(f"-ts gives {len(ratios)} shares for {world_size} ranks: give one per rank")
    shares = ratios or (1.0,) * world_size
    cum, acc = [], 0.0
    for r in shares:
        acc += r
        cum.append(acc)
    # boundaries rounded half up: 3 heads on 2 even ranks are 2 + 1
    ends = [min(total, math.floor(total * c / acc + 0.5)) for c in cum]
    ends[-1] = total
    bounds = list(zip([0] + ends[:-1], ends))
    empty = [r for r, (a, b) in enumerate(bounds) if b <= a]
    if empty:
        asked = f"-ts {','.join(f'{r:g}' for r in ratios)}" if ratios else f"an even split over {world_size} ranks"
        raise KvferryError(f"{asked} cannot be met: the model has {total} {what}, and rank {empty[0]} would get "
                           f"none (every rank needs at least one; use fewer ranks or other shares)")
    return bounds


@dataclass(frozen=True)
class Shard:
    mode: str  # "tensor" or "layer"
    rank: int
    world_size: int
    kv_heads: tuple[int, int]  # [h0, h1): all of them in a layer split
    ffn_rows: tuple[int, int]  # [f0, f1): all of them in a layer split
    layers: tuple[int, int]  # [l0, l1): all of them in a tensor split

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape this rank computes: its heads, MLP rows and layers."""
        g = cfg.num_heads // cfg.num_kv_heads
        hkv = self.kv_heads[1] - self.kv_heads[0]
        return dataclasses.replace(cfg, num_kv_heads=hkv, num_heads=hkv * g,
                                   intermediate_size=self.ffn_rows[1] - self.ffn_rows[0],
                                   num_layers=self.layers[1] - self.layers[0])

    def local_name(self, name: str) -> str | None:
        """The weight's name on this rank, or None where the rank does not hold it."""
        if not name.startswith("layers."):
            return name
        _, i, rest = name.split(".", 2)
        i = int(i)
        if not self.layers[0] <= i < self.layers[1]:
            return None
        return f"layers.{i - self.layers[0]}.{rest}"

    def take(self, name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of the full weight `name` (a copy, so the full one can be freed)."""
        if self.mode != "tensor" or not name.startswith("layers."):
            return w
        kind = name.rsplit(".", 1)[1]
        d, g = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        h0, h1 = self.kv_heads
        f0, f1 = self.ffn_rows
        if kind in _Q_ROWS:
            return w[h0 * g * d:h1 * g * d].contiguous()
        if kind in _KV_ROWS:
            return w[h0 * d:h1 * d].contiguous()
        if kind == "wo":
            return w[:, h0 * g * d:h1 * g * d].contiguous()
        if kind in _FFN_ROWS:
            return w[f0:f1].contiguous()
        if kind == "w_down":
            return w[:, f0:f1].contiguous()
        return w  # norms (per layer, or per head dimension for q/k norms)


def plan_shard(cfg: ModelConfig, mode: str, ratios: tuple[float, ...], rank: int, world_size: int) -> Shard:
    """Rank `rank`'s share; raises a one-line KvferryError naming the count that cannot be split."""
    every = (0, cfg.num_kv_heads), (0, cfg.intermediate_size), (0, cfg.num_layers)
    if mode == "layer":
        layers = split_bounds(cfg.num_layers, ratios, world_size, "layers")[rank]
        return Shard(mode, rank, world_size, every[0], every[1], layers)
    if mode != "tensor":
        raise ValueError(f"no shard for split mode {mode!r}")
    heads = split_bounds(cfg.num_kv_heads, ratios, world_size, "KV heads")
    h0, h1 = heads[rank]
    f = cfg.intermediate_size
    f0, f1 = f * h0 // cfg.num_kv_heads, f * h1 // cfg.num_kv_heads  # in the heads' proportion
    return Shard(mode, rank, world_size, (h0, h1), (f0, f1), every[2])
