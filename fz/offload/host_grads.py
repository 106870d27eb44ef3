"""Reduced gradients leaving the device as they are reduced, when the optimizer state is offloaded.

The optimizer runs where its state lives (host or disk), so a gradient has no use on the
device once its bucket is reduced. Each bucket's reduced result (this rank's shard, or the
whole bucket where the optimizer state is replicated) is copied on the copy stream into a
host buffer (pinned on CUDA) and the device buffer goes back to the allocator once that
copy is done: the device never holds more than the reductions in flight and the copies
behind them (`MAX_COPIES`).

Gradient accumulation adds into the host, micro-batch by micro-batch, in fp32: the first
micro-batch's copy lands in a staging buffer of the reduced dtype and is widened into the
bucket's fp32 buffer; later ones are added to it (DeepSpeed's CPU offload accumulates on
the host the same way). With one micro-batch, or in fp32, the values are exactly those the
in-memory step reads; with several in bf16/fp16 they are closer to the exact sum (the
in-memory step keeps the running sum in the parameters' dtype, ZeRO's 2 bytes).

What the update then reads are these fp32 host buffers: the non-finite check, the
global norm and the clip all run on the host, beside the optimizer.

Each reduced gradient crosses down once per micro-batch in the dtype it was reduced in
(`moved["grads"]`, counted in `add`, where the copy is issued), and is widened to fp32 on the
host: the bus carries the fewest bytes, the host pays one pass (0.55 ns an element on one
core of the CPU machine; benchmarks/widen.py, benchmarks/RESULTS.md "Where gradients are
widened"). Widening on the device doubles the bus's bytes in bf16/fp16 and spares that
pass: on an H200 it took a 2.81B model's backward from 0.55 to 0.34 s with two copies in flight
(`WIDEN`, `MAX_COPIES`; RESULTS.md, "a third time"). The host stays the default: the device
then holds an fp32 copy of each gradient while it leaves (the estimate's 2·L term and the CUDA
peak tests are the bf16 one), to be moved together on a GPU. With `reduce_dtype` fp32 (the
default) at several ranks the reduction itself runs in fp32: they arrive wide already.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from fz.offload.transfer import PinnedPool, Transfer
from fz.sharding.buckets import Bucket

MAX_COPIES = 1  # device-to-host copies in flight beside backward; each holds its device buffer until done
# where a narrow gradient is widened to fp32: "host" (after its copy: 2 bytes an element on the bus,
# a host pass) or "device" (before it: 4 bytes, no host pass; the staging buffer is the fp32 one)
WIDEN: Literal["host", "device"] = "host"
# elements widened at a time into a 4 MiB scratch before an fp32 add: torch's mixed-dtype add
# (fp32 += bf16) runs at 3.0 ns an element on one core of the CPU machine, widen-then-add at
# 0.93-0.97, the same bits (benchmarks/widen.py; RESULTS.md "Where gradients are widened").
# Smaller chunks pay the intra-op pool's start-up more often.
WIDEN_CHUNK = 1 << 20


class HostGrads:
    """One step's gradients on the host: {bucket index: fp32 buffer} filled as buckets are reduced."""

    def __init__(self, pool: PinnedPool, device: torch.device, owner: object | None = None,
                 moved: Counter | None = None):
        self.pool, self.device = pool, device
        self.moved = moved  # the step's device->host bytes by kind (Comm.d2h): gradients count as "grads"
        self.owner = owner  # what the pool keeps plain buffers for (the state's plan): `_kept`
        self.acc: dict[int, Tensor] = {}
        self.copies: deque = deque()  # (index, Transfer, staging buffer or None)
        self.lent: list[Tensor] = []  # pool buffers held by `acc`, given back by `release`
        self.scratch: Tensor | None = None  # WIDEN_CHUNK fp32 elements, made at the first narrow add

    def add(self, index: int, out: Tensor) -> None:
        """Queue `out` (a reduced gradient on the device, this micro-batch's) to be added into
        bucket `index`'s host buffer; `out` may be dropped by the caller at once."""
        if self.device.type == "cuda" and WIDEN == "device" and out.dtype != torch.float32:
            out = out.float()
        if self.moved is not None:
            self.moved["grads"] += out.numel() * out.element_size()
        if self.device.type != "cuda":  # one memory: add straight into the host buffer
            self._accumulate(index, out)
            return
        staging = self.pool.take(out.numel(), out.dtype)
        self.copies.append((index, Transfer(staging, out.reshape(-1)), staging))
        while len(self.copies) > MAX_COPIES:
            self._land(*self.copies.popleft())

    def _land(self, index: int, copy: Transfer, staging: Tensor) -> None:
        if not self._accumulate(index, copy.wait()):
            self.pool.give(staging)

    def _accumulate(self, index: int, g: Tensor) -> bool:
        """Add `g` into bucket `index`'s host buffer; True where `g` (a staging buffer) became that
        buffer, so it must not go back to the pool."""
        g = g.reshape(-1)
        acc = self.acc.get(index)
        if acc is not None:
            self._add(acc, g)
            return False
        if g.dtype == torch.float32 and g.device.type == "cpu" and g.is_pinned() and self.device.type == "cuda":
            self.acc[index] = g  # the staging buffer already is the fp32 host buffer: keep it
            self.lent.append(g)
            return True
        acc = self.pool.take(g.numel(), torch.float32, pin=self.device.type == "cuda")
        acc.copy_(g)
        self.acc[index] = acc
        self.lent.append(acc)
        return False

    def _add(self, acc: Tensor, g: Tensor) -> None:
        """acc += g in fp32; a narrower `g` is widened a chunk at a time (the exact same sums)."""
        if g.dtype == acc.dtype or g.device != acc.device:
            acc.add_(g)
            return
        if self.scratch is None:
            self.scratch = torch.empty(WIDEN_CHUNK, dtype=acc.dtype)
        for lo in range(0, acc.numel(), WIDEN_CHUNK):
            part = acc[lo:lo + WIDEN_CHUNK]
            wide = self.scratch[:part.numel()].copy_(g[lo:lo + WIDEN_CHUNK])
            part.add_(wide)

    def drain(self) -> None:
        """Wait for every copy and add it in: the host buffers are whole when this returns."""
        while self.copies:
            self._land(*self.copies.popleft())

    def hand_over(self) -> None:
        """The update owns the gradients now (it drops each bucket's once updated, even while it
        streams on after the step: fz/step/pending.py); only the buffers the pool keeps (`_kept`)
        stay listed, to go back to it when the update is done; the others (plain host buffers on
        a GPU machine) are freed bucket by bucket."""
        self.drain()
        self.acc.clear()
        self.lent = [t for t in self.lent if self._kept(t)]

    def release(self) -> None:
        """The step is done with its gradients: buffers go back to the pool for the next step."""
        self.drain()
        self.acc.clear()
        for t in self.lent:
            self.pool.give(t, keep_for=self.owner if self._kept(t) else None)
        if self.device.type != "cuda":
            self.pool.keep_only({(t.numel(), t.dtype) for t in self.lent}, self.owner)
        self.lent.clear()

    def _kept(self, t: Tensor) -> bool:
        """Whether `t` goes back to the pool for the next step: pinned ones always; where host and
        device are one memory every one, for as long as the owner lives (the step would otherwise
        map and zero its gradients' memory afresh, most of the NVMe step's kernel time:
        benchmarks/RESULTS.md)."""
        return t.is_pinned() or (self.device.type != "cuda" and self.owner is not None)


def host_grad_numels(buckets: Sequence[Bucket], shards: int) -> list[int]:
    """Elements of each of the step's fp32 host gradient buffers (what `HostGrads.acc` holds at the
    update): this rank's shard of each trainable bucket whose gradient or optimizer state is sharded
    over several ranks, the whole bucket otherwise."""
    from torch.distributed.tensor import Shard
    out = []
    for b in buckets:
        if b.trainable:
            sharded = b.sharded_param or isinstance(b.place.grad, Shard) or isinstance(b.place.opt, Shard)
            out.append(b.shard_numel if sharded and shards > 1 else b.full_numel)
    return out


def host_grad_bytes(buckets: Sequence[Bucket], shards: int) -> int:
    """Bytes of the step's fp32 host gradient buffers: memory_report and fz.estimate both count this."""
    return 4 * sum(host_grad_numels(buckets, shards))


def reserve_host_grads(pool: PinnedPool, buckets: Sequence[Bucket], shards: int) -> None:
    """Pin the step's fp32 host gradient buffers now (fz.init on a GPU), at their exact sizes:
    the first step then finds them in the pool (`PinnedPool.reserve`)."""
    pool.reserve([(n, torch.float32) for n in host_grad_numels(buckets, shards)])
