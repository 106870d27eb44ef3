"""Backward's weight gradients computed into fz's host buffer pool, not into fresh memory.

Where fz pins glibc's mmap threshold (the disk tier's store: fz/storage/store.py) every
large CPU tensor is a fresh mapping, which the kernel faults in and zeroes on first write.
fz's own buffers come from its pool (fz/storage/scratch.py); the largest tensors a step
makes that fz does not allocate are autograd's: each weight gradient, as big as its
parameter, lives only until its bucket's reduction packs it. On the 2.5B NVMe headline
they were most of the page zeroing left (benchmarks/RESULTS.md).

`pooled_backward()` is a dispatch mode fz holds around its own `loss.backward()`: a
matrix product (`mm`, what a linear layer's weight gradient is) whose result is large,
on the CPU and no larger than the largest buffer the pool keeps (the step's buckets: so
neither the pool's idle bound nor fz.estimate's grows) is computed by the same kernel into
a pool buffer (`mm.out`), which the next block's gradients take again once the reduction
has let go of it. Every other op runs unchanged. (An embedding's gradient is not served:
its `out=` form computes into fresh memory and copies.)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fz.storage.scratch import SCRATCH, SMALL

aten = torch.ops.aten


def _pooled(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor | None:
    """A pool buffer for a `shape` result of `like`'s dtype, or None where plain memory serves."""
    numel = shape[0] * shape[1]
    if like.device.type != "cpu" or numel * like.element_size() < SMALL or not SCRATCH.within_kept(numel, like.dtype):
        return None
    return SCRATCH.empty(numel, like.dtype).view(shape)


class _PooledBackward(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is aten.mm.default and not kwargs:
            a, b = args
            out = _pooled((a.shape[0], b.shape[1]), a) if a.dtype == b.dtype else None
            if out is not None:
                return aten.mm.out(a, b, out=out)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def pooled_backward(device: torch.device | str = "cpu", compiled: bool = False) -> Iterator[None]:
    """Around `loss.backward()` on `device`: large gradients into the pool while it is on (the disk
    tier's store turns it on) and the step runs on the CPU; nothing otherwise, so no dispatch cost
    where glibc's heap reuses memory or where a GPU's caching allocator already does. Not with
    compiled blocks (`compiled`): under a Python dispatch mode torch.compile would not compile
    a checkpointed block's recompute, which must match its compiled forward."""
    if not SCRATCH.enabled or torch.device(device).type != "cpu" or compiled:
        yield
        return
    with _PooledBackward():
        yield
