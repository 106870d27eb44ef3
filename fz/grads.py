"""Gradient reduction for replicated buckets, launched from backward as soon as a bucket is final.

Which collective and when comes from the bucket's placements (see fz/sharding/plan.py):
grad Shard(0) -> reduce-scatter after every micro-batch, summed into a shard accumulator;
grad Replicate -> accumulate in full, then one all-reduce (optimizer Replicate) or
reduce-scatter (optimizer Shard(0)) in the last micro-batch. Sharded-parameter buckets
(stage 3) reduce inside the gather's backward instead and need nothing here.
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Sequence, Set

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.sharding.comm import full_views, pack, shard_views
from fz.sharding.layout import ShardPlan
from fz.sharding.plan import Bucket


class GradReducer:
    def __init__(self, plan: ShardPlan, leaves: Sequence[Tensor]):
        self.plan, self.leaves = plan, leaves
        self.buckets = [b for b in plan.buckets if b.trainable and not b.sharded_param]
        self.last = False
        self.launched: Set[int] = set()
        self.pending: List[tuple] = []
        self.acc: Dict[int, Tensor] = {}
        self.handles = [leaves[b.index].register_post_accumulate_grad_hook(partial(self._hook, b))
                        for b in self.buckets]

    def _due(self, b: Bucket) -> bool:
        return isinstance(b.place.grad, Shard) or self.last

    def _hook(self, b: Bucket, leaf: Tensor) -> None:
        if self._due(b):
            self._launch(b, leaf.grad)
            leaf.grad = None

    def _launch(self, b: Bucket, g: Tensor) -> None:
        """Start the bucket's collective, in the reduce dtype (the result returns to g's dtype)."""
        self.launched.add(b.index)
        comm = self.plan.comm
        if comm.world == 1:
            self.pending.append((b, g, None, None))
        elif isinstance(b.place.opt, Shard):
            buf = pack(full_views(g, b), b, comm.reduce_dtype, g.device)
            out = torch.empty(b.shard_numel, dtype=comm.reduce_dtype, device=g.device)
            self.pending.append((b, out, comm.reduce_scatter(out, buf, async_op=True), g.dtype))
        else:
            red = g if g.dtype == comm.reduce_dtype else g.to(comm.reduce_dtype)
            self.pending.append((b, red, comm.all_reduce(red, async_op=True), g.dtype))

    def end_micro_batch(self) -> None:
        """Launch what backward did not reach (unused parameters), then wait and accumulate."""
        for b in self.buckets:
            if self._due(b) and b.index not in self.launched:
                leaf = self.leaves[b.index]
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                leaf.grad = None
                self._launch(b, g)
        for b, out, work, dtype in self.pending:
            if work is not None:
                work.wait()
                out = out.to(dtype)
            self.acc[b.index] = out if b.index not in self.acc else self.acc[b.index].add_(out)
        self.pending.clear()
        self.launched.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def optimizer_grads(self, b: Bucket) -> List[Tensor]:
        """The reduced gradient of each parameter of `b`, shaped like its optimizer state."""
        if b.sharded_param:
            g = self.leaves[b.index].grad
            if g is None:
                g = torch.zeros_like(self.leaves[b.index])
            return shard_views(g, b, self.plan.rank)
        g = self.acc[b.index]
        if isinstance(b.place.opt, Shard):
            return shard_views(g, b, self.plan.rank)
        return full_views(g, b)

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.acc.values())
