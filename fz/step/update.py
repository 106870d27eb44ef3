"""The optimizer half of a step: gradients in, local shards updated.

Runs after backward: take each bucket's reduced gradients (as fp32, unscaled; the
non-finite check is fz/step/nonfinite.py), clip by the global norm, run the optimizer on this rank's
shards (of the fp32 master weights in mixed precision). The cross-shard reductions the
optimizer needs are handed to it explicitly (`norm_sq`, `shard_sum`), over the shard group:
on a 2-D mesh every group holds the same shards once gradients are averaged across groups.
Bringing the parameters back in step (a cast copy, or an all-gather during the next
forward) is fz/sharding/sync.py.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.optim.base import CastGroups, global_norm, step_casting
from fz.optim.norms import norms as tensor_norms
from fz.optim.transforms import clip_factor
from fz.sharding.comm import Comm
from fz.sharding.plan import ShardPlan
from fz.step.grads import GradReducer

Params = dict[str, Tensor]


def optimizer_inputs(plan: ShardPlan, reducer: GradReducer, flats: Sequence[Tensor],
                     mflats: Sequence[Tensor | None], inv_scale: float) -> tuple[Params, Params, set[str]]:
    """(fp32 unscaled grads, the tensors the optimizer updates, names whose state is sharded)."""
    grads: Params = {}
    params: Params = {}
    sharded: set[str] = set()
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


class GradNorms:
    """Each gradient's L2 norm over the row blocks every stage takes it in (Shard(0)'s, also for
    replicated parameters), in one pass over the gradients: the global norm the clip needs sums
    their squares, and the non-finite check reads them (a NaN or inf makes its block's norm
    non-finite), so the check costs no pass of its own (fz/step/nonfinite.py)."""

    def __init__(self, grads: Params, sharded: set[str], world: int):
        self.world, self.has_sharded = world, bool(sharded)
        pieces: list[Tensor] = []
        self.owner: list[int] = []  # the gradient (its index in `grads`) each piece is a block of
        self.kind: list[bool] = []  # whether the piece's parameter is sharded
        for i, (k, t) in enumerate(grads.items()):
            blocks = [t] if k in sharded else _row_blocks(t, world)
            pieces += blocks
            self.owner += [i] * len(blocks)
            self.kind += [k in sharded] * len(blocks)
        self.norms = tensor_norms(pieces)  # host pieces several at a time (fz/optim/norms.py): the same values

    def first_nonfinite(self) -> Tensor:
        """index + 1 of the first gradient holding a NaN or inf (or too large for its norm to be
        finite in fp32: clipping could not scale it), else 0; a 0-d tensor, no host sync."""
        if not self.norms:
            return torch.zeros((), dtype=torch.int64)
        bad = torch.logical_not(torch.isfinite(torch.stack(self.norms)))
        owner = _owners(tuple(self.owner), bad.device)  # a gradient's blocks are consecutive pieces
        return torch.where(bad.any(), owner[bad.to(torch.int64).argmax()] + 1, 0)

    def local_parts(self) -> list[Tensor]:
        """[the replicated parameters' sum of squares, the sharded ones' (this rank's rows)]."""
        parts = []
        for want in (False, True):
            norms = [n for n, k in zip(self.norms, self.kind) if k == want] or [torch.zeros(())]
            parts.append(torch.stack(norms).double().square().sum())
        return parts


@functools.lru_cache(maxsize=8)
def _owners(owner: tuple[int, ...], device: torch.device) -> Tensor:
    """`owner` as a tensor on `device`, made once per model (a copy to the GPU each step would wait)."""
    return torch.tensor(owner, dtype=torch.int64, device=device)


def norm_sq_fn(comm: Comm, sharded: set[str], norms: GradNorms | None = None):
    """Sum of squares over every shard, the same in every stage: each parameter's norm is taken
    over the same row blocks (Shard(0)'s, also for replicated ones) in fp32, and the blocks'
    squares are summed in float64, whose rounding never reaches the fp32 result. `norms`: the
    gradients' norms, already taken (of the tree norm_sq is then called with)."""

    def norm_sq(tree: Params) -> Tensor:
        parts = (norms if norms is not None else GradNorms(tree, sharded, comm.world)).local_parts()
        if comm.world > 1 and sharded:
            parts[1] = _all_reduce_sum_on(comm, parts[1])
        return (parts[0] + parts[1].to(parts[0].device)).float()

    return norm_sq


def _row_blocks(t: Tensor, shards: int) -> list[Tensor]:
    """`t` split as Shard(0) splits it over `shards` ranks."""
    if t.dim() == 0:
        return [t]
    return list(t.split(max(1, -(-t.shape[0] // shards))))


def _all_reduce_sum_on(comm: Comm, t: Tensor) -> Tensor:
    """`t` summed over the shard group; host tensors (offloaded optimizer) travel through the
    collective's device (NCCL reduces only device memory) and come back to where they were."""
    if t.device == comm.device:
        comm.all_reduce_sum(t)
        return t
    on = t.to(comm.device)
    comm.all_reduce_sum(on)
    return on.to(t.device)


def shard_sum_fn(comm: Comm, sharded: set[str]):
    def shard_sum(tree: Params) -> Params:
        names = [k for k in tree if k in sharded]
        if not names or comm.world == 1:
            return tree
        flat = _all_reduce_sum_on(comm, torch.cat([tree[k].reshape(-1).float() for k in names]))
        out = dict(tree)
        for k, piece in zip(names, flat.split([tree[k].numel() for k in names])):
            out[k] = piece.view_as(tree[k]).to(tree[k].device, tree[k].dtype)
        return out

    return shard_sum


def apply_optimizer(spec, comm: Comm, opt_state: Any, grads: Params, params: Params,
                    sharded: set[str], norms: GradNorms | None = None, cast: Params | None = None,
                    groups: CastGroups | None = None) -> tuple[Any, Tensor | None]:
    """Clip, then update the local shards in place (the step owns every buffer it passes: they
    are donated); returns (the optimizer's new local state, the global grad norm or None).
    `norms`: the gradients' norms, when the step took them already (its non-finite check);
    `cast`: parameters to receive their updated masters (fz/step/updaters.py: host_casts);
    `groups`: more of them, handed out bucket by bucket (fz/offload/landing.py)."""
    extra = dict(donate=True, norm_sq=norm_sq_fn(comm, sharded), shard_sum=shard_sum_fn(comm, sharded))
    norm, factor = None, None
    if spec.clip_grad_norm is not None:  # the clip's factor, applied in the update's own pass where it can
        norm = global_norm(grads, norm_sq_fn(comm, sharded, norms))
        factor = clip_factor(norm, spec.clip_grad_norm)
    return step_casting(spec.optimizer, grads, opt_state, params, cast or {}, factor, groups, **extra), norm
