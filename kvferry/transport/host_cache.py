"""Host-resident KV cache with ordered and pipelined delivery to the device.

Host layout: per layer one allocation (num_seqs, ctx, 2, H, row_bytes), each row's K codes
then its V codes, so `host_k[layer]` and `host_v[layer]` are the device cache's (num_seqs, ctx,
H, row_bytes) as strided views; the slots are alike, (num_seqs, slot_rows, 2, H, row_bytes). One
sequence's stable rows of one chunk, K and V, are then one run of contiguous bytes: one plain
copy (a 2D copy of K's rows and V's rows at a pitch cost about four times the host time of a
plain one, per unit: docs/results.md, "Host time of a 4k pass").

A delivery unit is (layer, chunk): for every sequence in the batch, the rows of that
chunk that are already in host memory ("stable prefix", below the first row this pass
writes), packed into one device slot at the sequence's batch index. This pass's new
rows never cross the link early: they are quantized on the device, written into the
slot there ("late"), and copied back to host memory asynchronously ("write-back") on a
second copy lane, as one job per pass after an event the compute side records once the last
layer's rows exist. Write-backs wait for compute, so on the delivery lane they would hold up
every delivery queued behind them; on their own lane they do not, and a pass's first delivery
waits only for the previous pass's write-backs (whose rows it may read).

Ring: look-ahead depth N >= 1 uses N + 2 slots; N = 0 (ordered) uses one slot, copy
then compute in series. Each slot has two events:
  ready   recorded on the copy side when the slot's delivery is complete;
          the compute side waits it before reading the slot.
  release recorded on the compute side after the last read of the slot;
          the copy side waits it before overwriting the slot.
Unit u uses slot u % num_slots. Unit u + N is issued when unit u's turn comes, i.e.
after the compute of unit u - 1 is enqueued (issuing earlier can stall the host).
The slot it overwrites was last read by unit u + N - num_slots = u - 2, whose release is
already recorded: recycling is ordered copy-stream-after-compute-stream, never by a host
wait in the decode loop. A slot holds at most `chunk_rows` rows per sequence, so the
ring's size does not grow with the context.

Partial residency (--kv-device-budget, transport/residency.py): chunks 0 .. R-1 of every
layer also live on the device and are read in place; units are then only the ferried chunks
R .. n-1 of each layer (unit u is layer u // n_ferried, chunk R + u % n_ferried), and all of
the above counts those units. Every new row is still written back: host memory stays whole.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from tqdm import tqdm

from kvferry import KvferryError
from kvferry.config import KVConfig
from kvferry.kv.cache import Batch, CodeSpan, KVCache, KVSpec, chunk_view, plan_writes, write_rows
from kvferry.transport import cudart, hostmem
from kvferry.transport.events import Compute
from kvferry.transport.queues import StreamQueue, ThreadQueue
from kvferry.transport.residency import ResidentChunks, resident_plan
from kvferry.transport.ring import HEADROOM_BYTES, RingPlan, ring_plan
from kvferry.transport.staging import StagedQueues

log = logging.getLogger(__name__)
MiB = 1 << 20
# Above this share of the machine's RAM the host cache is not pinned: pinned pages cannot be
# reclaimed, and the rest of the system would be left too little.
MAX_PINNED_SHARE = 0.8


class HostKVCache(KVCache):
    """`staged`: the device's staging queues (the engine's), used when the cache is pageable;
    without them a pageable cache makes its own. Test hooks: `_delay_s` (lo, hi) seconds, or
    {lane: (lo, hi)} with lane 0 deliveries and 1 write-backs, slows copies down; the
    `_unsafe_*` flags break one ordering each (the gates' negative controls).
    `agree(x)`: in a split run, the least of every rank's x: the ring's look-ahead (every
    rank runs the deepest that fits on all, ordered where one rank's ring does not fit), and
    the resident chunks per layer (every rank keeps the fewest any rank can hold)."""

    def __init__(self, spec: KVSpec, kv: KVConfig, device, dtype, progress=True, *,
                 staged: StagedQueues | None = None, agree=None, _delay_s=None, _unsafe_skip_ready=False,
                 _unsafe_early_recycle=False, _unsafe_skip_writeback_wait=False,
                 _unsafe_trust_prefetch=False, _seed=0):
        super().__init__(spec, device, dtype)
        self.kv = kv
        self._unsafe_skip_ready = _unsafe_skip_ready  # negative controls for the gates
        self._unsafe_skip_wb = _unsafe_skip_writeback_wait
        self._unsafe_trust_prefetch = _unsafe_trust_prefetch  # use prefetched units even for another pass
        self._unsafe_early_recycle = _unsafe_early_recycle  # no margin and no release wait
        self._agree = agree
        self.pinned = self._alloc_host(progress)
        delays = _delay_s if isinstance(_delay_s, dict) or _delay_s is None else {0: _delay_s, 1: _delay_s}
        delays = delays or {}
        self._own_staged = None
        if self.pinned:
            make = StreamQueue if device.type == "cuda" else ThreadQueue
            self.lanes = tuple(make(device, delays.get(i), _seed + i) for i in range(2))
        else:
            if staged is None or delays:
                staged = self._own_staged = StagedQueues(device, kv.staging_cap_mib * MiB)
            self.lanes = (staged.h2d, staged.d2h)
            for i, q in enumerate(self.lanes):
                q.delay_s = delays.get(i)
        self.deliver, self.writeback = self.lanes
        self.compute = Compute(device)
        # this pass's rows into the slots, on the compute stream (_write_late)
        self._memcpy = cudart.Memcpy() if device.type == "cuda" and cudart.runtime() is not None else None
        self._build_ring()
        self._build_residency(fill=False)  # the host cache is all zeros, and so are new device rows
        self._unit = 0  # global unit counter: slot = unit % num_slots
        self._pf = None  # the next pass's first units, issued at the end of this pass (see end())
        self.steps = 0
        # the link's host-to-device GB/s where the caller measured it (kvferry bench's probe):
        # the --kv-debug line then gives the bound that follows from the bytes ferried
        self.link_gbps: float | None = None
        self.totals = dict(early=0, late=0, writeback=0, resident=0, prefetch_hit=0, prefetch_miss=0)
        log.info("host KV: %.1f MiB %s; %s", spec.total_bytes / MiB,
                 "pinned" if self.pinned else "pageable (copies through the staging buffer)", self.describe())

    # -- setup ---------------------------------------------------------------------------
    def _build_ring(self):
        self.slot_k = self.slot_v = None
        self._plan = self._plan_ring()
        self.depth, self.decline_reason = self._plan.depth, self._plan.reason
        n, device = self.num_slots, self.device
        try:
            shape = (self.spec.num_seqs, self.slot_rows, 2, self.spec.num_kv_heads, self.spec.row_bytes)
            slots = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(n)]
            self.slot_k = [t[:, :, 0] for t in slots]
            self.slot_v = [t[:, :, 1] for t in slots]
            self._skv = [[t[j] for j in range(shape[0])] for t in slots]  # per batch index: (rows, 2, H, rb)
            self._slot_ptr = [t.data_ptr() for t in slots]  # and as addresses, with its byte strides:
            self._slot_strides = slots[0].stride()[:3]  # batch entry, row, K to V
        except torch.OutOfMemoryError:
            raise KvferryError(f"no device memory for even one {self.slot_bytes / MiB:.1f} MiB delivery slot: "
                               "lower --kv-chunk or -np") from None
        ev = self.deliver.event
        self.ready = [ev(f"ready{i}") for i in range(n)]
        self.release = [ev(f"release{i}") for i in range(n)]
        self.rows_written = ev("rows_written")  # new rows quantized on the compute side
        # write-backs of alternate passes signal alternate events, so a pass's first delivery
        # can wait for the previous pass's write-backs without waiting for its own
        self.wb_done = [ev("wb_done0"), ev("wb_done1")]

    def _build_residency(self, fill: bool) -> None:
        """Keep the oldest chunks of every layer on the device, as many as --kv-device-budget
        allows (transport/residency.py); the ring then ferries only the rest."""
        self.resident, self.resident_chunks = None, 0
        if self.kv.device_budget_mib == 0:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self.device)[0]
        else:  # the CPU's "device memory" is the host's
            free = hostmem.memory_bytes()[1]
        plan = resident_plan(self.spec, self.kv.device_budget_mib, free, HEADROOM_BYTES)
        note, n = plan.note, plan.num_chunks
        if n:
            try:
                self.resident = ResidentChunks(self.spec, n, self.device)
            except torch.OutOfMemoryError:
                note, n = (f"--kv-device-budget: no device memory for {plan.nbytes / MiB:.1f} MiB of resident "
                           "chunks; nothing resident, every chunk is ferried"), 0
        if note:
            log.log(plan.level if n else logging.WARNING, "host KV: %s", note)
        if self._agree is not None:
            # a split run decides placement together, as it does the ring: every rank keeps the
            # fewest chunks any rank can hold (ranks differ in heads or layers, device and free memory)
            least = self._agree(n)
            if least < n:
                log.log(plan.level, "host KV: --kv-device-budget: %d of %d chunks per layer resident, not the %d "
                        "this rank's budget holds: another rank of the split run holds only %d, and the ranks "
                        "keep the same count", least, plan.total_chunks, n, least)
                self.resident = None  # its memory is free for the smaller one
                self.resident = ResidentChunks(self.spec, least, self.device) if least else None
                n = least
        self.resident_chunks = n if self.resident is not None else 0
        if self.resident is not None and fill:
            self.resident.fill(self.host_k, self.host_v)

    def set_transport(self, kv: KVConfig) -> None:
        """Switch delivery mode/depth/budget/residency, keeping the host cache (pinning it
        again is slow; it holds every row, so the resident chunks are refilled from it)."""
        self.fence()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.kv = kv
        self.resident = None  # its memory is free for the new ring and plan
        self._build_ring()
        self._build_residency(fill=True)
        self._unit = 0
        self._pf = None
        log.info("host KV transport: %s", self.describe())

    def fence(self) -> None:
        """The host waits for every copy in flight (never inside the decode loop)."""
        for q in self.lanes:
            q.fence()

    def _alloc_host(self, progress) -> bool:
        """Allocate (and pin, if asked and possible) the host cache; returns whether it is pinned."""
        spec = self.spec
        shape = (spec.num_seqs, spec.ctx, 2, spec.num_kv_heads, spec.row_bytes)
        nbytes = math.prod(shape)
        pin = self.kv.pinned
        ram = hostmem.memory_bytes()[0]
        if pin and ram and spec.total_bytes > MAX_PINNED_SHARE * ram:
            log.warning("host KV: %.1f GiB is more than %d%% of this machine's %.1f GiB of RAM: not pinned, "
                        "copies go through the staging buffer", spec.total_bytes / 2**30,
                        100 * MAX_PINNED_SHARE, ram / 2**30)
            pin = False
        self.host_kv, self._unpins = [], []
        bar = tqdm(total=spec.num_layers, desc="host KV alloc" + (" + pin" if pin else ""), unit="layer",
                   leave=False, disable=(not progress) or spec.total_bytes < (1 << 30) or None)
        pin_s, t_start = 0.0, time.perf_counter()
        for _ in range(spec.num_layers):
            t = hostmem.alloc_host(nbytes)  # huge pages where the system gives them
            t.zero_()  # every page now, with progress, not at the first decode steps
            if pin:
                t0 = time.perf_counter()
                try:
                    self._unpins.append(hostmem.pin(t, "the host KV cache"))
                except hostmem.PinError as e:
                    log.warning("host KV: %s; the cache stays pageable, copies go through the staging "
                                "buffer", e)
                    self._unpin()
                    pin = False
                pin_s += time.perf_counter() - t0
            self.host_kv.append(t.view(shape))
            bar.update()
        bar.close()
        if pin and pin_s > 0.5:
            log.info("host KV: allocated in %.1f s, of which pinning %.1f s", time.perf_counter() - t_start, pin_s)
        self.host_k = [t[:, :, 0] for t in self.host_kv]
        self.host_v = [t[:, :, 1] for t in self.host_kv]
        # per layer and sequence: views made once, so a copy's source is one slice per step
        self._hkv = [[t[q] for q in range(spec.num_seqs)] for t in self.host_kv]  # (ctx, 2, H, rb)
        return pin

    def _unpin(self) -> None:
        for f in self._unpins:
            f()
        self._unpins = []

    @property
    def slot_rows(self) -> int:
        return min(self.spec.chunk_rows, self.spec.ctx)

    @property
    def slot_bytes(self) -> int:
        return self._plan.slot_bytes

    @property
    def num_slots(self) -> int:
        if self._unsafe_early_recycle:
            return max(1, self.depth)  # negative control: no margin
        return self._plan.num_slots

    @property
    def ring_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def _plan_ring(self):
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # slots of an earlier ring are free again
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:  # the CPU's "device memory" is the host's; no free-memory check
            free, total = None, hostmem.memory_bytes()[0] or None
        plan = ring_plan(self.spec, self.kv, free, total)
        if self._agree is not None and self.kv.depth:
            # every rank votes with its depth and all run the least (0 where one declines;
            # it says why in its own log), so the ranks of a split run pipeline alike
            least = self._agree(plan.depth)
            if least < plan.depth:
                if least == 0:
                    plan = RingPlan(0, plan.slot_bytes, "another rank's ring does not fit "
                                    "(the ranks of a split run decline together)")
                else:
                    plan = RingPlan(least, plan.slot_bytes, None, f"-kvpd {self.kv.depth}: another rank's ring "
                                    f"fits only look-ahead {least}, and the ranks of a split run run alike")
        if plan.reason:
            log.warning("pipelined KV transport declined, running ordered: %s", plan.reason)
        elif plan.note:
            log.warning("pipelined KV transport: %s", plan.note)
        return plan

    def describe(self) -> str:
        mode = f"pipelined depth {self.depth}" if self.depth else "ordered"
        out = f"{mode}, ring {self.num_slots} x {self.slot_bytes / MiB:.2f} MiB = {self.ring_bytes / MiB:.2f} MiB"
        if self.resident is not None:
            r = self.resident
            out += (f", chunks 0 .. {r.num_chunks - 1} of every layer resident "
                    f"({r.rows} of {self.spec.ctx} rows, {r.nbytes / MiB:.2f} MiB)")
        return out

    # -- per pass ------------------------------------------------------------------------
    def begin(self, batch):
        super().begin(batch)
        self.compute.begin()
        spec, c = self.spec, self.spec.chunk_rows
        self._nchunks = batch.num_chunks(c)
        # chunks 0 .. nres - 1 are read in place on the device; units are the ferried rest
        self._nres = min(self.resident_chunks, self._nchunks)
        self._nfer = self._nchunks - self._nres
        self._units = spec.num_layers * self._nfer
        pf, self._pf = self._pf, None
        if pf is not None and (pf["key"] == self._pass_key(batch, self._nchunks) or self._unsafe_trust_prefetch):
            # the end of the previous pass guessed this pass: its first units are on the way
            self._unit0, self._issued = pf["unit0"], pf["issued"]
            self.totals["prefetch_hit"] += 1
        else:
            if pf is not None:  # a wrong guess: those units' slots are skipped, their copies unused
                self._unit = pf["unit0"] + pf["issued"]
                self.totals["prefetch_miss"] += 1
            self._unit0 = self._unit  # global index of this pass's unit 0
            self._issued = 0
            pf = None
        self._new = [None] * spec.num_layers
        self._wb_jobs, self._wb_keep = [], []  # this pass's write-backs, submitted by _write_back
        # per ferried chunk: where this pass's new rows land in its slot (at their batch index)
        self._late = [None] * self._nres  # resident chunks get their rows in _store
        self._late += [plan_writes(batch, i * c, (i + 1) * c, False, self.device)
                       for i in range(self._nres, self._nchunks)]
        self._step = dict(early=pf["bytes"] if pf else 0, late=0, writeback=0,
                          resident=self.resident.begin(batch) if self.resident is not None else 0)
        self._t0 = time.perf_counter()
        for q in self.lanes:
            q.timing = self.kv.debug >= 2
        self._copy0 = self._copy_seconds() if self.kv.debug >= 2 else 0.0
        while self._issued < min(self.depth, self._units):
            self._issue_next()
        if self.steps and not self._unsafe_skip_wb:
            # the model may encode this pass's rows into the buffers the previous pass's
            # write-backs read from (CUDA graph outputs): compute waits for those copies
            self.compute.wait(self.wb_done[(self.steps - 1) % 2])

    def _issue_next(self):
        self._step["early"] += self._issue(self.batch, self._nfer, self._unit0, self._issued)
        self._issued += 1

    def _issue(self, batch, nfer: int, unit0: int, u: int) -> int:
        """Deliver unit u (layer, ferried chunk) of a pass with nfer ferried chunks per layer:
        each sequence's stable rows of that chunk into the unit's slot. Returns the bytes sent."""
        layer, i = divmod(u, nfer)
        i += self.resident_chunks  # the ferried chunks follow the resident ones
        slot = (unit0 + u) % self.num_slots
        c = self.spec.chunk_rows
        jobs, sent = [], 0
        for j, (s, start) in enumerate(zip(batch.seq_ids, batch.starts)):
            n = min(start, (i + 1) * c) - i * c  # stable rows of this chunk
            if n <= 0:
                continue
            r0 = i * c
            jobs.append((self._skv[slot][j][:n], self._hkv[layer][s][r0:r0 + n]))  # K and V: contiguous
            sent += 2 * n * self.spec.num_kv_heads * self.spec.row_bytes
        waits = [] if self._unsafe_early_recycle else [self.release[slot]]
        if u == 0 and self.steps and not self._unsafe_skip_wb:  # the previous pass's rows are read from here on
            waits.append(self.wb_done[(self.steps - 1) % 2])
        self.deliver.submit(jobs, waits, self.ready[slot])
        return sent

    @staticmethod
    def _pass_key(batch, nchunks: int):
        # which rows a pass's units deliver depends only on these (not on the new-token counts)
        return tuple(batch.seq_ids), tuple(batch.starts), nchunks

    def _prefetch_next(self, batch) -> None:
        """Guess the next pass (the same sequences, one token each, starting where this one
        ended, as in decode) and issue its first units now, one per slot. Without this the
        link idles from the last delivery of a pass until the host has sampled and started
        the next pass; with it, the copies run under the last layers' compute, the sampling
        and the start of the next pass, which at short contexts take longer than `depth`
        units' copies (a 4k unit of an 8B shape is 0.3 ms of link). The slots are free: all
        of this pass's units have been enqueued, so every slot's release is recorded (the
        copies wait on it). A wrong guess costs only those copies (begin() skips them)."""
        nxt = Batch(list(batch.seq_ids), list(batch.ends), [1] * len(batch.seq_ids))
        if max(nxt.ends) > self.spec.ctx:
            return
        nchunks = nxt.num_chunks(self.spec.chunk_rows)
        nfer = max(0, nchunks - self.resident_chunks)
        n = min(self.num_slots, self.spec.num_layers * nfer)
        sent = sum(self._issue(nxt, nfer, self._unit, u) for u in range(n))
        self._pf = dict(key=self._pass_key(nxt, nchunks), unit0=self._unit, issued=n, bytes=sent)

    def _drop_prefetch(self) -> None:
        if self._pf is not None:
            self._unit = self._pf["unit0"] + self._pf["issued"]
            self.totals["prefetch_miss"] += 1
            self._pf = None

    def _store(self, layer, kq, vq, static=False):
        # (N, H, row_bytes) codes on the device: kept for the slot writes, and copied back
        # (all of them: host memory stays the complete copy, resident rows included)
        self._new[layer] = (kq, vq)
        if self.resident is not None:
            self.resident.store(layer, kq, vq)
        jobs, b, hkv = self._wb_jobs, self.batch, self._hkv[layer]
        if len(b.seq_ids) == 1 and b.ends[0] - b.starts[0] == 1:  # one decode row: its K and its V
            h = hkv[b.seq_ids[0]][b.starts[0]]
            jobs += [(h[0], kq[0]), (h[1], vq[0])]
        else:
            for j, (s, start, end) in enumerate(zip(b.seq_ids, b.starts, b.ends)):
                o0, o1 = b.offsets[j], b.offsets[j + 1]
                if end - start == 1:
                    jobs += [(hkv[s][start, 0], kq[o0]), (hkv[s][start, 1], vq[o0])]
                else:  # rows interleaved here, on the device, so the copy back is one run of bytes
                    kv = torch.stack((kq[o0:o1], vq[o0:o1]), 1)
                    jobs.append((hkv[s][start:end], kv))
                    self._wb_keep.append(kv)
        self._step["writeback"] += 2 * kq.numel()
        if not static:  # an eager pass's rows: copied now, so their memory is not held to the end
            self._wb_keep += [kq, vq]
            self._write_back()
        elif layer == self.spec.num_layers - 1:
            self._write_back()

    def _write_back(self):
        """The write-backs gathered so far as one job. A CUDA graph pass (decode) makes one per
        pass, once the last layer's rows exist (the earlier layers' exist by then too): per
        layer, a submit and its events cost more host time than its two small copies. The next
        pass's first delivery waits for them (begin)."""
        if not self._wb_jobs:
            return
        # the copy side must not read the rows before the compute side has produced them
        self.compute.record(self.rows_written)
        # static buffers (CUDA graph outputs) are never freed, and the next pass waits for
        # these copies before overwriting them (begin()); other tensors are kept from reuse
        self.writeback.submit(self._wb_jobs, [self.rows_written], self.wb_done[self.steps % 2], keep=self._wb_keep)
        self._wb_jobs, self._wb_keep = [], []

    def _slots(self, layer):
        """Per chunk of the layer: (chunk index, slot), once the slot holds the chunk (its
        delivery waited for, this pass's rows written into it); the slot's release is
        recorded when the caller resumes, after it has enqueued every read of the slot."""
        for k in range(self._nfer):
            u, i = layer * self._nfer + k, self._nres + k
            # unit u + depth goes out now, after unit u - 1's compute was enqueued
            while self._issued <= min(u + self.depth, self._units - 1):
                self._issue_next()
            slot = (self._unit0 + u) % self.num_slots
            if not self._unsafe_skip_ready:
                self.compute.wait(self.ready[slot])
            self._write_late(layer, i, slot)
            yield i, slot
            self.compute.record(self.release[slot])
        self._new[layer] = None

    def _write_late(self, layer, i, slot):
        kq, vq = self._new[layer]
        plan = self._late[i]
        if self._memcpy is not None and isinstance(plan, list) and kq.is_contiguous() and vq.is_contiguous():
            rows = self._copy_late(plan, slot, kq, vq)
        else:
            rows = write_rows(self.slot_k[slot], self.slot_v[slot], plan, kq, vq)
        self._step["late"] += 2 * rows * self.spec.num_kv_heads * self.spec.row_bytes

    def _copy_late(self, plan, slot, kq, vq) -> int:
        """write_rows' slice copies as runtime calls on the compute stream, from addresses: per
        layer and step, torch's two copy_ and the views they take were the largest host cost
        of a 4k host pass after the ring's own copies (docs/results.md, "Host time of a 4k
        pass"). Same copies, same bytes."""
        base, (entry, row, kv) = self._slot_ptr[slot], self._slot_strides
        kp, vp, stream, rows, mc = kq.data_ptr(), vq.data_ptr(), self.compute.handle, 0, self._memcpy
        for d, a, b, o in plan:
            # rows of a slot are 2 * kv bytes apart, the pass's rows kv bytes (a decode row: a plain copy)
            dst = base + d * entry + a * row
            mc.rows(dst, row, kp + o * kv, kv, kv, b - a, stream)
            mc.rows(dst + kv, row, vp + o * kv, kv, kv, b - a, stream)
            rows += b - a
        return rows

    def window(self, layer):
        b, c = self.batch, self.spec.chunk_rows
        for i in range(self._nres):  # in place, as the device-resident cache yields them
            yield chunk_view(self.resident.k[layer], self.resident.v[layer], b.seq_ids, b.ends, i, c)
        entries = range(len(b.ends))  # a slot holds chunk i of every batch entry, at its batch index
        for i, slot in self._slots(layer):
            yield chunk_view(self.slot_k[slot], self.slot_v[slot], entries, b.ends, i, c, row0=i * c)

    def code_spans(self, layer):
        if self._nres:  # the resident chunks: one span, one launch, as the device cache's
            yield self.resident.span(layer, self._nres)
        for i, slot in self._slots(layer):  # a slot holds chunk i of every batch entry
            yield CodeSpan(i, 1, self.slot_k[slot], self.slot_v[slot], False)

    def end(self):
        batch = self.batch
        self._write_back()  # a pass that stopped before its last layer
        super().end()
        self._unit += self._units
        self.steps += 1
        if self.depth and not self._unsafe_early_recycle:
            self._prefetch_next(batch)
        for k, v in self._step.items():
            self.totals[k] += v
        if self.kv.debug:
            st = self._step
            read = st["resident"] + st["early"] + st["late"]  # the KV bytes attention reads this step
            msg = (f"kv step {self.steps}: ferried {st['early'] / 1024:.1f} KiB early, resident "
                   f"{st['resident'] / 1024:.1f} KiB ({100 * st['resident'] / max(1, read):.0f}% of the KV read in "
                   f"place), late {st['late'] / 1024:.1f} KiB, write-back {st['writeback'] / 1024:.1f} KiB")
            if self.link_gbps:  # the step's bound: max(device step, ferried bytes / link)
                msg += (f", bound max(device step, {st['early'] / self.link_gbps / 1e6:.3f} ms = ferried / "
                        f"{self.link_gbps:.1f} GB/s)")
            msg += f"; {self.describe()}, declines {1 if self.decline_reason else 0}"
            if self.kv.debug >= 2:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                wall = (time.perf_counter() - self._t0) * 1e3
                copy = (self._copy_seconds() - self._copy0) * 1e3
                msg += f"; step {wall:.2f} ms, copies busy {copy:.2f} ms, the rest {wall - copy:.2f} ms"
            log.info(msg)

    # -- host writes -----------------------------------------------------------------------
    def reset(self, seq_id):
        # the sequence's cells are about to be rewritten: deliveries still reading them finish first
        self.fence()
        self._drop_prefetch()
        super().reset(seq_id)

    def truncate(self, seq_id, n):
        self._drop_prefetch()
        super().truncate(seq_id, n)

    def write_host_rows(self, layer, seq_id, start, kq, vq):
        """Write encoded rows straight into host memory (bench depth fill); waits for copies in flight."""
        self.fence()
        self._drop_prefetch()
        n = kq.shape[0]
        self.host_k[layer][seq_id, start:start + n].copy_(kq)
        self.host_v[layer][seq_id, start:start + n].copy_(vq)
        if self.resident is not None:
            self.resident.write_rows(layer, seq_id, start, kq.to(self.device), vq.to(self.device))

    def _copy_seconds(self) -> float:
        return sum(q.busy_seconds() for q in self.lanes)

    def close(self):
        self.fence()
        if self.pinned:
            for q in self.lanes:
                q.close()
        elif self._own_staged is not None:
            self._own_staged.close()
        self._unpin()

    def stats(self):
        return dict(mode="pipelined" if self.depth else "ordered", depth=self.depth,
                    ring_mib=round(self.ring_bytes / MiB, 2), slots=self.num_slots,
                    declined=self.decline_reason or "no", early_mib=round(self.totals["early"] / MiB, 2),
                    late_kib=round(self.totals["late"] / 1024, 1), writeback_kib=round(self.totals["writeback"] / 1024, 1),
                    prefetch_hits=self.totals["prefetch_hit"], prefetch_misses=self.totals["prefetch_miss"],
                    resident_chunks=self.resident_chunks,
                    resident_mib=round(self.resident.nbytes / MiB, 2) if self.resident is not None else 0.0,
                    resident_read_mib=round(self.totals["resident"] / MiB, 2))
