"""Backward's weight gradients computed into fz's host buffer pool, not into fresh memory.

Where fz pins glibc's mmap threshold (the disk tier's store: fz/storage/store.py) every
large CPU tensor is a fresh mapping, which the kernel faults in and zeroes on first write.
fz's own buffers come from its pool (fz/storage/scratch.py); the largest tensors a step
makes that fz does not allocate are autograd's: each weight gradient, as big as its
parameter, lives only until its bucket's reduction packs it. On the 2.5B NVMe headline
they were most of the page zeroing left (benchmarks/RESULTS.md).

`pooled_backward()` is a dispatch mode fz holds around its own `loss.backward()`: a
matrix product (`mm`, what a linear layer's weight gradient is) or an embedding's
gradient whose result is large and on the CPU is computed by the same kernel into a pool
buffer (its `out=` form), which the next block's gradients take again once the reduction
has let go of it. Every other op runs unchanged.
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
    if like.device.type != "cpu" or shape[0] * shape[1] * like.element_size() < SMALL:
        return None
    return SCRATCH.empty(shape[0] * shape[1], like.dtype).view(shape)


class _PooledBackward(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not kwargs:
            if func is aten.mm.default:
                a, b = args
                out = _pooled((a.shape[0], b.shape[1]), a) if a.dtype == b.dtype else None
                if out is not None:
                    return aten.mm.out(a, b, out=out)
            elif func is aten.embedding_dense_backward.default:
                grad, indices, num_weights, padding_idx, by_freq = args
                out = _pooled((num_weights, grad.shape[-1]), grad)
                if out is not None:
                    return aten.embedding_dense_backward.out(grad, indices, num_weights, padding_idx, by_freq,
                                                             out=out)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def pooled_backward(device: torch.device | str = "cpu") -> Iterator[None]:
    """Around `loss.backward()` on `device`: large gradients into the pool while it is on (the disk
    tier's store turns it on) and the step runs on the CPU; nothing otherwise, so no dispatch cost
    where glibc's heap reuses memory or where a GPU's caching allocator already does."""
    if not SCRATCH.enabled or torch.device(device).type != "cpu":
        yield
        return
    with _PooledBackward():
        yield
