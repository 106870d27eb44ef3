"""`train_step`, `eval_step`, `apply`: pure functions of a State (the old state is donated).

One optimizer step: check the state's leaves; split the batch into micro-batches; for
each, run the model through the Runner and backpropagate (buckets reduce as their
gradients become final); on a 2-D mesh average the result across groups; then clip by
the global norm, run the optimizer on local shards, and start the all-gathers of the
parameters that are replicated but updated in shards (stages 1 and 2; the new state holds
them as futures and the next step's forward overlaps them, see fz/sharding/sync.py).
Everything the step measured goes into the new state's `metrics`, never into shared objects.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.background import raise_background_failures
from fz.distributed import peers
from fz.distributed.arrival import arrive
from fz.errors import ConfigError
from fz.offload.host_grads import HostGrads
from fz.offload.transfer import pool_for
from fz.optim.transforms import current_lr
from fz.rng import forked as rng_forked
from fz.sharding.comm import Comm
from fz.sharding.opt_state import checked_opt_state, reuse_map, wrap_opt_state
from fz.sharding.pack import checked_flats
from fz.sharding.sync import Arriving, start_param_sync
from fz.state import State, expect_state
from fz.step.agree import Agreement
from fz.step.batches import micro_batches, on_device, scalar_loss
from fz.step.buffers import sync_changed, versions
from fz.step.grads import GradReducer
from fz.step.metrics import step_metrics
from fz.step.nonfinite import NonFinite, verdict_is_local
from fz.step.residency import Residency, ResidentRunner, deciding
from fz.step.runner import BoundModel, Runner, default_loss
from fz.step.scaler import update_scaler
from fz.step.unused import UsedParams, unused_everywhere
from fz.step.update import optimizer_inputs
from fz.step.updaters import UPDATERS, UpdateInputs, update_tier
from fz.storage.disk import DiskTensor


def _autocast(state: State):
    dtype = state.spec.compute_dtype
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(state.plan.device.type, dtype=dtype)


def _own(t: Tensor) -> Tensor:
    """A copy the step may write into (a DiskTensor is never written: the step makes new files)."""
    return t if isinstance(t, DiskTensor) else t.clone()


def _clone_tree(tree: Any) -> Any:
    return pytree.tree_map(lambda x: _own(x) if isinstance(x, Tensor) else x, tree)


def _offload_of(spec):
    return spec.offload if spec.offload is not None and spec.offload.active else None


def train_step(state: State, batch: Any, *, donate: bool = True) -> tuple[State, Tensor]:
    """One optimizer step on this rank's `batch`; returns (new state, mean loss over all ranks).

    With `donate=True` (the default) the new state takes over the old one's buffers and
    the old state can no longer be used; `donate=False` copies them first. A step whose
    gradients hold a NaN or inf on any rank changes only the step count, RNG and scaler
    (Spec.nonfinite="skip", fp16 overflows too) or raises fz.NonFiniteError ("raise").
    """
    expect_state(state, "fz.train_step")
    peers.doing("fz.train_step", int(state.step))
    raise_background_failures()  # e.g. an async checkpoint save that failed since the last call
    given, offload, tier = state, _offload_of(state.spec), update_tier(state.spec)
    if offload is not None:  # leaves put elsewhere (replace, tree_map) go back to the policy's tier
        state = offload(state)
    spec, plan, scaler = state.spec, state.plan, state.scaler
    if scaler is None:
        raise ConfigError("fz.train_step: state.scaler is None; a state from fz.init has one (keep it)")
    flats, sync, mflats = checked_flats(state)  # the leaves, exactly as given (ConfigError if one does not fit)
    local_opt = checked_opt_state(state.opt_state, plan)
    if not donate:  # a copy the step owns (reading the parameters waits for any still arriving)
        if sync is not None:
            sync.finish()
            sync = None
        flats = [_own(f) for f in flats]
        mflats = [None if m is None else _own(m) for m in mflats]
        local_opt = _clone_tree(local_opt)
    # modules update them in place
    buffers = state.buffers if donate else {n: t.clone() for n, t in state.buffers.items()}
    before = versions(buffers)
    micro = micro_batches(on_device(batch, plan.device), spec.grad_accum, spec.micro_batch)
    agreement = Agreement(plan, state.step, batch, spec.weight_by_rows)
    comm = Comm(plan, spec.grad_reduce_dtype)
    loss_fn: Callable[[Any, Any], Any] = spec.loss_fn or default_loss  # gets a BoundModel, as a module
    scale = float(scaler.get("scale", 1.0))

    leaves = [f.detach().requires_grad_(b.trainable) for f, b in zip(flats, plan.buckets)]
    # optimizer state off the device: gradients follow it to the host as each bucket is reduced
    host = HostGrads(pool_for(offload), plan.device) if offload is not None and offload.optimizer != "device" else None
    reducer = GradReducer(plan, comm, leaves, host)
    state.skeleton.set_mode(True)  # train_step trains: dropout on, BatchNorm on batch statistics
    used = UsedParams() if spec.skip_unused else None
    runner = Runner(state.skeleton, plan, comm, leaves, buffers, spec, state.metrics["order"].tolist(),
                    grad_sink=reducer.reduce_gathered, sync=sync, used=used)
    model = BoundModel(runner)
    weight = scale * agreement.loss_weight / spec.grad_accum
    total = torch.zeros((), device=plan.device)
    calls: list[int] = []  # the blocks each forward called, in order (checked across ranks)
    with rng_forked(state.rng, plan.device) as rng_now:
        try:
            for i, mb in enumerate(micro):
                reducer.last = i == len(micro) - 1
                with _autocast(state):
                    loss = scalar_loss(loss_fn(model, mb)).float()
                runner.backward(loss * weight)
                calls += runner.called
                runner.release()
                reducer.end_micro_batch()
                total += loss.detach()
                if sync is not None:  # parameters no forward used
                    sync.finish()
        except BaseException as e:
            peers.broke("fz.train_step", e)  # its collectives no longer match the other ranks'
            raise
        finally:
            reducer.close()
        rng = rng_now()
    reducer.reduce_across_replicas()
    sync_changed(comm, buffers, before, spec.buffer_sync, state.skeleton.running_stats)  # equal on every rank
    order, live = runner.order, runner.live
    runner.dispose()
    del runner, model

    with torch.no_grad():
        grads, params, sharded = optimizer_inputs(plan, reducer, flats, mflats, 1.0 / scale)
        reducer.dispose()
        del leaves, reducer
        guard = NonFinite(spec, plan, int(state.step), scaler)
        # the loss all-reduce, with every rank's step, batch size, blocks called and non-finite finding
        agreement.start(comm, total / spec.grad_accum, guard.check(grads), calls)
        if spec.weight_by_rows or not verdict_is_local(plan):  # needed before the update
            _, factor = agreement.finish(comm)
            if factor != 1.0:
                torch._foreach_mul_(list(grads.values()), factor)
        overflow = guard.skip(agreement, comm)
        new_sync, norm = None, None
        if not overflow:
            skip = unused_everywhere(comm, list(grads), used.used) if used is not None else set()
            inputs = UpdateInputs(local_opt, grads, params, flats, mflats, sharded, skip, donate)
            try:
                up = UPDATERS[tier](spec, comm, plan, inputs)
            except BaseException as e:
                if donate and tier == "disk":
                    given.donate()
                    if hasattr(e, "add_note"):  # Python >= 3.11
                        e.add_note(
                            "fz.train_step failed while streaming the offloaded optimizer state; the state "
                            "it was given is consumed (donated; its in-memory parameters may be partly "
                            "updated): restore the last checkpoint. With donate=False the input state stays whole."
                        )
                raise
            del inputs
            local_opt, norm, flats, mflats = up.local_opt, up.norm, up.flats, up.mflats
            new_sync = start_param_sync(comm, plan, flats, [None] * len(mflats) if up.cast else mflats)
    del grads, params
    if host is not None:
        host.release()
    if agreement.result is None:  # waited for while the optimizer ran
        try:
            agreement.finish(comm)
        except ConfigError:
            if donate:  # its buffers took this update in place: no silent reuse
                state.donate()
            raise
    loss = agreement.finish(comm)[0]  # its result, kept from the first call

    scaler = update_scaler(spec, scaler, overflow)
    opt_state = wrap_opt_state(local_opt, plan, reuse_map(state.opt_state) if donate else None)
    new = state.replace(step=state.step + 1, rng=rng, scaler=scaler, opt_state=opt_state, buffers=buffers,
                        param_flats=_param_leaves(state, flats, new_sync, donate),
                        master_flats=_master_leaves(state, mflats, donate),
                        metrics=step_metrics(order, comm, live, norm, _lr(opt_state), scaler))
    if donate:
        given.donate()
        state.donate()
    return new, loss


def _lr(opt_state: Any) -> float | None:
    try:
        return current_lr(opt_state)
    except ValueError:
        return None


def _param_leaves(state: State, flats: list[Tensor], sync, donate: bool):
    """The new state's parameter storage: the same DTensors where nothing changed, futures where
    the bucket is still being all-gathered."""
    plan, out = state.plan, []
    for b, flat, old in zip(plan.buckets, flats, state.param_flats):
        if sync is not None and b.index in sync.waiting:
            out.append(plan.wrap_flat(Arriving(flat, sync, b.index), b, b.place.param))
        elif donate and old._local_tensor is flat:
            out.append(old)
        else:
            out.append(plan.wrap_flat(flat, b, b.place.param))
    return tuple(out)


def _master_leaves(state: State, mflats, donate: bool):
    plan, out = state.plan, {}
    for i, old in state.master_flats.items():
        b = plan.buckets[i]
        out[i] = old if donate and old._local_tensor is mflats[i] else plan.wrap_flat(mflats[i], b, b.place.opt)
    return out


def _forward(state: State, fn, *args: Any, train: bool = False, what: str = "fz.apply", collective: bool = True,
             residency: Callable[[Comm], Residency] | None = None, **kwargs: Any) -> Any:
    """Run `fn` on a Runner over the state's parameters. A `collective` call checks in first, so
    one called on one rank only fails in seconds, naming the fix, instead of hanging. With
    `residency` (the plan, decided once the ranks have checked in: it may agree over `comm`)
    the runner keeps the plan's units gathered until `fn` returns."""
    if collective:
        arrive(what, state.plan.ranks, state.plan.rank)
    peers.doing(what, int(state.step))
    raise_background_failures()
    flats, sync, _ = checked_flats(state)
    if sync is not None:
        sync.finish()
    comm = Comm(state.plan, state.spec.grad_reduce_dtype)
    state.skeleton.set_mode(train)
    # in train mode modules update buffers in place: they get copies, the state keeps its own
    buffers = {n: t.clone() for n, t in state.buffers.items()} if train else state.buffers
    order = state.metrics["order"].tolist()
    chosen = residency(comm) if residency is not None else None
    if chosen is None:
        runner = Runner(state.skeleton, state.plan, comm, list(flats), buffers, state.spec, order, backward=False)
    else:
        runner = ResidentRunner(state.skeleton, state.plan, comm, list(flats), buffers, state.spec, order,
                                backward=False, resident=chosen.resident)
    with torch.no_grad(), rng_forked(state.rng, state.plan.device), _autocast(state):
        try:
            return fn(runner, comm, *args, **kwargs)
        except BaseException as e:
            if collective:  # a call of one rank alone (stages 0-2's apply) has no collectives to break
                peers.broke(what, e)
            raise
        finally:
            if chosen is not None:
                runner.dispose()  # drops the held units
            else:
                runner.release()


def eval_step(state: State, batch: Any, *, residency: str | int | None = None,
              budget: float | None = None) -> Tensor:
    """The loss on this rank's `batch`, averaged over ranks, with the model in eval mode (dropout
    off, BatchNorm on its running statistics); no state changes. `residency` (and `budget`): a
    plan as fz.generate takes it (fz/step/residency.py); None gathers each unit per call, as
    training does. For many batches with the model gathered once, see `evaluate`."""
    return evaluate(state, [batch], residency=residency, budget=budget, what="fz.eval_step")[0]


def evaluate(state: State, batches: Iterable[Any], *, residency: str | int | None = "auto",
             budget: float | None = None, what: str = "fz.evaluate") -> list[Tensor]:
    """`[fz.eval_step(state, b) for b in batches]` in one call, so that the residency plan holds
    across batches: with "gather" (or "auto" when it fits) stage 3 gathers each unit once for all
    of them ("gather once, evaluate many"). A collective: every rank passes as many batches."""
    expect_state(state, what)
    loss_fn = state.spec.loss_fn or default_loss

    def run(runner, comm):
        out = []
        for batch in batches:
            batch = on_device(batch, state.plan.device)
            agreement = Agreement(state.plan, state.step, batch, state.spec.weight_by_rows, what)
            loss = scalar_loss(loss_fn(BoundModel(runner), batch)).detach()
            out.append(agreement.start(comm, loss, calls=runner.called).finish(comm)[0].to(loss.dtype))
            runner.release()  # streamed units dropped; the held ones stay
        return out

    plan = None if residency is None else deciding(state, residency, budget, what)
    return _forward(state, run, what=what, residency=plan)  # the loss is averaged over ranks: collective


def apply(state: State, *args: Any, train: bool = False, residency: str | int | None = None, **kwargs: Any) -> Any:
    """The model's own forward output on `args` (stage 3 gathers block by block), in eval mode;
    `train=True` runs it in train mode (dropout from the state's generator, BatchNorm on batch
    statistics) without changing the state's buffers.

    At stages 0-2 every parameter is on every rank, so one rank may call it alone (e.g. to
    print samples under `if rank == 0:`); at stage 3 it gathers, and every rank must call it."""
    expect_state(state, "fz.apply")
    args, kwargs = on_device((args, kwargs), state.plan.device)
    sharded = any(b.sharded_param for b in state.plan.buckets)
    plan = None if residency is None else deciding(state, residency, None, "fz.apply")
    return _forward(state, lambda r, comm: r(*args, **kwargs), train=train, collective=sharded, residency=plan)
