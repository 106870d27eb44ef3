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
At most `KEEP` buffers of each size are kept; past that, plain memory. `trim` lets go of the
idle ones: the step calls it between its phases (before backward, before the update, at its
end), so kept buffers do not add to a phase's peak (a buffer is then mapped afresh once per
phase, not once per use). It serves the buffers that live for one collective: the
reductions' outputs and receive buffers and the all-gathers' outputs. Those that outlive one
(the gathered parameters, the packed gradients, the shards read from disk, the host
gradients) stay plain memory: kept idle, they were measured to add 4-10% to the NVMe step's
peak (tests/multirank/test_planning.py holds it to the estimate).
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

KEEP = 6  # buffers kept per (size, dtype): a step's gathers in flight, its reductions, its reads


def _sole(t: Tensor) -> bool:
    """Whether only the pool holds `t`: the pool hands out views only, so any tensor still using
    the buffer (a view, autograd's saved copy of one, a collective's) shares its storage."""
    return (t._use_count() == 1  # type: ignore[attr-defined]  # torch: private, no stub
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2)  # t's impl + this temporary


class Scratch:
    def __init__(self, enabled: bool = False) -> None:
        self.kept: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        self.lock = threading.Lock()
        self.enabled = enabled and hasattr(torch._C, "_storage_Use_Count")

    def enable(self) -> None:
        """Reuse from now on: called where fz pins glibc's mmap threshold (the disk tier's store),
        which makes every large buffer a fresh mapping. Without that pin glibc's heap already
        reuses freed memory, and this pool only cost time: a stage-2 bf16 step measured 6-10%
        slower with it on (benchmarks/RESULTS.md)."""
        self.enabled = hasattr(torch._C, "_storage_Use_Count")

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """An uninitialised 1-D buffer: a free kept one on the CPU, else new memory."""
        device = torch.device(device)
        if device.type != "cpu" or not self.enabled or numel < (1 << 18):
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype)
        with self.lock:
            kept = self.kept.setdefault(key, [])
            for t in kept:
                if _sole(t):
                    return t.view(-1)  # a view: while it lives, the pool's buffer is not sole
            fresh = torch.empty(numel, dtype=dtype)
            if len(kept) < KEEP:
                kept.append(fresh)
                return fresh.view(-1)
            return fresh

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        return self.empty(numel, dtype, device).zero_()

    def trim(self) -> None:
        """Let go of every kept buffer nobody uses now (between a step's phases: the update needs
        none of backward's, and idle buffers must not add to its peak)."""
        with self.lock:
            for key, kept in list(self.kept.items()):
                kept[:] = [t for t in kept if not _sole(t)]
                if not kept:
                    del self.kept[key]

    @property
    def kept_bytes(self) -> int:
        with self.lock:
            return sum(t.numel() * t.element_size() for ts in self.kept.values() for t in ts)

    def clear(self) -> None:
        with self.lock:
            self.kept.clear()


SCRATCH = Scratch()
