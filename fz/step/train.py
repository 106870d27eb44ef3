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

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from fz.background import raise_background_failures
from fz.distributed import peers
from fz.distributed.arrival import arrive
from fz.rng import forked as rng_forked
from fz.sharding.comm import Comm
from fz.sharding.pack import checked_flats
from fz.state import State, expect_state
from fz.step.agree import Agreement
from fz.step.batches import default_loss, micro_batches, on_device, scalar_loss
from fz.step.phases import StepInProgress, autocast
from fz.step.residency import Residency, ResidentRunner, deciding
from fz.step.runner import BoundModel, Runner


def train_step(state: State, batch: Any, *, donate: bool = True) -> tuple[State, Tensor]:
    """One optimizer step on this rank's `batch`; returns (new state, mean loss over all ranks).

    `batch` holds `grad_accum * micro_batch` rows, cut into micro-batches here, or is an
    `fz.MicroBatches` of micro-batches collated apart (their shapes and count may differ). The
    step's loss is the mean of the micro-batches' losses (Spec.accumulate="mean") or their sum
    ("sum"), averaged over ranks.

    With `donate=True` (the default) the new state takes over the old one's buffers and
    the old state can no longer be used; `donate=False` copies them first. A step whose
    gradients hold a NaN or inf on any rank changes only the step count, RNG and scaler
    (Spec.nonfinite="skip", fp16 overflows too) or raises fz.NonFiniteError ("raise").
    """
    expect_state(state, "fz.train_step")
    spec = state.spec
    micro = micro_batches(on_device(batch, state.plan.device), spec.grad_accum, spec.micro_batch)
    loss_fn: Callable[[Any, Any], Any] = spec.loss_fn or default_loss  # gets a BoundModel, as a module
    step = StepInProgress(state, batch, donate=donate, micro_batches=len(micro))
    for i, mb in enumerate(micro):
        step.backward(step.forward(loss_fn, mb), last=i == len(micro) - 1)
    return step.finish()


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
    with torch.no_grad(), rng_forked(state.rng, state.plan.device), autocast(state):
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
            agreement = Agreement(state.plan, state.step, batch, state.spec.weight_by_rows, what,
                                  state.spec.accumulate)
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


def apply_call(state: State, fn: Callable[..., Any], *args: Any, train: bool = False, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` run as the model's own forward runs in `apply`: the root's tensors
    bound in the model (and `fn` reading them), its blocks gathering as they are called. For a
    forward put in the model's place (TRL's forward redirection runs its loss, or a backbone call,
    through the model's call) and submodules called from outside the root's forward."""
    expect_state(state, "fz.apply")
    args, kwargs = on_device((args, kwargs), state.plan.device)
    sharded = any(b.sharded_param for b in state.plan.buckets)
    return _forward(state, lambda r, comm: r.inside(fn, *args, **kwargs), train=train, collective=sharded)
