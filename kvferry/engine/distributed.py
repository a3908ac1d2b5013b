"""Split runs over torch.distributed: one process per device, the gpt-fast / vLLM convention.

Owns the process group (built from torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT; `kvferry --tp N` sets the same for the processes it starts), the rank's
device, and every collective of a split run: the all-reduce after attention and after the
MLP (tensor split), hidden states passed rank to rank and the logits shared (layer split),
the sampled tokens broadcast from rank 0, and the agreement of placement decisions (a ring
that does not fit on one rank is declined on all; every rank keeps the fewest resident KV
chunks any rank can hold). NCCL on CUDA, gloo on CPU; no transport
of our own between processes.

Must not: decide anything per rank that changes which path a pass takes (every such
decision goes through `agree`), or wait forever (the group has a timeout; a peer that dies
closes its sockets, and the launcher ends the others).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket

import torch
import torch.distributed as dist

from kvferry import KvferryError
from kvferry.config import EngineConfig
from kvferry.engine.runner import resolve_device
from kvferry.model.shard import Shard, plan_shard

log = logging.getLogger(__name__)
# A collective that waits longer than this for a peer fails instead of hanging (a peer that
# exits is noticed at once: its sockets close). Model loads happen before the first collective.
TIMEOUT = datetime.timedelta(seconds=600)


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun sets them; (0, 1, 0) outside torchrun."""
    rank = int(os.environ.get("RANK", "0"))
    return rank, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", str(rank)))


class Dist:
    """This process's place in a split run and its collectives."""

    def __init__(self, cfg: EngineConfig):
        self.mode, self.ratios = cfg.split_mode, cfg.split_ratios
        self.rank, self.world_size, local_rank = world_from_env()
        if self.ratios and len(self.ratios) != self.world_size:
            raise KvferryError(f"-ts gives {len(self.ratios)} shares for {self.world_size} ranks: give one per rank")
        self.device = _rank_device(cfg.device, local_rank)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # ranks on one machine share its cores: each takes its part, not all of them
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
        if not dist.is_initialized():
            if "MASTER_ADDR" in os.environ:
                dist.init_process_group(self.backend, timeout=TIMEOUT, rank=self.rank, world_size=self.world_size)
            else:  # one process, no torchrun: a group of one, through the same code path
                dist.init_process_group(self.backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                        world_size=1, timeout=TIMEOUT)
        self.shard: Shard | None = None
        self._vocab = self._hidden = None

    def plan(self, cfg) -> Shard:
        """This rank's share of a model of shape `cfg` (fails before any weight is read)."""
        self.shard = plan_shard(cfg, self.mode, self.ratios, self.rank, self.world_size)
        self._vocab, self._hidden = cfg.vocab_size, cfg.hidden_size
        return self.shard

    # -- the model's collectives (Transformer's `comm`) ---------------------------------------
    @property
    def reduce(self):
        return self._all_reduce if self.mode == "tensor" and self.world_size > 1 else None

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)  # x is a fresh projection output: summed in place
        return x

    def start(self, tokens: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Hidden states entering this rank's layers, (N, hidden)."""
        if self.mode != "layer" or self.shard.is_first:
            return torch.nn.functional.embedding(tokens, embed)
        x = torch.empty(tokens.shape[0], self._hidden, dtype=embed.dtype, device=self.device)
        dist.recv(x, self.rank - 1)
        return x

    def finish(self, x: torch.Tensor, last, head) -> torch.Tensor:
        """Logits (B, vocab) at each sequence's last token, the same on every rank."""
        if self.mode != "layer" or self.world_size == 1:
            return head(x[last])
        if not self.shard.is_last:
            dist.send(x.contiguous(), self.rank + 1)
            logits = torch.empty(x[last].shape[0], self._vocab, dtype=torch.float32, device=self.device)
        else:
            logits = head(x[last]).contiguous()
        dist.broadcast(logits, self.world_size - 1)
        return logits

    # -- agreement --------------------------------------------------------------------------
    def agree(self, value: bool | int) -> bool | int:
        """The least of every rank's value. A vote (bool): True only where every rank says ok,
        a decision no rank may take alone; a count (int): the most every rank can do."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return type(value)(t.item())

    def tokens(self, ids: list[int]) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        t = torch.tensor(ids, dtype=torch.long).to(self.device)
        dist.broadcast(t, 0)
        return t.tolist()

    def share(self, obj):
        """Rank 0's `obj` (small, picklable), on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, 0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj` (small, picklable), in rank order, on every rank."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def peer_lost(e: BaseException) -> str | None:
    """The reason, where `e` is a collective failing because another rank left the run (its
    sockets closed, or it stopped answering within TIMEOUT); None for any other error."""
    # NCCL raises DistError; gloo a RuntimeError from its transport ("[.../gloo/transport/tcp/
    # pair.cc:537] Read error [addr]: Connection reset by peer. This is typically ...")
    text = str(e).strip()
    if not isinstance(e, dist.DistError) and not (isinstance(e, RuntimeError) and "gloo/transport/" in text):
        return None
    msg = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(e).__name__)
    return msg.split(". ")[0]  # the first sentence: what happened, not gloo's advice


def _rank_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":  # one device per process: the local rank's
        name = f"cuda:{local_rank}"
    return resolve_device(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
