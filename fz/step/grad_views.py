"""A step's gradients read between its micro-batches, as DeepSpeed's engine shows them.

DeepSpeed keeps gradients in `p.grad` until its update at ZeRO 0-1 and gives any parameter's
whole gradient through `deepspeed.utils.safe_get_full_grad`; scripts log or check them between
`engine.backward` and `engine.step()`. Inside an fz step they are the bucket buffers of the
step's GradReducer: `local_grads` gives each parameter whose gradient this rank holds whole as a
view (no copy, no collective), `whole_grad` one parameter's, gathered from its shards where they
are reduced into shards (a collective over the shard group: every rank calls it). Both are what
the step computes with: multiplied by the loss scale and divided by the accumulation steps, as
DeepSpeed's are before its update unscales them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fz.sharding.comm import Comm, full_views, shard_views
from fz.sharding.plan import ShardPlan
from fz.step.grads import GradReducer


def local_grads(plan: ShardPlan, reducer: GradReducer, comm: Comm) -> dict[str, Tensor]:
    """Canonical name -> the gradient this rank holds whole now (its own micro-batches' sum before
    the last one's reduction; the average over ranks after it, where the optimizer is replicated),
    a view of the step's buffer: read it before the next backward. Parameters whose gradients are
    reduced into shards (ZeRO 2-3, ZeRO-1 at the boundary) or averaged across a 2-D mesh's groups
    only in the update are not in it."""
    out: dict[str, Tensor] = {}
    for b in plan.buckets:
        got = reducer.current(b) if b.trainable else None
        if got is None or got[1] == "shard" or (got[1] == "full" and comm.replicas > 1 and reducer.host is None):
            continue
        out.update(zip((s.name for s in b.slots), full_views(got[0], b)))
    return out


def whole_grad(plan: ShardPlan, reducer: GradReducer, comm: Comm, name: str) -> Tensor | None:
    """The gradient of parameter `name` (canonical), whole, in fp32: as `local_grads` gives it, or
    summed over the shard group from each rank's rows (every rank calls it). None before a
    backward reached it, or for a frozen parameter."""
    where = plan.slots().get(name)
    if where is None:
        return None
    b, slot = where
    i = b.slots.index(slot)
    got = reducer.current(b) if b.trainable else None
    if got is None:
        return None
    flat, layout = got
    if layout != "shard":
        whole = full_views(flat, b)[i].float().clone()
    else:
        whole = torch.zeros(slot.numel, dtype=torch.float32, device=plan.device)
        start, stop = slot.local_rows(plan.shard_rank)
        mine = shard_views(flat, b, plan.shard_rank)[i].reshape(-1)
        whole[start * slot.row_numel:stop * slot.row_numel] = mine.to(device=plan.device, dtype=torch.float32)
        comm.all_reduce_sum(whole)
        whole = whole.view(slot.shape)
    if layout != "local" and comm.replicas > 1 and reducer.host is None:  # the update averages across groups
        comm.replica_mean(whole)
    return whole
