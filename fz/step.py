"""`train_step`, `eval_step`, `apply`: pure functions of a State (the old state is donated).

One optimizer step: split the batch into micro-batches; for each, run the model through
the Runner and backpropagate (buckets reduce as their gradients become final); then clip
by the global norm, run the optimizer on local shards, and all-gather the parameters
that are replicated but updated in shards (stages 1 and 2).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.errors import ConfigError
from fz.grads import GradReducer
from fz.opt_state import reuse_map, unwrap, wrap_opt_state
from fz.optim.base import apply_updates, norm_reduction, shard_reduction
from fz.runner import BoundModel, Runner, default_loss
from fz.optim.transforms import clip_by_global_norm
from fz.sharding.comm import local_rows_of_full, shard_views, unpack_into
from fz.state import State


def _micro_batches(batch: Any, n: int, micro: Optional[int] = None) -> List[Any]:
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    if not tensors:
        raise ConfigError("the batch holds no tensors")
    sizes = {x.shape[0] if x.dim() else None for x in tensors}
    if len(sizes) != 1 or None in sizes:
        raise ConfigError(f"every tensor in the batch needs the same leading (batch) dimension; got {sorted(map(str, sizes))}")
    size = sizes.pop()
    if size % n or size == 0:
        raise ConfigError(f"batch leading dimension {size} is not divisible by grad_accum={n} "
                          f"(a batch is grad_accum * micro_batch rows of this rank's data)")
    m = size // n
    if micro is not None and m != micro:
        raise ConfigError(f"batch has {size} rows but grad_accum={n} x micro_batch={micro} = {n * micro} "
                          "(batch sizes are inconsistent with the spec)")
    return [pytree.tree_unflatten([x.narrow(0, i * m, m) if isinstance(x, Tensor) else x for x in leaves], spec)
            for i in range(n)]


def _scalar_loss(loss: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ConfigError(f"loss_fn must return a scalar tensor; got {shape}. Reduce it (e.g. .mean()) in loss_fn")
    return loss.reshape(())


def _norm_sq_fn(state: State, sharded: set):
    comm = state.plan.comm

    def norm_sq(tree: Dict[str, Tensor]) -> Tensor:
        parts = {True: [], False: []}
        for k, t in tree.items():
            parts[k in sharded].append(t)
        total = []
        for is_sharded, ts in parts.items():
            s = torch.stack(torch._foreach_norm(ts)).square().sum() if ts else torch.zeros(())
            if is_sharded and comm.world > 1:
                comm.all_reduce_sum(s)
            total.append(s)
        return total[0] + total[1]

    return norm_sq


def _shard_sum_fn(state: State, sharded: set):
    comm = state.plan.comm

    def shard_sum(tree: Dict[str, Tensor]) -> Dict[str, Tensor]:
        names = [k for k in tree if k in sharded]
        if not names or comm.world == 1:
            return tree
        flat = torch.cat([tree[k].reshape(-1).float() for k in names])
        comm.all_reduce_sum(flat)
        out = dict(tree)
        for k, piece in zip(names, flat.split([tree[k].numel() for k in names])):
            out[k] = piece.view_as(tree[k]).to(tree[k].dtype)
        return out

    return shard_sum


def _clone_state(state: State) -> State:
    flats = tuple(f.clone() for f in state.flats)
    opt = pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, unwrap(state.opt_state))
    return state.replace(params=state.plan.wrap_params(flats), flats=flats,
                         opt_state=wrap_opt_state(opt, state.plan))


def train_step(state: State, batch: Any, *, donate: bool = True) -> Tuple[State, Tensor]:
    """One optimizer step on this rank's `batch`; returns (new state, mean loss over all ranks).

    With `donate=True` (the default) the new state takes over the old one's buffers and
    the old state can no longer be used; `donate=False` copies them first.
    """
    state.check_alive("fz.train_step")
    spec, plan = state.spec, state.plan
    flats, repacked = plan.packed_flats(state.params, state.flats)
    if repacked:
        state = state.replace(params=plan.wrap_params(flats), flats=flats)
    old_lease = state.lease
    if not donate:
        state = _clone_state(state)
        flats = state.flats
    micro = _micro_batches(batch, spec.grad_accum, spec.micro_batch)
    loss_fn = spec.loss_fn or default_loss

    leaves = [f.detach().requires_grad_(b.trainable) for f, b in zip(flats, plan.buckets)]
    reducer = GradReducer(plan, leaves)
    runner = Runner(state.skeleton, plan, leaves, state.buffers)
    model = BoundModel(runner)
    total = torch.zeros((), device=plan.device)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state.rng)
        try:
            for i, mb in enumerate(micro):
                reducer.last = i == len(micro) - 1
                loss = _scalar_loss(loss_fn(model, mb))
                (loss / spec.grad_accum).backward()
                runner.release()
                reducer.end_micro_batch()
                total += loss.detach()
        finally:
            reducer.close()
        rng = torch.get_rng_state()

    grads: Dict[str, Tensor] = {}
    params: Dict[str, Tensor] = {}
    sharded = set()
    for b, flat in zip(plan.buckets, flats):
        if not b.trainable:
            continue
        names = [s.name for s in b.slots]
        grads.update(zip(names, reducer.optimizer_grads(b)))
        params.update(zip(names, plan.opt_locals(flat, b)))
        if isinstance(b.place.opt, Shard):
            sharded.update(names)
    del leaves, runner, model

    local_opt = unwrap(state.opt_state)
    with torch.no_grad(), norm_reduction(_norm_sq_fn(state, sharded)), shard_reduction(_shard_sum_fn(state, sharded)):
        if spec.clip_grad_norm is not None:
            grads, _ = clip_by_global_norm(spec.clip_grad_norm).update(grads, (), None)
        updates, local_opt = spec.optimizer.update(grads, local_opt, params)
        apply_updates(params, updates)
        _gather_updated(state, flats)

    loss = total / spec.grad_accum
    if plan.world > 1:
        plan.comm.all_reduce(loss)
    new = state.replace(step=state.step + 1, rng=rng,
                        opt_state=wrap_opt_state(local_opt, plan, reuse_map(state.opt_state)))
    if donate:
        old_lease.alive = False
    return new, loss


def _gather_updated(state: State, flats) -> None:
    """Stages 1-2: every rank updated its rows of a replicated parameter; share them."""
    plan = state.plan
    if plan.world == 1:
        return
    for b, flat in zip(plan.buckets, flats):
        if not b.trainable or b.sharded_param or not isinstance(b.place.opt, Shard):
            continue
        shard = torch.zeros(b.shard_numel, dtype=flat.dtype, device=flat.device)
        for dst, src in zip(shard_views(shard, b, plan.rank), local_rows_of_full(flat, b, plan.rank)):
            dst.copy_(src)
        full = torch.empty(b.padded_numel, dtype=flat.dtype, device=flat.device)
        plan.comm.all_gather(full, shard)
        unpack_into(full, b, flat)


def _forward(state: State, fn, *args: Any, **kwargs: Any) -> Any:
    state.check_alive("fz.eval_step/apply")
    flats, _ = state.plan.packed_flats(state.params, state.flats)
    runner = Runner(state.skeleton, state.plan, list(flats), state.buffers)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state.rng)
        try:
            return fn(runner, *args, **kwargs)
        finally:
            runner.release()


def eval_step(state: State, batch: Any) -> Tensor:
    """The loss on this rank's `batch`, averaged over ranks; no state changes."""
    loss_fn = state.spec.loss_fn or default_loss
    loss = _forward(state, lambda r: _scalar_loss(loss_fn(BoundModel(r), batch)).detach().clone())
    if state.plan.world > 1:
        state.plan.comm.all_reduce(loss)
    return loss


def apply(state: State, *args: Any, **kwargs: Any) -> Any:
    """The model's own forward output on `args` (stage 3 gathers block by block)."""
    return _forward(state, lambda r: r(*args, **kwargs))
