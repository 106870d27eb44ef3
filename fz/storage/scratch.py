"""Host buffers reused step after step, instead of fresh memory for every one.

A CPU step allocates its large buffers anew each time, and glibc maps every one of them
fresh (fz pins its mmap threshold: fz/storage/store.py): each first write of each 4 KiB page
is a page fault, in the kernel (where fz has not pinned it, glibc's heap reuses freed memory
itself, and this pool stays off: `enable`). On the 2.5B NVMe headline that was most of the
CPU time (benchmarks/RESULTS.md). On CUDA the caching allocator already reuses device memory; host
memory has no such allocator, so this is one, for the buffers fz allocates itself.

`empty` hands out a buffer that nobody else holds any more: the pool keeps every buffer it
made and hands out views of it, and one is free again when no tensor but the pool's own
shares its storage (no view, whoever holds it: Python, autograd, gloo), checked when it is
taken. So nothing is ever given back by hand and a buffer still in use is never reused.
It serves the step's large host buffers: the reductions' inputs, outputs and receive buffers,
the all-gathers' outputs, the gathered parameters and the shards read from disk.

Kept idle, buffers add to the peak, so their bytes are bounded: before new memory is mapped,
idle buffers beyond IDLE_CAP times the largest kept one are let go, the sizes asked for least
recently first (fz.estimate counts that bound: `pool_idle`). Within the bound they stay from
phase to phase and step to step, since a step asks for the same sizes block after block.
Sizes are bytes rounded up to GRAIN, so one buffer serves any dtype: at world 2 a bucket's
gathered bf16 parameters and its fp32 gradient shard are the same size. An idle buffer up to
FIT times a request serves it too (a block's buckets differ in size). At most `KEEP`
buffers of each size are kept; past that, plain memory. `trim` lets go of every idle one.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

KEEP = 6  # buffers kept per size: a step's gathers in flight, its reductions, its reads
GRAIN = 2 << 20  # kept sizes are multiples of this (a huge page)
SMALL = 1 << 20  # smaller buffers are plain memory
FIT = 1.5  # an idle buffer up to this many times a request's size serves it
IDLE_CAP = 3  # idle kept bytes: at most this many times the largest kept buffer (fz.estimate's `pool_idle`)


def _sole(t: Tensor) -> bool:
    """Whether only the pool holds `t`: the pool hands out views only, so any tensor still using
    the buffer (a view, autograd's saved copy of one, a collective's) shares its storage."""
    return (t._use_count() == 1  # type: ignore[attr-defined]  # torch: private, no stub
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2)  # t's impl + this temporary


class Scratch:
    def __init__(self, enabled: bool = False) -> None:
        self.kept: dict[int, list[Tensor]] = {}  # bytes (a multiple of GRAIN) -> uint8 buffers of that size
        self.lock = threading.Lock()
        self.uses = 0
        self.last_use: dict[int, int] = {}  # size -> when it was last asked for
        self.enabled = enabled and hasattr(torch._C, "_storage_Use_Count")

    def enable(self) -> None:
        """Reuse from now on: called where fz pins glibc's mmap threshold (the disk tier's store),
        which makes every large buffer a fresh mapping. Without that pin glibc's heap already
        reuses freed memory, and this pool only cost time: a stage-2 bf16 step measured 6-10%
        slower with it on (benchmarks/RESULTS.md)."""
        self.enabled = hasattr(torch._C, "_storage_Use_Count")

    @staticmethod
    def size_of(numel: int, dtype: torch.dtype) -> int:
        """The kept size that serves `numel` elements of `dtype`: bytes rounded up to GRAIN, so
        buffers of one size serve every dtype (a step's fp32 shard and bf16 bucket share one)."""
        return -(-numel * dtype.itemsize // GRAIN) * GRAIN

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """An uninitialised 1-D buffer: a free kept one on the CPU, else new memory."""
        device = torch.device(device)
        if device.type != "cpu" or not self.enabled or numel * dtype.itemsize < SMALL:
            return torch.empty(numel, dtype=dtype, device=device)
        size = self.size_of(numel, dtype)
        with self.lock:
            self.uses += 1
            self.last_use[size] = self.uses
            buf = self._idle_fit(size)
            if buf is None:
                self._bound_idle()
                buf = torch.empty(size, dtype=torch.uint8)
                kept = self.kept.setdefault(size, [])
                if len(kept) < KEEP:
                    kept.append(buf)
            # a view: while it lives, the pool's buffer is not sole
            return buf[:numel * dtype.itemsize].view(dtype)

    def within_kept(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether a request is no larger than the largest size kept: serving it from the pool then
        never raises the idle bound (IDLE_CAP times that size), nor fz.estimate's `pool_idle`."""
        with self.lock:
            return self.enabled and self.size_of(numel, dtype) <= max(self.kept, default=0)

    def _idle_fit(self, size: int) -> Tensor | None:
        """The smallest idle kept buffer of `size` to FIT times it (a step's buckets differ in
        size: one block's largest serves its next smaller ones)."""
        for k in sorted(k for k in self.kept if size <= k <= FIT * size):
            for t in self.kept[k]:
                if _sole(t):
                    self.last_use[k] = self.uses
                    return t
        return None

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        return self.empty(numel, dtype, device).zero_()

    def _bound_idle(self) -> None:
        """Before new memory is mapped: idle buffers beyond IDLE_CAP times the largest kept one go,
        the sizes asked for least recently first (a step asks for the same sizes block after
        block: those stay), so kept idle buffers add at most that to the peak."""
        idle = sorted(((size, t) for size, kept in self.kept.items() for t in kept if _sole(t)),
                      key=lambda st: self.last_use.get(st[0], 0))
        cap = IDLE_CAP * max(self.kept, default=0)  # a kept buffer's size is its key (uint8)
        total = sum(size for size, _ in idle)
        for size, t in idle:
            if total <= cap:
                break
            self.kept[size] = [k for k in self.kept[size] if k is not t]
            total -= size
        for size in [k for k, v in self.kept.items() if not v]:
            del self.kept[size]

    def trim(self) -> None:
        """Let go of every kept buffer nobody uses now."""
        with self.lock:
            for size, kept in list(self.kept.items()):
                kept[:] = [t for t in kept if not _sole(t)]
                if not kept:
                    del self.kept[size]

    @property
    def kept_bytes(self) -> int:
        with self.lock:
            return sum(t.numel() * t.element_size() for ts in self.kept.values() for t in ts)

    def clear(self) -> None:
        with self.lock:
            self.kept.clear()


SCRATCH = Scratch()
