"""A train step's phases: open it, run each micro-batch's forward and backward, finish it.

`train_step` runs them back to back. A caller that drives forward and backward itself
(DeepSpeed's `engine(batch)`, `engine.backward(loss)`, `engine.step()`: fz/deepspeed/) opens
a `StepInProgress` and calls the same phases, so its step is the same computation, bit for
bit. The phases share nothing with the outside but the State they were given: the open step
holds the gradients being reduced, the runner and the step's random state, and `finish`
returns the new State.

The random state: each phase runs with the generators set from the step's own state (the
caller's restored between phases), so the draws are the ones a single `train_step` makes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.background import raise_background_failures
from fz.distributed import peers
from fz.errors import ConfigError
from fz.offload.host_grads import HostGrads
from fz.offload.transfer import pool_for
from fz.optim.transforms import current_lr
from fz.rng import capture, restore
from fz.rng import forked as rng_forked
from fz.sharding.comm import Comm
from fz.sharding.opt_state import checked_opt_state, reuse_map, wrap_opt_state
from fz.sharding.pack import checked_flats
from fz.sharding.sync import Arriving, count_cast, start_param_sync
from fz.state import State, expect_state
from fz.step.agree import Agreement
from fz.step.batches import scalar_loss
from fz.step.buffers import sync_changed, versions
from fz.step.grad_views import local_grads, whole_grad
from fz.step.grads import GradReducer
from fz.step.metrics import step_metrics
from fz.step.nonfinite import NonFinite, verdict_is_local
from fz.step.pending import join_inflight
from fz.step.runner import BoundModel, Runner
from fz.step.scaler import update_scaler
from fz.step.unused import UsedParams, unused_everywhere
from fz.step.update import GradNorms, optimizer_inputs
from fz.step.updaters import UPDATERS, UpdateInputs, update_tier
from fz.storage.disk import DiskTensor


def autocast(state: State):
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


class StepInProgress:
    """One optimizer step, opened on `state` (donated unless `donate=False`) for a batch of this
    rank's `batch` rows (its size is checked across ranks when the step finishes). With
    Spec.accumulate="mean" each micro-batch's loss counts 1/`micro_batches` (default
    Spec.grad_accum); with "sum" it counts as it is. `process_rng`: each forward and backward
    draws (dropout) from the process's generators where the script's own draws left them, and
    advances them, as an eager module's forward does (DeepSpeed's engine); else from the State's."""

    def __init__(self, state: State, batch: Any, *, donate: bool = True, what: str = "fz.train_step",
                 micro_batches: int | None = None, process_rng: bool = False):
        expect_state(state, what)
        peers.doing(what, int(state.step))
        raise_background_failures()  # e.g. an async checkpoint save that failed since the last call
        self.what, self.donate = what, donate
        self.given, offload, self.tier = state, _offload_of(state.spec), update_tier(state.spec)
        if offload is not None:  # leaves put elsewhere (replace, tree_map) go back to the policy's tier
            state = offload(state)
        self.state = state
        spec, plan, scaler = state.spec, state.plan, state.scaler
        if not any(b.trainable for b in plan.buckets):
            raise ConfigError(f"{what}: every parameter of this state's model is frozen (requires_grad=False): there "
                              "is nothing to train. It serves fz.apply, fz.eval_step and fz.generate; to train, leave "
                              "some parameters requiring grad before fz.init")
        if scaler is None:
            raise ConfigError(f"{what}: state.scaler is None; a state from fz.init has one (keep it)")
        self.scaler = scaler
        flats, sync, mflats = checked_flats(state)  # the leaves, exactly as given (ConfigError if one does not fit)
        local_opt = checked_opt_state(state.opt_state, plan)
        if not donate:  # a copy the step owns (reading the parameters waits for any still arriving)
            if sync is not None:
                sync.finish()
                sync = None
            flats = [_own(f) for f in flats]
            mflats = [None if m is None else _own(m) for m in mflats]
            local_opt = _clone_tree(local_opt)
        self.flats, self.sync, self.mflats, self.local_opt = flats, sync, mflats, local_opt
        # modules update them in place
        self.buffers = state.buffers if donate else {n: t.clone() for n, t in state.buffers.items()}
        self.before = versions(self.buffers)
        self.agreement = Agreement(plan, state.step, batch, spec.weight_by_rows, what, spec.accumulate)
        self.comm = Comm(plan, spec.grad_reduce_dtype, offload)
        self.scale = float(scaler.get("scale", 1.0))
        self.leaves = [f.detach().requires_grad_(b.trainable) for f, b in zip(flats, plan.buckets)]
        # optimizer state off the device: gradients follow it to the host as each bucket is reduced
        self.host = (HostGrads(pool_for(offload), plan.device, owner=plan, moved=self.comm.d2h)
                     if offload is not None and offload.optimizer != "device" else None)
        self.reducer = GradReducer(plan, self.comm, self.leaves, self.host)
        state.skeleton.set_mode(True)  # train_step trains: dropout on, BatchNorm on batch statistics
        self.used = UsedParams() if spec.skip_unused else None
        self.runner = Runner(state.skeleton, plan, self.comm, self.leaves, self.buffers, spec,
                             state.metrics["order"].tolist(), grad_sink=self.reducer.reduce_gathered,
                             sync=sync, used=self.used)
        self.model = BoundModel(self.runner)
        # the micro-batches' losses are averaged ("mean") or added ("sum"): the step's loss is total / divisor
        self.divisor = (micro_batches or spec.grad_accum) if spec.accumulate == "mean" else 1
        self.weight = self.scale * self.agreement.loss_weight / self.divisor
        self.total = torch.zeros((), device=plan.device)
        self.calls: list[int] = []  # the blocks each forward called, in order (checked across ranks)
        self.rng = state.rng
        self.process_rng = process_rng  # each phase draws from the process's generators and advances them
        self.closed = False

    @contextlib.contextmanager
    def _phase(self) -> Iterator[None]:
        """The step's generators for this phase; a failure breaks the step (its collectives no
        longer match the other ranks') and closes it."""
        if self.closed:
            raise ConfigError(f"{self.what}: this step is already finished or broken; open a new one")
        device = self.state.plan.device
        try:
            if self.process_rng:  # as an eager module's forward draws: where the script's own draws left them
                self.rng = capture(device)
            with rng_forked(self.rng, device) as now:
                yield
                self.rng = now()
            if self.process_rng:
                restore(self.rng, device)
        except BaseException as e:
            self.abort(e)
            raise

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(model, *args, **kwargs)` on the step's parameters (stage 3 gathers block by block),
        under the compute dtype's autocast; what it returns is the caller's (a loss, an output)."""
        with self._phase(), autocast(self.state):
            return fn(self.model, *args, **kwargs)

    def forward_aside(self, fn: Callable[..., Any], *args: Any, train: bool, **kwargs: Any) -> Any:
        """A forward that is no micro-batch of the step (an eval-mode or no_grad call between the
        step's micro-batches, as DeepSpeed's engine allows): `fn(model, ...)` on the step's
        parameters, which are the state's until the update, without grad, the model in `train`
        mode; nothing of it reaches the step's backward or its record of the blocks called."""
        called, skel = list(self.runner.called), self.state.skeleton
        with torch.no_grad(), self._phase(), autocast(self.state):
            skel.set_mode(train)
            try:
                return fn(self.model, *args, **kwargs)
            finally:
                skel.set_mode(True)
                self.runner.called = called

    def backward(self, loss: Tensor, last: bool) -> None:
        """Backpropagate one micro-batch's scalar `loss` (scaled by 1/micro-batches with
        accumulate="mean", and by the loss scale); `last`: the step's last micro-batch, whose
        gradients are reduced for the update."""
        with self._phase():
            join_inflight()  # the last step's update, if it streams on, is done before gradients need memory
            loss = scalar_loss(loss).float()
            self.reducer.last = last
            self.runner.backward(loss * self.weight)
            self.calls += self.runner.called
            self.runner.release()
            if not self.reducer.reached() and loss.requires_grad:  # before this micro-batch's reductions
                raise ConfigError(
                    "the loss's gradient reached none of the State's trainable parameters: the loss_fn (a "
                    "Trainer's compute_loss) must compute it with the `model` it is given, not with another module "
                    "or a copy of it (whose gradients fz never sees: the State would train on nothing)")
            self.reducer.end_micro_batch()
            self.total += loss.detach()
            if self.sync is not None:  # parameters no forward used
                self.sync.finish()

    def local_grads(self) -> dict[str, Tensor]:
        """The gradients this rank holds whole between micro-batches, by canonical name: views of
        the step's buffers, valid until the next backward (fz/step/grad_views.py)."""
        return {} if self.closed else local_grads(self.state.plan, self.reducer, self.comm)

    def whole_grad(self, name: str) -> Tensor | None:
        """Parameter `name`'s gradient so far, whole, in fp32 (a collective where it is reduced into
        shards: every rank calls it); None before a backward reached it."""
        return None if self.closed else whole_grad(self.state.plan, self.reducer, self.comm, name)

    def abort(self, error: BaseException | None = None) -> None:
        """Give the step up: its reductions are closed; the state it was given stays donated."""
        if self.closed:
            return
        self.closed = True
        if error is not None:
            peers.broke(self.what, error)
        self.reducer.close()

    def finish(self) -> tuple[State, Tensor]:
        """The update: returns (new state, mean loss over all ranks)."""
        if self.closed:
            raise ConfigError(f"{self.what}: this step is already finished or broken; open a new one")
        self.closed = True
        self.reducer.close()
        state, spec, plan, comm, reducer = self.state, self.state.spec, self.state.plan, self.comm, self.reducer
        donate, agreement, buffers = self.donate, self.agreement, self.buffers
        reducer.reduce_across_replicas()
        sync_changed(comm, buffers, self.before, spec.buffer_sync, state.skeleton.running_stats)  # equal on every rank
        order, live = self.runner.order, self.runner.live
        self.runner.dispose()
        del self.runner, self.model
        flats, mflats, local_opt, used = self.flats, self.mflats, self.local_opt, self.used
        with torch.no_grad():
            grads, params, sharded = optimizer_inputs(plan, reducer, flats, mflats, 1.0 / self.scale)
            reducer.dispose()
            del self.leaves, self.reducer, reducer
            guard = NonFinite(spec, plan, int(state.step), self.scaler)
            # with clipping, the gradients' norms are taken once: the check reads them, the clip sums them
            norms = GradNorms(grads, sharded, comm.world) if spec.clip_grad_norm is not None else None
            # the loss all-reduce, with every rank's step, batch size, blocks called and non-finite finding
            agreement.start(comm, self.total / self.divisor, guard.check(grads, norms), self.calls)
            if spec.weight_by_rows or not verdict_is_local(plan):  # needed before the update
                _, factor = agreement.finish(comm)
                if factor != 1.0:
                    torch._foreach_mul_(list(grads.values()), factor)
                    norms = None  # of the gradients before this scaling
            overflow = guard.skip(agreement, comm)
            new_sync, norm = None, None
            release = self.host.release if self.host is not None else None
            if not overflow:
                skip = unused_everywhere(comm, list(grads), used.used) if used is not None else set()
                # the host gradients go back to their pool once the update is done (it may stream on)
                after, release = (release, None) if self.tier == "disk" else (None, release)
                if self.host is not None and self.tier == "disk":  # each bucket's gradients go once updated
                    self.host.hand_over()
                inputs = UpdateInputs(local_opt, grads, params, flats, mflats, sharded, skip, donate, norms, after)
                try:
                    up = UPDATERS[self.tier](spec, comm, plan, inputs)
                except BaseException as e:
                    if donate and self.tier == "disk":
                        self.given.donate()
                        if hasattr(e, "add_note"):  # Python >= 3.11
                            e.add_note(
                                f"{self.what} failed while streaming the offloaded optimizer state; the state "
                                "it was given is consumed (donated; its in-memory parameters may be partly "
                                "updated): restore the last checkpoint. With donate=False the input state stays whole."
                            )
                    raise
                del inputs, norms
                local_opt, norm, flats, mflats = up.local_opt, up.norm, up.flats, up.mflats
                # what the parameters come from: the masters still to cast, or the rows already landed
                sources = [up.ready.get(i, None if i in up.cast else m) for i, m in enumerate(mflats)]
                for i in up.cast:  # cast by the update's own pass: counted as the copy it stands for
                    if (master := mflats[i]) is not None:
                        count_cast(comm, flats[i], master)
                new_sync = start_param_sync(comm, plan, flats, sources)
        del grads, params
        if release is not None:
            release()
        if agreement.result is None:  # waited for while the optimizer ran
            try:
                agreement.finish(comm)
            except ConfigError:
                if donate:  # its buffers took this update in place: no silent reuse
                    state.donate()
                raise
        loss = agreement.finish(comm)[0]  # its result, kept from the first call

        scaler = update_scaler(spec, self.scaler, overflow)
        opt_state = wrap_opt_state(local_opt, plan, reuse_map(state.opt_state) if donate else None)
        new = state.replace(step=state.step + 1, rng=self.rng, scaler=scaler, opt_state=opt_state, buffers=buffers,
                            param_flats=_param_leaves(state, flats, new_sync, donate),
                            master_flats=_master_leaves(state, mflats, donate),
                            metrics=step_metrics(order, comm, live, norm, _lr(opt_state), scaler))
        if donate:
            self.given.donate()
            state.donate()
        self.state = self.given = None  # type: ignore[assignment]  # the step holds no state once finished
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
