"""Stages 1 and 2: bringing replicated parameters up to date after a sharded update.

Each rank's optimizer updates only its rows, so after the step every rank all-gathers
the buckets. Waiting for that at the end of the step would leave the network idle
during compute and the cores idle during the transfer; instead the all-gathers run
while the next step's forward computes (DeepSpeed and FSDP do the same with their
prefetch): `ParamSync.wait(bucket)` before a bucket's parameters are read, with at most
`depth` buckets in flight (each holds a gathered buffer). `finish()` completes the rest;
a State that carries a ParamSync calls it before its parameters are read in any other way.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.sharding.comm import local_rows_of_full, shard_views, unpack_into
from fz.sharding.plan import ShardPlan
from fz.sharding.buckets import Bucket


class ParamSync:
    """The all-gathers of one step's updated rows, in bucket order (the same on every rank)."""

    def __init__(self, plan: ShardPlan, todo: Sequence[Tuple[Bucket, Tensor, Optional[Tensor]]], depth: int = 2):
        self.plan, self.depth = plan, max(1, depth)
        self.todo: List[Tuple[Bucket, Tensor, Optional[Tensor]]] = list(todo)  # (bucket, flat, master flat)
        self.inflight: List[Tuple[Bucket, Tensor, Tensor, object]] = []
        self.waiting = {b.index for b, _, _ in self.todo}  # buckets not up to date yet
        for b, flat, _ in self.todo:  # the bytes belong to the step that made the update
            plan.comm.bytes["all_gather"] += b.padded_numel * flat.element_size()
        self._fill()

    def _launch(self, b: Bucket, flat: Tensor, mflat: Optional[Tensor]) -> None:
        plan = self.plan
        if mflat is not None:  # this rank's updated rows, in the parameters' dtype
            shard = mflat.to(flat.dtype)
        else:
            shard = torch.zeros(b.shard_numel, dtype=flat.dtype, device=flat.device)
            for dst, src in zip(shard_views(shard, b, plan.rank), local_rows_of_full(flat, b, plan.rank)):
                dst.copy_(src)
        full = torch.empty(b.padded_numel, dtype=flat.dtype, device=flat.device)
        self.inflight.append((b, flat, full, plan.comm.all_gather(full, shard, async_op=True, counted=True)))

    def _fill(self) -> None:
        while self.todo and len(self.inflight) < self.depth:
            self._launch(*self.todo.pop(0))

    def _complete_oldest(self) -> None:
        b, flat, full, work = self.inflight.pop(0)
        work.wait()
        unpack_into(full, b, flat)
        self.waiting.discard(b.index)
        self._fill()

    def wait(self, index: int) -> None:
        """Bucket `index` is up to date when this returns (earlier buckets too: collectives finish
        in order). A bucket this sync does not gather (a frozen one) returns at once."""
        while index in self.waiting:
            self._complete_oldest()

    def finish(self) -> None:
        while self.waiting:
            self._complete_oldest()

    @property
    def pending(self) -> bool:
        return bool(self.waiting)


def start_param_sync(plan: ShardPlan, flats: Sequence[Tensor], mflats: Sequence[Optional[Tensor]],
                     depth: int = 2) -> Optional[ParamSync]:
    """Make every rank's parameters equal the updated (master) shards: a cast copy where the
    layouts agree (done now), an all-gather where a replicated parameter was updated in
    shards (returned as a ParamSync that runs during the next forward; None if there is none)."""
    todo = []
    for b, flat, mflat in zip(plan.buckets, flats, mflats):
        if not b.trainable:
            continue
        gathered = not b.sharded_param and isinstance(b.place.opt, Shard) and plan.world > 1
        if gathered:
            todo.append((b, flat, mflat))
        elif mflat is not None:
            flat.copy_(mflat)  # same layout: a cast copy
    return ParamSync(plan, todo, depth) if todo else None
