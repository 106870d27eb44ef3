"""The optimizer half of a step: gradients in, local shards updated, parameters in sync.

Runs after backward: take each bucket's reduced gradients (as fp32, unscaled), check for
fp16 overflow on every rank, clip by the global norm, run the optimizer on this rank's
shards (of the fp32 master weights in mixed precision). Bringing the parameters back in
step (a cast copy, or an all-gather during the next forward) is fz/sharding/sync.py.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.step.grads import GradReducer
from fz.optim.base import apply_updates, norm_reduction, shard_reduction
from fz.optim.transforms import clip_by_global_norm
from fz.sharding.plan import ShardPlan

Params = Dict[str, Tensor]


def optimizer_inputs(plan: ShardPlan, reducer: GradReducer, flats: Sequence[Tensor],
                     mflats: Sequence[Optional[Tensor]], inv_scale: float) -> Tuple[Params, Params, Set[str]]:
    """(fp32 unscaled grads, the tensors the optimizer updates, names whose state is sharded)."""
    grads: Params = {}
    params: Params = {}
    sharded: Set[str] = set()
    for b, flat, mflat in zip(plan.buckets, flats, mflats):
        if not b.trainable:
            continue
        names = [s.name for s in b.slots]
        grads.update(zip(names, (g.float() for g in reducer.optimizer_grads(b))))
        params.update(zip(names, plan.opt_locals(flat, mflat, b)))
        if isinstance(b.place.opt, Shard):
            sharded.update(names)
    if inv_scale != 1.0:
        torch._foreach_mul_(list(grads.values()), inv_scale)
    return grads, params, sharded


def _norm_sq_fn(plan: ShardPlan, sharded: Set[str]):
    """Sum of squares over every shard, the same in every stage: each parameter's norm is taken
    over the same row blocks (Shard(0)'s, also for replicated ones) in fp32, and the blocks'
    squares are summed in float64, whose rounding never reaches the fp32 result."""

    def norm_sq(tree: Params) -> Tensor:
        parts = []
        for want in (False, True):
            ts = [t for k, t in tree.items() if (k in sharded) == want]
            if not want:
                ts = [piece for t in ts for piece in _row_blocks(t, plan.world)]
            norms = torch._foreach_norm(ts, 2) if ts else [torch.zeros(())]
            parts.append(torch.stack(norms).double().square().sum())
        if plan.world > 1 and sharded:
            plan.comm.all_reduce_sum(parts[1])
        return (parts[0] + parts[1]).float()

    return norm_sq


def _row_blocks(t: Tensor, world: int) -> List[Tensor]:
    """`t` split as Shard(0) splits it over `world` ranks."""
    if t.dim() == 0:
        return [t]
    return list(t.split(max(1, -(-t.shape[0] // world))))


def _shard_sum_fn(plan: ShardPlan, sharded: Set[str]):
    def shard_sum(tree: Params) -> Params:
        names = [k for k in tree if k in sharded]
        if not names or plan.world == 1:
            return tree
        flat = torch.cat([tree[k].reshape(-1).float() for k in names])
        plan.comm.all_reduce_sum(flat)
        out = dict(tree)
        for k, piece in zip(names, flat.split([tree[k].numel() for k in names])):
            out[k] = piece.view_as(tree[k]).to(tree[k].dtype)
        return out

    return shard_sum


def any_overflow(plan: ShardPlan, grads: Params) -> bool:
    """True on every rank if any rank's gradients hold an inf or nan."""
    local = torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads.values()]).any()
    flag = local.float().reshape(1)
    if plan.world > 1:
        plan.comm.all_reduce_sum(flag)
    return bool(flag.item() > 0)


def apply_optimizer(spec, plan: ShardPlan, opt_state: Any, grads: Params, params: Params, sharded: Set[str]) -> Any:
    """Clip, update the local shards in place; returns the optimizer's new (local) state."""
    with norm_reduction(_norm_sq_fn(plan, sharded)), shard_reduction(_shard_sum_fn(plan, sharded)):
        if spec.clip_grad_norm is not None:
            grads, _ = clip_by_global_norm(spec.clip_grad_norm).update(grads, (), None)
        if spec.optimizer.fused is not None and _fusable(grads, params):
            return spec.optimizer.fused(grads, opt_state, params)
        updates, opt_state = spec.optimizer.update(grads, opt_state, params)
        apply_updates(params, updates)
    return opt_state


def _fusable(grads: Params, params: Params) -> bool:
    """Fused kernels want one dtype and device; fp32 master weights and grads always are."""
    first = next(iter(params.values()), None)
    return first is not None and all(
        t.dtype == first.dtype and t.device == first.device for t in (*params.values(), *grads.values()))
