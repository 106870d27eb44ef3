"""Gradient reduction for replicated buckets, launched from backward as soon as a bucket is final.

Which collective and when comes from the bucket's placements (see fz/sharding/plan.py):
grad Shard(0) -> reduce-scatter after every micro-batch, summed into a shard accumulator;
grad Replicate -> accumulate in full, then one all-reduce (optimizer Replicate) or
reduce-scatter (optimizer Shard(0)) in the last micro-batch. These run within the shard
group; on a 2-D mesh the step's accumulated result is then averaged across the groups
(one all-reduce per bucket of what the optimizer reads: `reduce_across_replicas`). Sharded-parameter buckets
(stage 3) send their gradients from the gather's backward (`reduce_gathered`): an
asynchronous reduce-scatter after every micro-batch. At most MAX_INFLIGHT reductions are in
flight, so full-size gradient buffers never pile up.

With the optimizer state offloaded (`host`: fz/offload/host_grads.py) every bucket is
reduced after every micro-batch, each result is copied to the host as soon as its
reduction is done and its device buffer released: the device holds no gradient storage
between buckets, and the step's gradients are fp32 host buffers.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.offload.host_grads import HostGrads
from fz.sharding.buckets import Bucket
from fz.sharding.comm import Comm, full_views, pack, shard_views
from fz.sharding.plan import ShardPlan
from fz.storage.scratch import SCRATCH

MAX_INFLIGHT = 2  # buckets whose reduction may be in flight at once (bounds gradient memory)


class GradReducer:
    def __init__(self, plan: ShardPlan, comm: Comm, leaves: Sequence[Tensor], host: HostGrads | None = None):
        self.plan, self.comm, self.leaves, self.host = plan, comm, leaves, host
        self.buckets = [b for b in plan.buckets if b.trainable and not b.sharded_param]
        self.sharded = [b for b in plan.buckets if b.trainable and b.sharded_param]
        self.last = False
        self.launched: set[int] = set()
        self.pending: list[tuple] = []
        self.acc: dict[int, Tensor] = {}
        self.layout: dict[int, str] = {}  # "full" (param-major) or "shard" (this rank's padded rows)
        self.handles = [leaves[b.index].register_post_accumulate_grad_hook(partial(self._hook, b))
                        for b in self.buckets]

    def _due(self, b: Bucket) -> bool:
        return self.host is not None or isinstance(b.place.grad, Shard) or self.last

    def _hook(self, b: Bucket, leaf: Tensor) -> None:
        if self._due(b):
            assert leaf.grad is not None  # the hook runs once it is accumulated
            self._launch(b, leaf.grad)
            leaf.grad = None

    def reduce_gathered(self, b: Bucket, grads: Sequence[Tensor]) -> None:
        """Stage 3: the gathered parameters' gradients -> an async reduce-scatter to this rank's shard."""
        self.launched.add(b.index)
        comm = self.comm
        dtype = self.leaves[b.index].dtype
        if comm.world == 1:
            self.pending.append((b, pack(grads, b, dtype, grads[0].device), None, dtype, "shard"))
        else:
            out = SCRATCH.empty(b.shard_numel, comm.reduce_dtype, grads[0].device)
            self.pending.append((b, out, comm.reduce_scatter_params(out, grads, b, async_op=True), dtype, "shard"))
        self._bound()

    def _bound(self) -> None:
        """Wait for the oldest reductions while too many hold a buffer of their own. An in-place
        all-reduce of a replicated gradient holds nothing extra: it never makes backward wait."""
        while sum(self._extra(item) for item in self.pending) > MAX_INFLIGHT:
            oldest = next(i for i, item in enumerate(self.pending) if self._extra(item))
            self._finish(*self.pending.pop(oldest))
        if self.host is not None:  # leave the device now: what needs no wait goes at once
            while self.pending and (self.pending[0][2] is None or len(self.pending) > MAX_INFLIGHT):
                self._finish(*self.pending.pop(0))

    def _extra(self, item) -> bool:
        b, out, work, dtype, layout = item
        return work is not None and not (layout == "full" and out.dtype == dtype)

    def _finish(self, b: Bucket, out: Tensor, work, dtype, layout: str) -> None:
        if work is not None:
            work.wait()
        if self.host is not None:
            self.layout[b.index] = layout
            if self.comm.replicas > 1:  # 2-D mesh: averaged across groups on the device, per micro-batch
                self.comm.replica_mean(out)
            self.host.add(b.index, out)
            return
        # between micro-batches a gradient is kept in the parameters' dtype (ZeRO's 2 bytes in
        # mixed precision); the last micro-batch's sum stays in the reduce dtype when that is
        # wider, so the optimizer reads it without a round trip through bf16/fp16
        keep = torch.promote_types(dtype, out.dtype) if self.last else dtype
        out = out.to(keep)
        self.layout[b.index] = layout
        prev = self.acc.get(b.index)
        if prev is None:
            self.acc[b.index] = out
        elif prev.dtype == out.dtype:
            prev.add_(out)
        else:
            self.acc[b.index] = out.add_(prev)

    def _launch(self, b: Bucket, g: Tensor) -> None:
        """Start the bucket's collective, in the reduce dtype (`_finish` says which dtype the result keeps)."""
        self.launched.add(b.index)
        comm = self.comm
        sharded_opt = isinstance(b.place.opt, Shard)
        if comm.world == 1:
            self.pending.append((b, g, None, g.dtype, "shard" if sharded_opt else "full"))
        elif sharded_opt:
            out = SCRATCH.empty(b.shard_numel, comm.reduce_dtype, g.device)
            work = comm.reduce_scatter_params(out, full_views(g, b), b, async_op=True)
            self.pending.append((b, out, work, g.dtype, "shard"))
        else:  # all-reduce in place
            red = g if g.dtype == comm.reduce_dtype else g.to(comm.reduce_dtype)
            self.pending.append((b, red, comm.all_reduce(red, async_op=True), g.dtype, "full"))
        self._bound()

    def current(self, b: Bucket) -> tuple[Tensor, str] | None:
        """Bucket `b`'s gradient as it stands between micro-batches: (flat, layout), the layout
        "local" (this rank's sum so far, not reduced: full layout), "full" (reduced, whole) or
        "shard" (reduced, this rank's padded rows); None before any reached it. Read, never written."""
        leaf = self.leaves[b.index]
        if leaf.grad is not None:
            return leaf.grad, "local"
        acc = self.host.acc if self.host is not None else self.acc
        return (acc[b.index], self.layout[b.index]) if b.index in acc else None

    def reached(self) -> bool:
        """Whether this micro-batch's backward reached any trainable bucket (launched, or accumulating)."""
        return bool(self.launched) or bool(self.pending) or any(self.leaves[b.index].grad is not None
                                                                for b in self.buckets)

    def end_micro_batch(self) -> None:
        """Launch what backward did not reach (unused parameters), then wait and accumulate."""
        for b in self.buckets:
            if self._due(b) and b.index not in self.launched:
                leaf = self.leaves[b.index]
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                leaf.grad = None
                self._launch(b, g)
        for b in self.sharded:
            if b.index not in self.launched:
                leaf = self.leaves[b.index]
                zeros = [torch.zeros(s.shape, dtype=leaf.dtype, device=leaf.device) for s in b.slots]
                self.reduce_gathered(b, zeros)
        for item in self.pending:
            self._finish(*item)
        self.pending.clear()
        self.launched.clear()
        if self.host is not None:
            self.host.drain()

    def reduce_across_replicas(self) -> None:
        """2-D mesh: average each bucket's reduced gradient across the replica groups (once per
        step, on the sum over micro-batches: the average is linear)."""
        if self.comm.replicas == 1 or self.host is not None:  # host gradients were averaged as they left
            return
        works = [self.comm.replica_mean(self.acc[b.index], async_op=True) for b in (*self.buckets, *self.sharded)]
        for w in works:
            w.wait()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def dispose(self) -> None:
        """Drop every reference to gradients and leaves now (hooks make reference cycles
        that the garbage collector would free only later, holding a model's worth of grads)."""
        self.close()
        self.acc.clear()
        self.pending.clear()
        self.leaves = ()

    def optimizer_grads(self, b: Bucket) -> list[Tensor]:
        """The reduced gradient of each parameter of `b`, shaped like its optimizer state."""
        g = self.host.acc[b.index] if self.host is not None else self.acc[b.index]
        if self.layout[b.index] == "shard":
            return shard_views(g, b, self.plan.shard_rank)
        return full_views(g, b)
