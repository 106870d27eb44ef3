"""Each tensor's L2 norm, as `torch._foreach_norm` gives it, with large host tensors on several threads.

On the host `torch._foreach_norm` is a loop of `torch.linalg.vector_norm`, one tensor after the
other, and the norm of a contiguous tensor runs on one thread whatever `torch.get_num_threads()`
says. With the optimizer state offloaded the gradients are host tensors, and the norms the clip
and the non-finite check need were most of a step's update: 1.29 s of a 2.81B model's 2.1 s
update on a 16-core GPU host (benchmarks/RESULTS.md), where DeepSpeed takes its norms on the
device. Here the large contiguous tensors' norms run side by side on up to
`torch.get_num_threads()` threads (each call releases the GIL), so memory bandwidth, not one
core, bounds them. Each norm is still one `vector_norm` of one whole tensor: the values are
`_foreach_norm`'s, bit for bit.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

PARALLEL_MIN = 1 << 20  # elements: a smaller tensor's norm is quicker than handing it to a thread


@functools.lru_cache(maxsize=4)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fz-norm")


def norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """[torch.linalg.vector_norm(t) for t in tensors], the same values as `torch._foreach_norm(tensors, 2)`."""
    # contiguous only: a strided tensor's norm may use the intra-op threads, whose count a pool
    # thread keeps from its first call (and so could differ from this thread's)
    big = [i for i, t in enumerate(tensors)
           if t.device.type == "cpu" and t.numel() >= PARALLEL_MIN and t.is_contiguous()]
    threads = min(torch.get_num_threads(), len(big))
    if threads < 2:
        return list(torch._foreach_norm(list(tensors), 2)) if tensors else []
    out: list[Tensor | None] = [None] * len(tensors)
    done = _pool(threads).map(lambda i: torch.linalg.vector_norm(tensors[i], 2), big)
    taken = set(big)
    rest = [i for i in range(len(tensors)) if i not in taken]
    if rest:
        for i, n in zip(rest, torch._foreach_norm([tensors[i] for i in rest], 2)):
            out[i] = n
    for i, n in zip(big, done):
        out[i] = n
    return out  # type: ignore[return-value]  # every slot filled above
