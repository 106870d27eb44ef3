"""`train_step`, `eval_step`, `apply`: pure functions of a State (the old state is donated).

One optimizer step: split the batch into micro-batches; for each, run the model through
the Runner and backpropagate (buckets reduce as their gradients become final); then clip
by the global norm, run the optimizer on local shards, and start the all-gathers of the
parameters that are replicated but updated in shards (stages 1 and 2; the next step's
forward overlaps them, see fz/sharding/sync.py).
"""
from __future__ import annotations

import contextlib

from typing import Any, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.errors import ConfigError
from fz.step.grads import GradReducer
from fz.sharding.opt_state import reuse_map, unwrap, wrap_opt_state
from fz.step.runner import BoundModel, Runner, default_loss
from fz.step.scaler import update_scaler
from fz.state import State
from fz.sharding.sync import start_param_sync
from fz.step.update import any_overflow, apply_optimizer, optimizer_inputs


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


def _clone_state(state: State) -> State:
    flats = tuple(f.clone() for f in state.flats)
    mflats = tuple(None if m is None else m.clone() for m in state.master_flats)
    opt = pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, unwrap(state.opt_state))
    master = state.plan.wrap_master(mflats) if state.master is not None else None
    return state.replace(params=state.plan.wrap_params(flats), flats=flats, master=master, master_flats=mflats,
                         opt_state=wrap_opt_state(opt, state.plan))


def _autocast(state: State):
    dtype = state.spec.compute_dtype
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(state.plan.device.type, dtype=dtype)


def train_step(state: State, batch: Any, *, donate: bool = True) -> Tuple[State, Tensor]:
    """One optimizer step on this rank's `batch`; returns (new state, mean loss over all ranks).

    With `donate=True` (the default) the new state takes over the old one's buffers and
    the old state can no longer be used; `donate=False` copies them first. In fp16 a step
    whose gradients overflow on any rank changes only the step count and the scaler.
    """
    state.check_alive("fz.train_step")
    spec, plan = state.spec, state.plan
    sync = state.raw("sync")  # the last step's all-gathers: this forward waits for each bucket in turn
    if sync is not None and not sync.pending:
        sync = None
    flats, repacked = plan.packed_flats(state.raw("params"), state.raw("flats"))
    if repacked and sync is not None:  # a state rebuilt by the user: its parameters must be complete
        sync.finish()
        sync = None
        flats, repacked = plan.packed_flats(state.raw("params"), state.raw("flats"))
    mflats = plan.packed_master(state.master, state.master_flats)
    if repacked or mflats is not state.master_flats:
        master = plan.wrap_master(mflats) if state.master is not None else None
        state = state.replace(params=plan.wrap_params(flats), flats=flats, master=master, master_flats=mflats)
    old_lease = state.lease
    if not donate:
        state = _clone_state(state)  # reads the parameters: waits for them
        flats, mflats, sync = state.flats, state.master_flats, None
    micro = _micro_batches(batch, spec.grad_accum, spec.micro_batch)
    plan.comm.bytes.clear()
    loss_fn = spec.loss_fn or default_loss
    scale = float(state.scaler["scale"]) if state.scaler is not None else 1.0

    leaves = [f.detach().requires_grad_(b.trainable) for f, b in zip(flats, plan.buckets)]
    reducer = GradReducer(plan, leaves)
    runner = Runner(state.skeleton, plan, leaves, state.buffers, spec.activation_checkpointing,
                    grad_sink=reducer.reduce_gathered, prefetch=spec.prefetch, compile=spec.compile, sync=sync,
                    live_buckets=spec.live_buckets)
    model = BoundModel(runner)
    total = torch.zeros((), device=plan.device)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state.rng)
        try:
            for i, mb in enumerate(micro):
                reducer.last = i == len(micro) - 1
                with _autocast(state):
                    loss = _scalar_loss(loss_fn(model, mb)).float()
                (loss * (scale / spec.grad_accum)).backward()
                runner.release()
                reducer.end_micro_batch()
                total += loss.detach()
                if sync is not None:  # parameters no forward used
                    sync.finish()
        finally:
            reducer.close()
        rng = torch.get_rng_state()
    runner.dispose()
    del runner, model

    loss = total / spec.grad_accum  # averaged over ranks while the optimizer runs
    loss_work = plan.comm.all_reduce(loss, async_op=True) if plan.world > 1 else None
    with torch.no_grad():
        grads, params, sharded = optimizer_inputs(plan, reducer, flats, mflats, 1.0 / scale)
        reducer.dispose()
        del leaves, reducer
        overflow = state.scaler is not None and any_overflow(plan, grads)
        local_opt = unwrap(state.opt_state)
        new_sync = None
        if not overflow:
            local_opt = apply_optimizer(spec, plan, local_opt, grads, params, sharded)
            new_sync = start_param_sync(plan, flats, mflats)
    del grads, params

    if loss_work is not None:
        loss_work.wait()
    plan.last_step_bytes.clear()
    plan.last_step_bytes.update(plan.comm.bytes)
    scaler = update_scaler(spec, state.scaler, overflow) if state.scaler is not None else None
    new = state.replace(step=state.step + 1, rng=rng, scaler=scaler, sync=new_sync,
                        opt_state=wrap_opt_state(local_opt, plan, reuse_map(state.opt_state)))
    if donate:
        old_lease.alive = False
    return new, loss


def _forward(state: State, fn, *args: Any, **kwargs: Any) -> Any:
    state.check_alive("fz.eval_step/apply")
    flats, _ = state.plan.packed_flats(state.params, state.flats)
    runner = Runner(state.skeleton, state.plan, list(flats), state.buffers, prefetch=state.spec.prefetch,
                    compile=state.spec.compile)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _autocast(state):
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
