"""Stage 3's just-in-time parameters: all-gather in forward, reduce-scatter in backward.

`gather_bucket(shard)` is differentiable: the gradient of the gathered parameters is
reduce-scattered (averaged over ranks) straight back onto the local shard. Wrapped in
a non-reentrant checkpoint per block, the gathered tensors are freed as soon as the
block's forward ends and gathered again when its backward recomputes it.
"""
from __future__ import annotations

import weakref
from typing import List, Tuple

import torch
from torch import Tensor

from fz.sharding.comm import Comm, pack, unpack
from fz.sharding.plan import Bucket


class LiveCounter:
    """How many gathered buckets (and elements) are alive now, and the most ever seen."""

    def __init__(self) -> None:
        self.buckets = self.elements = 0
        self.max_buckets = self.max_elements = 0

    def reset_max(self) -> None:
        self.max_buckets, self.max_elements = self.buckets, self.elements

    def track(self, tensors: Tuple[Tensor, ...], numel: int) -> None:
        self.buckets += 1
        self.elements += numel
        self.max_buckets = max(self.max_buckets, self.buckets)
        self.max_elements = max(self.max_elements, self.elements)
        left = [len(tensors)]

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.buckets -= 1
                self.elements -= numel

        for t in tensors:
            weakref.finalize(t, release)


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: Tensor, bucket: Bucket, comm: Comm, live: LiveCounter):
        ctx.bucket, ctx.comm = bucket, comm
        if comm.world == 1:
            outs = tuple(t.clone() for t in unpack(shard, bucket))
        else:
            full = torch.empty(bucket.padded_numel, dtype=shard.dtype, device=shard.device)
            comm.all_gather(full, shard)
            outs = tuple(unpack(full, bucket))
            del full
        live.track(outs, bucket.full_numel)
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor):
        bucket, comm = ctx.bucket, ctx.comm
        buf = pack(grads, bucket, grads[0].dtype if grads[0] is not None else torch.float32, _device(grads))
        if comm.world == 1:
            return buf, None, None, None
        out = torch.empty(bucket.shard_numel, dtype=buf.dtype, device=buf.device)
        comm.reduce_scatter(out, buf)
        return out, None, None, None


def _device(grads) -> torch.device:
    return next(g.device for g in grads if g is not None)


def gather_bucket(shard: Tensor, bucket: Bucket, comm: Comm, live: LiveCounter) -> List[Tensor]:
    """The bucket's full parameters, gathered from every rank's shard (differentiable)."""
    return list(_GatherBucket.apply(shard, bucket, comm, live))
